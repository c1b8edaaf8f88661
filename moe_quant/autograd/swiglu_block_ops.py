"""The SwiGLU expert block under ``torch.compile``: its forward and backward as two custom ops,
``torch.ops.moe_quant.swiglu_block_fwd`` and ``torch.ops.moe_quant.swiglu_block_bwd``, joined by
``torch.library.register_autograd``.

Traced through, the block's autograd function is inlined into AOTAutograd's joint graph, whose partitioner then
chooses what the forward keeps for the backward: on 2026-12-02 it kept x in bf16, a third ``(M, H)`` bf16 tensor
and the three weights' dequantized backward operands (made in the forward), 3.6 times what the block keeps
eager (``scripts/probes/compiled_saved_probe.py``). Two opaque ops leave it nothing to choose: the forward op
returns ``y`` and exactly what the eager block saves (``a`` and ``b``, or ``[a | b]``, and x's colwise fp8 form,
scales and padded offsets), ``setup_context`` saves those, and the backward op reads them. Both ops run
:func:`.swiglu_block.block_forward` and :func:`.swiglu_block.block_backward`, the functions the eager autograd
function runs: the same bits. Their fake implementations run the same functions on fake tensors (every pass
in them has a fake implementation), so shapes, dtypes and strides are the real ones by construction, for
symbolic and unbacked M alike. No reuse scope serves a compiled block (:mod:`moe_quant.reuse`).
"""

from __future__ import annotations

import torch

from ..backends import GemmBackend
from ..numerics import ScaleMode
from .swiglu_block import block_backward, block_forward, first_order_only


def _forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, offs: torch.Tensor,
             mode: str, backend: str, keep_x: bool) -> list[torch.Tensor]:
    """``[y, *saved]`` (:func:`.swiglu_block.block_forward`)."""
    y, saved = block_forward(x, w1, w3, w2, offs, ScaleMode(mode), GemmBackend(backend), (), keep_x)
    return [y, *saved]


def _backward_grads(grad_y: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor,
                    offs: torch.Tensor, saved: list[torch.Tensor], mode: str, backend: str, needs: list[bool],
                    x_dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients ``needs`` (the flags of x, w1, w3, w2) asks for, in that order
    (:func:`.swiglu_block.block_backward`)."""
    grads = block_backward(grad_y, w1, w3, w2, offs, list(saved), ScaleMode(mode), GemmBackend(backend), (),
                           tuple(needs), x_dtype)
    return [g for g in grads if g is not None]


_fwd_op = torch.library.custom_op("moe_quant::swiglu_block_fwd", _forward, mutates_args=())
_bwd_op = torch.library.custom_op("moe_quant::swiglu_block_bwd", _backward_grads, mutates_args=())
# the fake implementations are the functions themselves, on fake tensors
_fwd_op.register_fake(_forward)
_bwd_op.register_fake(_backward_grads)


def _setup_context(ctx, inputs, output):
    """Save what the eager block saves: the weights, the offsets and the forward op's saved forms (not
    differentiable: no gradient is ever materialized for them)."""
    x, w1, w3, w2, offs, mode, backend, _ = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(w1, w3, w2, offs, *saved)
    ctx.mode, ctx.backend, ctx.x_dtype = mode, backend, x.dtype


def _backward(ctx, grads):
    """The backward op's gradients in the positions of the inputs they belong to."""
    grad_y = grads[0]
    if grad_y is None:  # only the saved forms' (non-differentiable) gradients: nothing flows back
        return (None,) * 8
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    w1, w3, w2, offs, *saved = ctx.saved_tensors
    out = iter(_bwd_op(grad_y, w1, w3, w2, offs, saved, ctx.mode, ctx.backend, needs, ctx.x_dtype))
    grads = tuple(next(out) if n else None for n in needs)
    return (*first_order_only(grads, grad_y, w1, w3, w2), None, None, None, None)


torch.library.register_autograd("moe_quant::swiglu_block_fwd", _backward, setup_context=_setup_context)

__all__: list[str] = []  # registers torch.ops.moe_quant.swiglu_block_fwd / _bwd; nothing to import by name
