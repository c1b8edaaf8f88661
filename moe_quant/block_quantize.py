"""The quantization passes of the SwiGLU expert block (:mod:`moe_quant.autograd.swiglu_block`).

Each pass reads its inputs once and writes every MXFP8 form the block's GEMMs need of one tensor:

* :func:`dual` -- ``x`` (forward) or ``grad_out`` (backward): the rowwise 1x32 form (fwd / dgrad operand)
  and the colwise 32x1 K-groups form (wgrad operand).
* :func:`swiglu` -- ``h = silu(a) * b`` computed and quantized in both forms (w2's forward operand and
  w2's wgrad operand); ``h`` itself is never written.
* :func:`dswiglu` -- the SwiGLU backward: ``grad_a`` and ``grad_b`` from ``grad_h``, ``a``, ``b``, each in
  both forms (w1 / w3 dgrad and wgrad operands).

A *form* is a tuple of tensors, as the GEMM backend takes it:

=========  ==========================================  ===============================================
backend    rowwise form                                colwise form
=========  ==========================================  ===============================================
emulated   ``(values (M, R) bf16,)``                    ``(values_t (R, Mp) bf16, padded_offs)``
scaled     ``(data (M, R) e4m3, M-groups scales)``      ``(data_t (R, Mp) e4m3, K-groups scales, poffs)``
=========  ==========================================  ===============================================

The values are exactly those of :mod:`moe_quant.quantize` (``fake_quantize_rowwise``,
``quantize_colwise_k_groups``, ...) of the same tensor, except that rows of the rowwise form past the
last group's end are zero (no GEMM reads them; the kernels do not read them either). Runs the
``block`` CuTe-DSL kernels where :func:`moe_quant.backends.use_quant_kernels` says so, the reference
(:mod:`moe_quant.reference`) otherwise, bit-identical. ``offs`` must be sanitized already
(:func:`moe_quant.layouts.sanitize_offsets`).
"""

from __future__ import annotations

import torch

from . import backends, reference
from .numerics import ScaleMode


def _kernels_serve(*tensors: torch.Tensor, bf16_only: bool = False) -> bool:
    x = tensors[0]
    if not backends.use_quant_kernels(x):
        return False
    return not bf16_only or all(t.dtype == torch.bfloat16 for t in tensors)


def rows_in_groups(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t (M, R)`` with the rows past the last group's end (``offs[-1]``, sanitized) set to zero bytes."""
    m = t.shape[0]
    end = offs[-1:].to(torch.int64) if offs.numel() else offs.new_zeros(1, dtype=torch.int64)
    keep = (torch.arange(m, device=t.device) < end).unsqueeze(1)
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    return torch.where(keep, raw, torch.zeros((), dtype=raw.dtype, device=t.device)).view(t.dtype)


def _reference_forms(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool):
    if fake:
        row = (rows_in_groups(reference.fake_quantize_rowwise(x, mode), offs),)
        col = reference.fake_quantize_colwise_k_groups(x, offs, mode)
    else:
        data, scales = reference.quantize_rowwise(x, mode, offs)
        row = (rows_in_groups(data, offs), scales)
        col = reference.quantize_colwise_k_groups(x, offs, mode)
    return row, tuple(col)


def _kernel_forms(outs: tuple, fake: bool):
    """``(row_data, row_scales, col_data, col_scales)`` of one tensor plus the shared ``poffs`` -> forms."""
    row_data, row_scales, col_data, col_scales, poffs = outs
    if fake:
        return (row_data,), (col_data, poffs)
    return (row_data, row_scales), (col_data, col_scales, poffs)


def dual(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool):
    """``(rowwise form, colwise form)`` of ``x (M, R)`` (bf16 or fp32) in one read; ``fake``: the
    dequantized bf16 values the emulated GEMM takes, else fp8 data and blocked scales."""
    if _kernels_serve(x):
        from .kernels import ops_block

        return _kernel_forms(ops_block.block_dual(x, mode, offs, fake), fake)
    return _reference_forms(x, mode, offs, fake)


def swiglu(a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool):
    """Both forms of ``h = silu(a) * b`` (:func:`moe_quant.reference.swiglu`), without writing ``h``."""
    if _kernels_serve(a, b, bf16_only=True):
        from .kernels import ops_block

        return _kernel_forms(ops_block.block_swiglu(a, b, mode, offs, fake), fake)
    return _reference_forms(reference.swiglu(a, b), mode, offs, fake)


def dswiglu(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor,
            fake: bool):
    """``((rowwise, colwise) of grad_a, (rowwise, colwise) of grad_b)`` of the SwiGLU backward
    (:func:`moe_quant.reference.dswiglu`), without writing ``grad_a`` or ``grad_b``."""
    if _kernels_serve(grad_h, a, b, bf16_only=True):
        from .kernels import ops_block

        outs = ops_block.block_dswiglu(grad_h, a, b, mode, offs, fake)
        poffs = outs[-1]
        return _kernel_forms((*outs[:4], poffs), fake), _kernel_forms((*outs[4:8], poffs), fake)
    grad_a, grad_b = reference.dswiglu(grad_h, a, b)
    return _reference_forms(grad_a, mode, offs, fake), _reference_forms(grad_b, mode, offs, fake)
