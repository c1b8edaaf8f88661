"""The per-GEMM MXFP8 path (:func:`.grouped_mm.mxfp8_grouped_mm`) under ``torch.compile``: its forward as the custom
op ``torch.ops.moe_quant.grouped_mm_fwd``, its backward as one custom op per stage of
:func:`.grouped_mm.input_grads` (``grouped_mm_bwd_a_operand``, ``_wgrad``, ``_g_operand``, ``_dgrad``), joined by
``torch.library.register_autograd``.

Traced through, the autograd function is inlined into AOTAutograd's joint graph, whose partitioner then chooses
what the forward keeps for the backward: on 2026-12-02 (torch 2.13, CPU) the three GEMMs of a SwiGLU block written
per GEMM (:func:`.swiglu_block.swiglu_experts_unfused`) kept the weights' dequantized dgrad operands, made in the
forward, beside x and the block's ``(M, H)`` tensors: 3968 bytes a routed row against eager's 2048 at D 256, H 192
(``scripts/probes/compiled_saved_probe.py --path unfused``). Opaque ops leave it nothing to choose: the forward op
returns the output alone, ``setup_context`` saves what the eager function saves (``A`` where the weight's gradient
is needed, ``W_t`` where ``A``'s is, the offsets), and the backward ops make the weight's dgrad operand themselves.

One backward op per operand and per GEMM, because an op's inputs live until it returns while the compiled backward
graph frees each of its inputs after the last op that reads it: ``A`` dies when the op that makes its wgrad operand
returns, before the wgrad GEMM; ``grad_out``, where the backward graph made it (the gradient of an earlier op of
the same graph), when the op that makes its rowwise form returns, before the dgrad GEMM (eager autograd holds a
backward's output gradient until it returns). Ops that could run earlier than :func:`.grouped_mm.input_grads`'
order (wgrad first: its operands are freed before dA exists) also take a tensor they do not read (``after``), since
the graph orders ops by their inputs alone (:class:`_OpStages`).

Every op runs the functions the eager autograd function runs (:func:`.grouped_mm.output`,
:func:`.grouped_mm.backward_a_operand`, ... :func:`.grouped_mm.backward_dgrad`, in :func:`.grouped_mm.input_grads`'
order): the same bits. The fake implementations are the same functions on fake tensors (every pass in them has a
fake implementation), so shapes, dtypes and strides are the real ones by construction, for symbolic and unbacked M
alike. No reuse scope serves a compiled GEMM (:mod:`moe_quant.reuse`).
"""

from __future__ import annotations

import torch

from ..backends import GemmBackend
from ..numerics import ScaleMode
from .grouped_mm import (backward, backward_a_operand, backward_dgrad, backward_g_operand, backward_wgrad, output,
                         save_for_backward)


def _forward(A: torch.Tensor, W_t: torch.Tensor, offs: torch.Tensor, mode: str, out_dtype: torch.dtype,
             backend: str, revision: int) -> torch.Tensor:
    """``A @ W_t`` per group (:func:`.grouped_mm.output`); ``revision``: :data:`.grouped_mm.COMPILED_REVISION`,
    read by nothing, there to be in the traced graph's code."""
    return output(A, W_t, offs, ScaleMode(mode), out_dtype, GemmBackend(backend), ())


def _a_operand(A: torch.Tensor, offs: torch.Tensor, mode: str, backend: str,
               after: list[torch.Tensor]) -> list[torch.Tensor]:
    """A's wgrad operand's tensors (:func:`.grouped_mm.backward_a_operand`). ``after``: read by nothing
    (:class:`_OpStages`)."""
    return list(backward_a_operand([A], offs, ScaleMode(mode), GemmBackend(backend)))


def _wgrad(grad_out: torch.Tensor, a_col: list[torch.Tensor], offs: torch.Tensor, mode: str, backend: str,
           w_dtype: torch.dtype) -> torch.Tensor:
    """``dW (E, N, K)`` (:func:`.grouped_mm.backward_wgrad`) from A's operand's tensors."""
    return backward_wgrad(grad_out, tuple(a_col), offs, ScaleMode(mode), GemmBackend(backend), w_dtype)


def _g_operand(grad_out: torch.Tensor, offs: torch.Tensor, mode: str, backend: str,
               after: list[torch.Tensor]) -> list[torch.Tensor]:
    """grad_out's dgrad operand's tensors (:func:`.grouped_mm.backward_g_operand`); where grad_out arrived in MXFP8
    (expert parallelism's wire) on the emulated GEMM that operand is grad_out itself, which an op may not return: a
    copy then. ``after``: read by nothing (:class:`_OpStages`)."""
    form = backward_g_operand(grad_out, offs, ScaleMode(mode), GemmBackend(backend))
    return [t.clone() if t is grad_out else t for t in form]


def _dgrad(g_row: list[torch.Tensor], W_t: torch.Tensor, offs: torch.Tensor, mode: str, backend: str,
           a_dtype: torch.dtype) -> torch.Tensor:
    """``dA (M, K)`` (:func:`.grouped_mm.backward_dgrad`) from grad_out's dgrad operand's tensors."""
    return backward_dgrad(tuple(g_row), W_t, offs, ScaleMode(mode), GemmBackend(backend), (), a_dtype)


_fwd_op = torch.library.custom_op("moe_quant::grouped_mm_fwd", _forward, mutates_args=())
_a_operand_op = torch.library.custom_op("moe_quant::grouped_mm_bwd_a_operand", _a_operand, mutates_args=())
_wgrad_op = torch.library.custom_op("moe_quant::grouped_mm_bwd_wgrad", _wgrad, mutates_args=())
_g_operand_op = torch.library.custom_op("moe_quant::grouped_mm_bwd_g_operand", _g_operand, mutates_args=())
_dgrad_op = torch.library.custom_op("moe_quant::grouped_mm_bwd_dgrad", _dgrad, mutates_args=())
# the fake implementations are the functions themselves, on fake tensors
for _op, _fn in ((_fwd_op, _forward), (_a_operand_op, _a_operand), (_wgrad_op, _wgrad), (_g_operand_op, _g_operand),
                 (_dgrad_op, _dgrad)):
    _op.register_fake(_fn)


class _OpStages:
    """:class:`.grouped_mm.BackwardStages` with each stage one op call (one instance per backward). The graph orders
    ops by their inputs alone, and inductor's scheduler may run an op whose inputs exist earlier: so A's operand op
    takes grad_out (``after``; A exists from the backward's start, grad_out only once this GEMM's backward can run),
    and grad_out's operand op the weight gradient where the wgrad op made one (run first, grad_out's rowwise form
    and then dA would live beside wgrad's operands)."""

    def __init__(self, grad_out):
        self.dW, self.grad_out = None, grad_out

    def a_operand(self, held, offs, mode, backend):
        return tuple(_a_operand_op(held.pop(), offs, mode.value, backend.value, [self.grad_out]))

    def wgrad(self, grad_out, a_col, offs, mode, backend, w_dtype):
        self.dW = _wgrad_op(grad_out, list(a_col), offs, mode.value, backend.value, w_dtype)
        return self.dW

    def g_operand(self, grad_out, offs, mode, backend):
        after = [] if self.dW is None else [self.dW]
        return tuple(_g_operand_op(grad_out, offs, mode.value, backend.value, after))

    def dgrad(self, g_row, W_t, offs, mode, backend, scopes, a_dtype):
        return _dgrad_op(list(g_row), W_t, offs, mode.value, backend.value, a_dtype)


def _setup_context(ctx, inputs, output):
    """Save what the eager function saves (:func:`.grouped_mm.save_for_backward`)."""
    A, W_t, offs, mode, _, backend, _ = inputs
    save_for_backward(ctx, A, W_t, offs)
    ctx.mode, ctx.backend, ctx.reuse_scopes = ScaleMode(mode), GemmBackend(backend), ()


def _backward(ctx, grad_out):
    """:func:`.grouped_mm.backward` with its stages as ops; the gradients in the positions of ``A`` and ``W_t``."""
    return (*backward(ctx, grad_out, _OpStages(grad_out)), None, None, None, None, None)


torch.library.register_autograd("moe_quant::grouped_mm_fwd", _backward, setup_context=_setup_context)

__all__: list[str] = []  # registers the torch.ops.moe_quant.grouped_mm_* ops; nothing to import by name
