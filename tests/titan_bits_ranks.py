"""Gloo CPU ranks for ``tests/test_torchtitan_dispatch_bits.py``: the converted torchtitan model's dispatcher
(what ``moe_quant.ep.titan``'s converter installs) against torchtitan 0.3.0's own dispatchers
(``LocalTokenDispatcher`` with EP off, ``AllToAllTokenDispatcher`` with EP over the world), the same
converted experts and inputs: output, input gradient, routing-score gradient and weight gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

import titan_ranks


def _grads(block, x, scores, ids, counts, gout):
    x = x.clone().requires_grad_()
    scores = scores.clone().requires_grad_()
    for p in block.parameters():
        p.grad = None
    out = block(x, scores, ids, counts)
    (out.float() * gout.float()).sum().backward()
    ws = (block.inner_experts.w1_EFD, block.inner_experts.w2_EDF, block.inner_experts.w3_EFD)
    return [out.detach(), x.grad, scores.grad] + [w.grad.clone() for w in ws]


def run(wire: str, ep: bool, tokens=None, dtype: str = "bfloat16") -> dict:
    """Per rank: for each of (output, input grad, score grad, w1/w2/w3 grads) whether ours equals
    torchtitan's bit for bit, and the SQNR (dB) where not. ``dtype``: the activations' (the experts are bf16)."""
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    from moe_quant.ep import WireLog
    from moe_quant.ep.titan import dispatcher_config

    set_spmd_backend("partial_dtensor")  # plain process groups (its default needs torchtitan's trainer set-up)
    E, K = titan_ranks.E, titan_ranks.K
    theirs_cfg = (AllToAllTokenDispatcher if ep else LocalTokenDispatcher).Config(num_experts=E, top_k=K)
    ours_cfg = dispatcher_config(num_experts=E, top_k=K, wire=wire)
    args = titan_ranks._inputs(tokens, getattr(torch, dtype))
    with WireLog() as log:
        ours = _grads(titan_ranks._block(ours_cfg, ep), *args)
    theirs = _grads(titan_ranks._block(theirs_cfg, ep), *args)
    names = ("out", "x_grad", "score_grad", "w1_grad", "w2_grad", "w3_grad")
    rows, nbytes = log.by_leg("dispatch")
    return {"rank": dist.get_rank(), "rows": int(args[3].sum()), "dispatch_bytes_per_row": nbytes / max(rows, 1),
            "equal": {n: titan_ranks._bits_equal(a, b) if a.dtype != torch.float32 else torch.equal(a, b)
                      for n, a, b in zip(names, ours, theirs)},
            "sqnr": {n: titan_ranks._sqnr(b, a) for n, a, b in zip(names, ours, theirs)},
            "score_grad_nonzero": bool(ours[2].abs().sum() > 0)}


__all__ = ["run"]
