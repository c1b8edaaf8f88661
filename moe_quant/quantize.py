"""Operand quantization entry points used by the autograd functions.

Each function picks the CuTe-DSL kernel where ``backends.use_quant_kernels`` says so and
the pure-PyTorch reference otherwise; both give bit-identical results.
"""

from __future__ import annotations

import torch

from . import backends, reference
from .numerics import ScaleMode


def quantize_rowwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor | None = None):
    """1x32 blocks along the last dim: ``(data e4m3 (M, K), scales e8m0)``, scales M-groups blocked with ``offs``."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.quantize_1x32(x, mode, offs)
    return reference.quantize_rowwise(x, mode, offs)


def fake_quantize_rowwise(x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized 1x32 MXFP8 of ``x (M, K)`` in one pass (no fp8 round trip through memory)."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.fake_quantize_1x32(x, mode, out_dtype)
    return reference.fake_quantize_rowwise(x, mode, out_dtype)


def quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    return reference.quantize_colwise_k_groups(x, offs, mode)


def fake_quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode, out_dtype=torch.bfloat16):
    return reference.fake_quantize_colwise_k_groups(x, offs, mode, out_dtype)


def quantize_3d(w: torch.Tensor, mode: ScaleMode, along: str):
    return reference.quantize_3d(w, mode, along)


def fake_quantize_3d(w: torch.Tensor, mode: ScaleMode, along_dim: int, out_dtype=torch.bfloat16):
    return reference.fake_quantize_3d(w, mode, along_dim, out_dtype)
