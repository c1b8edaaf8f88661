"""Token order of a top-k MoE block: copies of each token grouped by expert, and back.

One home for the permutation the reference block (:class:`moe_quant.moe.MoE`) and the expert-parallel
dispatcher (:mod:`moe_quant.ep.dispatcher`) share; both must do exactly the same arithmetic for the
EP block to be bit-identical to the single-process one. The arithmetic is torchtitan's (0.3.0,
``LocalTokenDispatcher`` / ``AllToAllTokenDispatcher``): the sort is its ``_local_reorder`` and the
combine scales each expert output row by its routing score in fp32, rounds to the output's dtype and
sums each token's rows as ``scatter_add`` on the CPU does (``tests/test_routing.py`` compares the two bit for bit,
gradients included), in one order on every device (deterministic for any top-k).
"""

from __future__ import annotations

import torch


def sort_tokens_by_expert(x_TD: torch.Tensor, top_scores_TK: torch.Tensor, expert_ids_TK: torch.Tensor):
    """``(x_sorted (T*K, D), token_idx (T*K,), scores_sorted (T*K,))``: the ``K`` copies of each token
    ordered by expert id, stably (token order within an expert)."""
    top_k = expert_ids_TK.shape[-1]
    order = torch.argsort(expert_ids_TK.reshape(-1), stable=True)
    token_idx = order // top_k
    return x_TD[token_idx], token_idx, top_scores_TK.reshape(-1)[order]


_NARROW = (torch.bfloat16, torch.float16, torch.float32)  # widened to fp32 exactly, inside the multiply


def _times_fp32(rows: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``rows.to(float32) * col`` (``col`` fp32): for a bf16 / fp16 / fp32 ``rows`` PyTorch's type promotion
    widens each element inside the multiply (exact, the same products), with no fp32 copy of ``rows``."""
    return rows * col if rows.dtype in _NARROW else rows.to(torch.float32) * col


class _ScaleRows(torch.autograd.Function):
    """``rows (N, D) * scores (N,)`` in fp32, rounded to ``rows``' dtype: the values and gradients of
    torchtitan's ``(rows.to(float32) * scores.reshape(-1, 1)).to(rows.dtype)``, which autograd would run
    with an fp32 copy of ``rows`` made in forward and saved for the score gradient; here ``rows`` is saved in
    its own dtype (half the bytes for bf16) and neither pass writes an fp32 copy of it (the multiplies widen
    its elements as they read them: the same values)."""

    generate_vmap_rule = True  # torch.func transforms (vmap, grad) of the reference MoE

    @staticmethod
    def forward(rows, scores):
        return _times_fp32(rows, scores.reshape(-1, 1).to(torch.float32)).to(rows.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, scores = inputs
        ctx.save_for_backward(rows, scores)

    @staticmethod
    def backward(ctx, grad):
        rows, scores = ctx.saved_tensors
        s = scores.reshape(-1, 1).to(torch.float32)
        grad_rows = _times_fp32(grad, s).to(rows.dtype) if ctx.needs_input_grad[0] else None
        # autograd's reduction of a broadcast (N, 1) operand: sum over dim 1, keepdim (then the view back)
        grad_scores = _times_fp32(rows, grad.to(torch.float32)).sum(1, keepdim=True).reshape(scores.shape) \
            if ctx.needs_input_grad[1] else None
        return grad_rows, grad_scores


def scale_rows(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``rows (N, D)`` times ``scores (N,)``, in fp32, rounded to ``rows``' dtype (torchtitan's combine)."""
    return _ScaleRows.apply(rows, scores)


def sum_topk_rows(rows: torch.Tensor, token_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``(num_tokens, D)``: each token's rows of ``rows (T*K, D)`` (in sorted order; ``token_idx`` their tokens,
    each token K times) summed in one order on every device and run: in sorted (expert) order, one row after the
    other, accumulated in fp32 from zero and rounded once to ``rows``' dtype -- the sum the CPU's ``scatter_add`` into
    zeros computes, its bits. CUDA's ``scatter_add`` adds a token's rows in whatever order its atomics meet (bf16
    rounded at each add), so for top-k > 2 its bits varied from run to run; a reduction kernel (``sum`` over K) has
    an order of its own, which differs with the layout. Here: a gather and K elementwise adds. No host read: K is
    ``rows.shape[0] // num_tokens``."""
    if num_tokens == 0:  # no rows either: themselves (the graph stays connected: EP ranks with no tokens)
        return rows
    by_token = torch.argsort(token_idx, stable=True)  # each token's rows together, still in sorted order
    parts = rows[by_token].view(num_tokens, -1, rows.shape[-1]).unbind(1)  # unbind's backward: one stack
    acc = parts[0].to(torch.float32) + 0.0  # + 0.0: from zero, as into zeros (-0.0 rows give +0.0)
    for part in parts[1:]:
        acc.add_(part)  # fp32 += rows' dtype: each element widened as it is read
    return acc.to(rows.dtype)


def unsort_tokens(routed_out: torch.Tensor, scores_sorted: torch.Tensor, token_idx: torch.Tensor,
                  x_TD: torch.Tensor, scatter_add=None) -> torch.Tensor:
    """Scale each expert output row by its routing score (:func:`scale_rows`: fp32, rounded to the output's
    dtype) and sum the ``K`` rows of each token back into token order; ``(T, D)`` of ``x_TD``'s dtype.

    The sum is :func:`sum_topk_rows` (one order on every device: deterministic for any top-k; its backward keeps
    only the token indices, where ``index_add``'s keeps its source too, a second ``(T*K, D)`` tensor per MoE
    layer alive until backward). ``scatter_add(out, index, src)``: sum with this op of ``Tensor.scatter_add(0,
    index, src)``'s meaning instead, over the row index broadcast along D (the torchtitan dispatcher passes
    torchtitan's deterministic one, so that its sums are torchtitan's for any top-k)."""
    routed_out = scale_rows(routed_out, scores_sorted)
    if scatter_add is None:
        return sum_topk_rows(routed_out, token_idx, x_TD.shape[0]).to(x_TD.dtype)
    index = token_idx.unsqueeze(-1).expand(-1, routed_out.shape[-1])
    out = torch.zeros_like(x_TD, dtype=routed_out.dtype)
    return scatter_add(out, index, routed_out).to(x_TD.dtype)


__all__ = ["sort_tokens_by_expert", "scale_rows", "sum_topk_rows", "unsort_tokens"]
