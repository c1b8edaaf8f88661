"""Operand quantization entry points used by the autograd functions.

Each function runs a CuTe-DSL kernel where ``backends.use_quant_kernels`` says so (Hopper and newer:
the 1x32 kernel for rowwise operands and 3D weights along K, the 32x1 kernel for the K-groups wgrad
operands and 3D weights along N), and the pure-PyTorch reference otherwise; both give bit-identical
results. Every public function here parses the mode and checks its arguments first. (Fusing the
reference with inductor on CUDA was tried and dropped: torch 2.11's inductor asserts in its tiling
pass on these graphs with dynamic shapes, seen on an H100 on 2026-11-22.)
"""

from __future__ import annotations

import torch

from . import backends, layouts, reference
from . import validation as v
from .numerics import BLOCK_SIZE, ScaleMode, dequantize_blocks


def _kernels_serve(x: torch.Tensor, *dims: int) -> bool:
    """A CuTe-DSL kernel serves ``x``: Hopper or newer with cutlass-dsl, and ``x.shape[d] % 32 == 0`` for
    each of ``dims`` (the kernels read 16-byte vectors of whole 32-element blocks)."""
    if not backends.use_quant_kernels(x):
        return False
    for d in dims:
        if x.shape[d] % BLOCK_SIZE:
            return False
    return True


_OPS = None


def _ops():
    """:mod:`moe_quant.kernels.ops`, imported on first use (importing moe_quant loads no kernel module)."""
    global _OPS
    if _OPS is None:
        from .kernels import ops

        _OPS = ops
    return _OPS


def quantize_rowwise(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor | None = None):
    """1x32 blocks along the last dim: ``(data e4m3 (M, K), scales e8m0)``, scales M-groups blocked with ``offs``.

    ``x`` (M, K) bf16/fp32 with K a multiple of 32; ``mode`` ``"rceil"``/``"floor"``; ``offs`` int32 (G,)
    group ends on ``x``'s device (values are sanitized as in :mod:`moe_quant.layouts`, not checked).
    """
    mode = ScaleMode.parse(mode, "mode")
    v.check_operand_2d("x", x, blocked_last_dim=True)
    v.check_group_offsets(offs, x, required=False)
    return rowwise(x, mode, offs)


# The grouped GEMM's hot path: the same computations as the public functions here, of arguments the caller
# has checked (``mode`` a ScaleMode; x bf16/fp32 of the right rank, its blocked dims multiples of 32, offs
# int32 on x's device), skipping the checks at every layer.


def rowwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor | None):
    """:func:`quantize_rowwise` of checked arguments."""
    if _kernels_serve(x):
        return _ops().run_quantize_1x32(x.contiguous(), mode.value, offs, "blocked" if offs is not None else "plain")
    return reference.quantize_rowwise(x, mode, offs)


def fake_rowwise(x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype):
    """:func:`fake_quantize_rowwise` of checked arguments."""
    if _kernels_serve(x):
        return _ops().run_fake_quantize_1x32(x.contiguous(), mode.value, out_dtype)
    return reference.fake_quantize_rowwise(x, mode, out_dtype)


def colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    """:func:`quantize_colwise_k_groups` of checked arguments."""
    if _kernels_serve(x, 1):
        return _ops().run_quantize_32x1_k_groups(x.contiguous(), mode.value, offs)
    return reference.quantize_colwise_k_groups(x, offs, mode)


def fake_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype):
    """:func:`fake_quantize_colwise_k_groups` of checked arguments."""
    if _kernels_serve(x, 1):
        return _ops().run_fake_quantize_32x1_k_groups(x.contiguous(), mode.value, offs, out_dtype)
    return reference.fake_quantize_colwise_k_groups(x, offs, mode, out_dtype)


def colwise_k_groups_plain(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    """:func:`colwise_k_groups` with the scales plain, ``(data_t (R, Mp), scales (R, Mp/32) e8m0, padded_offs)``
    (:func:`moe_quant.reference.quantize_colwise_k_groups_plain`): the form :func:`dequantize_rows` reads back
    into the emulated GEMM's colwise operand. On the kernels the 32x1 kernel's blocked scales, unblocked."""
    if _kernels_serve(x, 1):
        data_t, blocked, padded_offs = _ops().run_quantize_32x1_k_groups(x.contiguous(), mode.value, offs)
        return data_t, layouts.unblock_k_groups(blocked, offs, x.shape[1], x.shape[0]), padded_offs
    return reference.quantize_colwise_k_groups_plain(x, offs, mode)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dequantize_blocks(data, scales, out_dtype)`` (blocks of 32 along the last dim, plain scales): on SM90+ one
    pass of the permute kernel with a single (rank, expert) block (its ``"dequant"`` output, byte-identical to
    ``dequantize_blocks``), where the reference is several elementwise passes over fp32 copies; the reference
    elsewhere. ``data (M, K)`` e4m3, ``scales (M, K / 32)`` e8m0 (or its bytes), both contiguous."""
    if backends.use_quant_kernels(data):
        from .kernels.permute import ops as ops_permute

        counts = torch.full((1, 1), data.shape[0], dtype=torch.int32, device=data.device)
        return ops_permute.permute_mxfp8(data.contiguous(), scales.contiguous(), counts, "dequant", out_dtype)[0]
    return dequantize_blocks(data, scales.view(torch.uint8), out_dtype)


def fake_quantize_rowwise(x: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized 1x32 MXFP8 of ``x (M, K)`` in one pass (no fp8 round trip through memory).

    ``x`` bf16/fp32 with K a multiple of 32; ``out_dtype`` ``torch.bfloat16`` or ``torch.float32``.
    """
    mode = ScaleMode.parse(mode, "mode")
    v.check_operand_2d("x", x, blocked_last_dim=True)
    v.check_dtype_choice("out_dtype", out_dtype, v.OPERAND_DTYPES)
    return fake_rowwise(x, mode, out_dtype)


def quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode | str):
    """32x1 blocks along tokens per group: ``(data_t (R, Mp), K-groups blocked scales, padded_offs)``.

    ``x`` (M, R) bf16/fp32 (tokens along dim 0, R any size; the kernel serves R % 32 == 0); ``offs``
    int32 (G,) group ends on ``x``'s device (values sanitized, not checked); ``mode`` ``"rceil"``/``"floor"``.
    """
    mode = ScaleMode.parse(mode, "mode")
    v.check_operand_2d("x", x, blocked_last_dim=False)
    v.check_group_offsets(offs, x, required=True)
    return colwise_k_groups(x, offs, mode)


def fake_quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode | str, out_dtype=torch.bfloat16):
    """Dequantized 32x1 K-groups MXFP8 of ``x (M, R)``: ``(values_t (R, Mp), padded_offs)``."""
    mode = ScaleMode.parse(mode, "mode")
    v.check_operand_2d("x", x, blocked_last_dim=False)
    v.check_group_offsets(offs, x, required=True)
    v.check_dtype_choice("out_dtype", out_dtype, v.OPERAND_DTYPES)
    return fake_colwise_k_groups(x, offs, mode, out_dtype)


def quantize_3d(w: torch.Tensor, mode: ScaleMode | str, along: str):
    """Expert weights ``(E, N, K)`` along ``"k"`` or ``"n"``: ``(data, (E, blocked) scales)``.

    ``w`` bf16/fp32; the quantized dim (K for ``"k"``, N for ``"n"``) a multiple of 32.
    """
    mode = ScaleMode.parse(mode, "mode")
    along = v.parse_along(along)
    v.check_weight_3d("w", w, along)
    return scaled_3d(w, mode, along)


def fake_quantize_3d(w: torch.Tensor, mode: ScaleMode | str, along_dim: int, out_dtype=torch.bfloat16):
    """Dequantized 3D weights, blocks of 32 along ``along_dim`` (-1 or -2), same shape as ``w``.

    On the kernels, ``w`` is normally ``W_t = W.transpose(-2, -1)`` of a contiguous ``W (E, N, K)``:
    blocks along dim -2 (K) are the 1x32 kernel on W, blocks along dim -1 (N) the 32x1 kernel on W,
    which writes ``(E, K, N)`` directly.
    """
    mode = ScaleMode.parse(mode, "mode")
    if along_dim in (-1, -2) and w.ndim == 3 and _kernels_serve(w, 1, 2):
        ops = _ops()
        w_nk = w.transpose(-2, -1).contiguous()  # W (E, N, K): a view when w is W_t
        if along_dim == -2:
            return ops.fake_quantize_3d_along_k(w_nk, mode, out_dtype).transpose(-2, -1)
        return ops.fake_quantize_3d_along_n(w_nk, mode, out_dtype)
    return reference.fake_quantize_3d(w, mode, along_dim, out_dtype)


def fake_3d(w: torch.Tensor, mode: ScaleMode, along_dim: int, out_dtype: torch.dtype, as_bf16: bool = False):
    """:func:`fake_quantize_3d` of checked arguments: ``w (E, K, N)`` (the view ``W_t``) bf16/fp32, K and N
    multiples of 32, ``along_dim`` -1 or -2, ``out_dtype`` bf16/fp32 (the grouped GEMM's weight operands).
    ``as_bf16``: quantize ``w.to(torch.bfloat16)`` (fp32 master weights); the kernels round as they load,
    so no bf16 copy of the weight is written and read back."""
    if _kernels_serve(w):
        w_nk = w.transpose(-2, -1).contiguous()  # W (E, N, K): a view when w is W_t
        if along_dim == -2:
            return _ops().run_fake_3d_along_k(w_nk, mode.value, out_dtype, as_bf16).transpose(-2, -1)
        return _ops().run_fake_3d_along_n(w_nk, mode.value, out_dtype, as_bf16)
    return reference.fake_quantize_3d(w.to(torch.bfloat16) if as_bf16 else w, mode, along_dim, out_dtype)


def scaled_3d(w: torch.Tensor, mode: ScaleMode, along: str, as_bf16: bool = False):
    """:func:`quantize_3d` of checked arguments (``w (E, N, K)`` bf16/fp32, the quantized dim a multiple of
    32, ``along`` "k" or "n"; ``as_bf16`` as in :func:`fake_3d`)."""
    if _kernels_serve(w, 1, 2):
        ops = _ops()
        fn = ops.run_3d_along_k if along == "k" else ops.run_3d_along_n
        return fn(w.contiguous(), mode.value, as_bf16)
    return reference.quantize_3d(w.to(torch.bfloat16) if as_bf16 else w, mode, along)
