"""Operand quantization entry points used by the autograd functions.

Each function runs a CuTe-DSL kernel where ``backends.use_quant_kernels`` says so (Hopper and newer:
the 1x32 kernel for rowwise operands and 3D weights along K, the 32x1 kernel for the K-groups wgrad
operands and 3D weights along N), and the pure-PyTorch reference otherwise; both give bit-identical
results. (Fusing the reference with
inductor on CUDA was tried and dropped: torch 2.11's inductor asserts in its tiling pass on
these graphs with dynamic shapes, seen on an H100 on 2026-11-22.)
"""

from __future__ import annotations

import torch

from . import backends, reference
from .numerics import ScaleMode


def quantize_rowwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor | None = None):
    """1x32 blocks along the last dim: ``(data e4m3 (M, K), scales e8m0)``, scales M-groups blocked with ``offs``."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.quantize_1x32(x, mode, offs, scale_layout="blocked" if offs is not None else "plain")
    return reference.quantize_rowwise(x, mode, offs)


def fake_quantize_rowwise(x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized 1x32 MXFP8 of ``x (M, K)`` in one pass (no fp8 round trip through memory)."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.fake_quantize_1x32(x, mode, out_dtype)
    return reference.fake_quantize_rowwise(x, mode, out_dtype)


def quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    """32x1 blocks along tokens per group: ``(data_t (R, Mp), K-groups blocked scales, padded_offs)``."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.quantize_32x1_k_groups(x, mode, offs)
    return reference.quantize_colwise_k_groups(x, offs, mode)


def fake_quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode, out_dtype=torch.bfloat16):
    """Dequantized 32x1 K-groups MXFP8 of ``x (M, R)``: ``(values_t (R, Mp), padded_offs)``."""
    if backends.use_quant_kernels(x):
        from .kernels import ops

        return ops.fake_quantize_32x1_k_groups(x, mode, offs, out_dtype)
    return reference.fake_quantize_colwise_k_groups(x, offs, mode, out_dtype)


def quantize_3d(w: torch.Tensor, mode: ScaleMode, along: str):
    """Expert weights ``(E, N, K)`` along ``"k"`` or ``"n"``: ``(data, (E, blocked) scales)``."""
    if along in ("k", "n") and backends.use_quant_kernels(w):
        from .kernels import ops

        fn = ops.quantize_3d_along_k if along == "k" else ops.quantize_3d_along_n
        return fn(w.contiguous(), mode)
    return reference.quantize_3d(w, mode, along)


def fake_quantize_3d(w: torch.Tensor, mode: ScaleMode, along_dim: int, out_dtype=torch.bfloat16):
    """Dequantized 3D weights, blocks of 32 along ``along_dim`` (-1 or -2), same shape as ``w``.

    On the kernels, ``w`` is normally ``W_t = W.transpose(-2, -1)`` of a contiguous ``W (E, N, K)``:
    blocks along dim -2 (K) are the 1x32 kernel on W, blocks along dim -1 (N) the 32x1 kernel on W,
    which writes ``(E, K, N)`` directly.
    """
    if along_dim in (-1, -2) and w.ndim == 3 and backends.use_quant_kernels(w):
        from .kernels import ops

        w_nk = w.transpose(-2, -1).contiguous()  # W (E, N, K): a view when w is W_t
        if along_dim == -2:
            return ops.fake_quantize_3d_along_k(w_nk, mode, out_dtype).transpose(-2, -1)
        return ops.fake_quantize_3d_along_n(w_nk, mode, out_dtype)
    return reference.fake_quantize_3d(w, mode, along_dim, out_dtype)
