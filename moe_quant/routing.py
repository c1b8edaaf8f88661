"""Token order of a top-k MoE block: copies of each token grouped by expert, and back.

One home for the permutation the reference block (:class:`moe_quant.moe.MoE`) and the expert-parallel
dispatcher (:mod:`moe_quant.ep.dispatcher`) share; both must do exactly the same arithmetic for the
EP block to be bit-identical to the single-process one.
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


def unsort_tokens(routed_out: torch.Tensor, scores_sorted: torch.Tensor, token_idx: torch.Tensor,
                  x_TD: torch.Tensor) -> torch.Tensor:
    """Scale each expert output row by its routing score (in the output's dtype) and sum the ``K`` rows
    of each token back into token order (in sorted order, the sums of ``index_add``); ``(T, D)`` of
    ``x_TD``'s dtype.

    The sum is ``scatter_add`` over the row index broadcast along D (a view): its backward keeps only the
    index, where ``index_add``'s keeps its source too, a second ``(T*K, D)`` tensor per MoE layer alive
    until backward (2.25 GiB over torchtitan's DeepSeek-V3 16B cut to 4 layers, 16384 tokens)."""
    routed_out = routed_out * scores_sorted.unsqueeze(-1).to(routed_out.dtype)
    index = token_idx.unsqueeze(-1).expand(-1, routed_out.shape[-1])
    out = torch.zeros_like(x_TD, dtype=routed_out.dtype).scatter_add(0, index, routed_out)
    return out.to(x_TD.dtype)


__all__ = ["sort_tokens_by_expert", "unsort_tokens"]
