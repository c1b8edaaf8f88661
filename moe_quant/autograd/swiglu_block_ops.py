"""The SwiGLU expert block under ``torch.compile``: its forward as the custom op
``torch.ops.moe_quant.swiglu_block_fwd``, its backward as one custom op per stage of
:func:`.swiglu_block.block_backward` (``swiglu_block_bwd_dswiglu``, ``_dgrad``, ``_x_operand``, ``_wgrad``),
joined by ``torch.library.register_autograd``.

Traced through, the block's autograd function is inlined into AOTAutograd's joint graph, whose partitioner then
chooses what the forward keeps for the backward: on 2026-12-02 it kept x in bf16, a third ``(M, H)`` bf16 tensor
and the three weights' dequantized backward operands (made in the forward), 3.6 times what the block keeps
eager (``scripts/probes/compiled_saved_probe.py``). Opaque ops leave it nothing to choose: the forward op
returns ``y`` and exactly what the eager block saves (``a`` and ``b``, or ``[a | b]``, and x's colwise fp8 form,
scales and padded offsets), ``setup_context`` saves those, and the backward ops read them.

The backward is one op per stage, not one op, because an op's inputs live until it returns: the compiled
backward graph frees each of its inputs after the last op that reads it (the boxed calling convention: the
graph owns its inputs and drops each after its last use, in aot_eager's and inductor's generated code alike),
so ``a`` and ``b`` die when the dSwiGLU op returns, before dx's GEMMs, a rowwise form of grad_a or grad_b when
its dx GEMM returns, x's kept fp8 form once dequantized for the weight gradients (the emulated GEMM), and a fp8
colwise form of grad_a or grad_b (``dswiglu_cols_fp8``) once dequantized by its own op just before its weight
gradient's op (inside that op it would live through the GEMM), as in the eager backward
(:func:`.saved.free_saved`). ``tests/test_compile_saved.py`` checks it.

Every op runs the stage functions the eager autograd function runs (:class:`.swiglu_block.BackwardStages`,
:func:`.swiglu_block.block_forward`), in the order :func:`.swiglu_block.block_backward` gives both paths: the
same bits. An op takes and returns flat tensor lists; the forms of grad_a and grad_b (tuples whose length
depends only on the GEMM backend) are flattened around the op calls here, their padded offsets once (one op may
not return a tensor twice). The fake implementations run the same functions on fake tensors (every pass in them
has a fake implementation), so shapes, dtypes and strides are the real ones by construction, for symbolic and
unbacked M alike. No reuse scope serves a compiled block (:mod:`moe_quant.reuse`).
"""

from __future__ import annotations

import torch

from ..backends import GemmBackend
from ..numerics import ScaleMode
from .swiglu_block import (backward_cols_operand, backward_dgrad, backward_dswiglu, backward_wgrad, backward_x_operand,
                           block_backward, block_forward, first_order_only)


def _forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, offs: torch.Tensor,
             mode: str, backend: str, keep_x: bool, cols_fp8: bool, revision: int) -> list[torch.Tensor]:
    """``[y, *saved]`` (:func:`.swiglu_block.block_forward`); ``cols_fp8``: for the backward (``dswiglu_cols_fp8``);
    ``revision``: :data:`.swiglu_block.COMPILED_REVISION`, read by nothing, there to be in the traced graph's
    code."""
    y, saved = block_forward(x, w1, w3, w2, offs, ScaleMode(mode), GemmBackend(backend), (), keep_x)
    return [y, *saved]


# ----------------------------------------------------------------------------- the forms across op boundaries


def _arity(fake: bool, cols_fp8: bool = False) -> tuple[int, int]:
    """Tensors in a rowwise and in a colwise form: ``(values,)`` and ``(values_t, poffs)`` on the emulated GEMM
    (``cols_fp8``: dSwiGLU's colwise forms ``(data_t, scales, poffs)``), ``(data, scales)`` and ``(data_t, scales,
    poffs)`` on the scaled one."""
    return (1, 3 if cols_fp8 else 2) if fake else (2, 3)


def _flat(rows: list, cols: list) -> list[torch.Tensor]:
    """The rowwise forms' tensors, then the colwise forms' without their padded offsets (the same values in every
    colwise form, often the same tensor), then those offsets once."""
    return [t for f in rows for t in f] + [t for f in cols for t in f[:-1]] + [f[-1] for f in cols[:1]]


def _unflat(flat: list, n_rows: int, n_cols: int, fake: bool, cols_fp8: bool = False) -> tuple[list, list]:
    """:func:`_flat`'s ``(rows, cols)`` from its list and the number of forms of each kind."""
    r, c = _arity(fake, cols_fp8)
    rows = [tuple(flat[i * r:(i + 1) * r]) for i in range(n_rows)]
    body = flat[n_rows * r:]
    cols = [(*body[i * (c - 1):(i + 1) * (c - 1)], body[-1]) for i in range(n_cols)]
    return rows, cols


def _n_forms(concat: bool, fake: bool) -> int:
    """Forms of each kind that dSwiGLU makes: one of ``[grad_a | grad_b]`` (concatenated weight, emulated GEMM:
    :func:`moe_quant.block_quantize.dswiglu_stacked`), else grad_a's and grad_b's."""
    return 1 if concat and fake else 2


# ----------------------------------------------------------------------------- the backward's stages as ops


def _dswiglu(grad_y: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, ab: list[torch.Tensor], mode: str,
             backend: str, concat: bool, need_w2: bool, need_rows: bool, need_cols: bool,
             cols_fp8: bool) -> list[torch.Tensor]:
    """``[dw2 (where needed), *forms]`` (:func:`.swiglu_block.backward_dswiglu`, :func:`_flat`)."""
    dw2, rows, cols = backward_dswiglu(grad_y, w2, offs, list(ab), concat, ScaleMode(mode), GemmBackend(backend),
                                       (), need_w2, need_rows, need_cols, cols_fp8)
    return ([dw2] if need_w2 else []) + _flat(rows, cols)


def _dgrad(rows: list[torch.Tensor], w: torch.Tensor, offs: torch.Tensor, mode: str, backend: str,
           x_dtype: torch.dtype, acc: torch.Tensor | None) -> torch.Tensor:
    """One of dx's GEMMs plus ``acc`` (:func:`.swiglu_block.backward_dgrad`) from one or two rowwise forms'
    tensors."""
    gemm = GemmBackend(backend)
    fake = gemm is GemmBackend.EMULATED
    forms, _ = _unflat(list(rows), len(rows) // _arity(fake)[0], 0, fake)
    return backward_dgrad(forms, w, offs, ScaleMode(mode), gemm, (), x_dtype, acc)


def _x_operand(x_kept: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """The emulated GEMM's bf16 colwise operand of x (:func:`.swiglu_block.backward_x_operand`), its padded offsets
    left out (those of the kept form: an op returns no input). ``after``: read by nothing (:class:`_OpStages`)."""
    return backward_x_operand(list(x_kept), True)[0]


def _cols_operand(cols: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    """The emulated GEMM's bf16 colwise values of dSwiGLU's fp8 colwise forms (:func:`_flat`'s tensors of one weight's
    forms; :func:`.swiglu_block.backward_cols_operand`), their padded offsets left out (an op returns no input).
    ``after``: read by nothing (:class:`_OpStages`)."""
    _, forms = _unflat(list(cols), 0, (len(cols) - 1) // 2, True, True)
    return [values for values, _ in backward_cols_operand(forms)]


def _wgrad(cols: list[torch.Tensor], x_col: list[torch.Tensor], offs: torch.Tensor, backend: str,
           w_dtype: torch.dtype, after: list[torch.Tensor]) -> torch.Tensor:
    """A gate-up weight's gradient (:func:`.swiglu_block.backward_wgrad`) from one or two colwise forms' tensors
    (:func:`_flat`) and x's colwise operand. ``after``: read by nothing (:class:`_OpStages`)."""
    gemm = GemmBackend(backend)
    fake = gemm is GemmBackend.EMULATED
    _, forms = _unflat(list(cols), 0, (len(cols) - 1) // (_arity(fake)[1] - 1), fake)
    return backward_wgrad(forms, tuple(x_col), offs, gemm, w_dtype)


_fwd_op = torch.library.custom_op("moe_quant::swiglu_block_fwd", _forward, mutates_args=())
_dswiglu_op = torch.library.custom_op("moe_quant::swiglu_block_bwd_dswiglu", _dswiglu, mutates_args=())
_dgrad_op = torch.library.custom_op("moe_quant::swiglu_block_bwd_dgrad", _dgrad, mutates_args=())
_x_operand_op = torch.library.custom_op("moe_quant::swiglu_block_bwd_x_operand", _x_operand, mutates_args=())
_cols_operand_op = torch.library.custom_op("moe_quant::swiglu_block_bwd_cols_operand", _cols_operand, mutates_args=())
_wgrad_op = torch.library.custom_op("moe_quant::swiglu_block_bwd_wgrad", _wgrad, mutates_args=())
# the fake implementations are the functions themselves, on fake tensors
for _op, _fn in ((_fwd_op, _forward), (_dswiglu_op, _dswiglu), (_dgrad_op, _dgrad), (_x_operand_op, _x_operand),
                 (_cols_operand_op, _cols_operand), (_wgrad_op, _wgrad)):
    _op.register_fake(_fn)


class _OpStages:
    """:class:`.swiglu_block.BackwardStages` with each stage one op call (one instance per backward): the same
    signatures, the forms flattened into and out of the ops' tensor lists; each empties the lists it is handed, as
    the stages do. The graph orders ops by their inputs alone, and inductor's scheduler moves an op whose inputs
    exist earlier (on 2026-12-02 it ran x's operand op first, before dSwiGLU, its bf16 values then living beside
    every GEMM), so the x-operand and weight-gradient ops also take ``after``, tensors that exist anyway then and
    that they do not read: dx (the last dgrad op's output, which holds the sum: an op's output, so inductor passes
    it as it is, where it copied a sum it computed itself once per op reading it) and the colwise forms; that keeps
    :func:`.swiglu_block.block_backward`'s order. The fp8 colwise forms' dequantization ops (``dswiglu_cols_fp8``)
    take x's bf16 operand and the previous weight gradient as ``after``: each runs once the GEMM before it has
    returned, not hoisted beside dx's GEMMs (where its bf16 values are what the fp8 forms save)."""

    def __init__(self):
        self.dx, self.cols, self.x_values, self.dw = None, [], None, None

    def dswiglu(self, grad_y, w2, offs, ab, concat, mode, backend, scopes, need_w2, need_rows, need_cols,
                cols_fp8=False):
        fake = backend is GemmBackend.EMULATED
        out = _dswiglu_op(grad_y, w2, offs, list(ab), mode.value, backend.value, concat, need_w2, need_rows,
                          need_cols, cols_fp8)
        ab.clear()
        dw2 = out.pop(0) if need_w2 else None
        n = _n_forms(concat, fake)
        rows, cols = _unflat(out, n * need_rows, n * need_cols, fake, cols_fp8)
        self.cols = _flat([], cols)
        return dw2, rows, cols

    def dgrad(self, rows, w, offs, mode, backend, scopes, x_dtype, acc):
        flat = _flat(rows, [])
        rows.clear()
        self.dx = _dgrad_op(flat, w, offs, mode.value, backend.value, x_dtype, acc)
        return self.dx

    def _after(self) -> list[torch.Tensor]:
        return ([] if self.dx is None else [self.dx]) + self.cols

    def x_operand(self, x_kept, fake):
        if not fake:  # the scaled GEMM reads the kept form itself
            kept = tuple(x_kept)
            x_kept.clear()
            return kept
        values = _x_operand_op(list(x_kept), self._after())
        poffs = x_kept[-1]
        x_kept.clear()
        self.x_values = values
        return values, poffs

    def cols_operand(self, cols):
        poffs = cols[0][-1]
        flat = _flat([], cols)
        cols.clear()
        after = [t for t in (self.x_values, self.dw) if t is not None]
        return [(values, poffs) for values in _cols_operand_op(flat, after)]

    def wgrad(self, cols, x_col, offs, backend, w_dtype):
        flat = _flat([], cols)
        cols.clear()
        self.cols = []  # each weight gradient's colwise forms freed after its op
        self.dw = _wgrad_op(flat, list(x_col), offs, backend.value, w_dtype, self._after())
        return self.dw


def _setup_context(ctx, inputs, output):
    """Save what the eager block saves: the weights, the offsets and the forward op's saved forms (not
    differentiable: no gradient is ever materialized for them)."""
    x, w1, w3, w2, offs, mode, backend, _, cols_fp8, _ = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(w1, w3, w2, offs, *saved)
    ctx.mode, ctx.backend, ctx.x_dtype, ctx.cols_fp8 = mode, backend, x.dtype, cols_fp8


def _backward(ctx, grads):
    """:func:`.swiglu_block.block_backward` with its stages as ops; the gradients in the positions of the inputs
    they belong to."""
    grad_y = grads[0]
    if grad_y is None:  # only the saved forms' (non-differentiable) gradients: nothing flows back
        return (None,) * 10
    w1, w3, w2, offs, *saved = ctx.saved_tensors
    grads = block_backward(grad_y, w1, w3, w2, offs, saved, ScaleMode(ctx.mode), GemmBackend(ctx.backend), (),
                           tuple(bool(n) for n in ctx.needs_input_grad[:4]), ctx.x_dtype, ctx.cols_fp8,
                           stages=_OpStages())
    return (*first_order_only(grads, grad_y, w1, w3, w2), None, None, None, None, None, None)


torch.library.register_autograd("moe_quant::swiglu_block_fwd", _backward, setup_context=_setup_context)

__all__: list[str] = []  # registers the torch.ops.moe_quant.swiglu_block_* ops; nothing to import by name
