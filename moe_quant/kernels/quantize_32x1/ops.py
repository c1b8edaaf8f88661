"""Torch ops over the colwise 32x1 CuTe-DSL kernel (``kernel.py``): wgrad operands with K groups and
3D expert weights along N. Same conventions as :mod:`moe_quant.kernels.quantize_1x32.ops`."""

from __future__ import annotations

import torch

from ... import layouts
from ...numerics import BLOCK_SIZE, ScaleMode
from .. import compile_cache as cc
from .config import Variant
from ..quantize_1x32.ops import IN_DTYPES, _check_device, _check_offs, _check_out_dtype, _check_w, _check_x

_OUT_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _key(in_dtype: torch.dtype, mode: str, groups: str, out_dtype: torch.dtype, as_bf16: bool) -> tuple:
    """The ops' kernel key (``compile_cache.kernel_for``) of the default variant with these fields."""
    return ("q32x1", in_dtype, mode, groups, out_dtype, as_bf16)


def _kernel_32x1(x: torch.Tensor, mode: str, groups: str, out_dtype: torch.dtype, as_bf16: bool = False) -> cc.Compiled:
    as_bf16 = as_bf16 and x.dtype == torch.float32  # a bf16 input is its own rounding
    return cc.kernel_for(
        _key(x.dtype, mode, groups, out_dtype, as_bf16),
        lambda: Variant(IN_DTYPES[x.dtype], mode, groups, _OUT_NAMES[out_dtype], as_bf16=as_bf16),
        x.device,
    )


def variant_in_place(variant: Variant, device: torch.device):
    """Context manager: within it, the op that launches the default variant with ``variant``'s dtypes, mode,
    groups and ``as_bf16`` on ``device`` launches ``variant`` (an A/B candidate, ``config.CANDIDATES``) instead."""
    key = _key(getattr(torch, variant.in_dtype), variant.mode, variant.groups, getattr(torch, variant.out_dtype),
               variant.as_bf16)
    return cc.in_place_of(key, variant, device)


def _k_groups_shapes(m: int, r: int, g: int):
    mp = layouts.k_groups_padded_len(m, g)
    return (r, mp), layouts.k_groups_blocked_shape(r, m, g)


def _quantize_32x1_k_groups_impl(x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype):
    # the launch path of every eager call: sizes as Python ints, no tensor method that is not needed (host time)
    m, r = x.shape
    g = offs.shape[0]
    device = x.device
    mp = layouts.k_groups_padded_len(m, g)
    scales = None
    if out_dtype == torch.float8_e4m3fn:
        srows, scols = layouts.k_groups_blocked_shape(r, m, g)
        if srows * scols > cc.INT32_MAX:
            raise ValueError(f"quantize_32x1: scale buffer of {srows * scols} bytes exceeds the int32 index range")
        scales = cc.empty((srows, scols), torch.uint8, device)
    data = cc.empty((r, mp), out_dtype, device)
    poffs = cc.empty((g,), torch.int32, device)
    if r * mp:
        cc.launch(_kernel_32x1(x, mode, "kgroups", out_dtype), cc.aligned(x), data, scales, offs, poffs)
    else:  # R = 0, or M = G = 0: no CTA, but the padded offsets still follow from offs
        poffs.copy_(layouts.padded_group_offsets(offs, m))
    return data, (None if scales is None else scales.view(torch.float8_e8m0fnu)), poffs


def _quantize_32x1_3d_impl(w: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False):
    e, n, k = w.shape
    fp8 = out_dtype == torch.float8_e4m3fn
    data = cc.empty((e, k, n), out_dtype, w.device)
    scales = None
    if fp8:
        rp, cp = layouts.blocked_shape(k, n // BLOCK_SIZE)
        scales = cc.empty((e, rp * cp), torch.uint8, w.device)
    if w.numel():
        cc.launch(_kernel_32x1(w, mode, "uniform", out_dtype, as_bf16), cc.aligned(w.view(e * n, k)), data, scales,
                  None, None)
    elif scales is not None:
        scales.zero_()
    return data, (scales.view(torch.float8_e8m0fnu) if fp8 else None)


@torch.library.custom_op("moe_quant::quantize_32x1_k_groups", mutates_args=(), device_types="cuda")
def _quantize_32x1_k_groups_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data, scales, poffs = _quantize_32x1_k_groups_impl(x, mode, offs, torch.float8_e4m3fn)
    return data, scales, poffs


@_quantize_32x1_k_groups_op.register_fake
def _(x, mode, offs):
    data_shape, scale_shape = _k_groups_shapes(x.shape[0], x.shape[1], offs.shape[0])
    return (x.new_empty(data_shape, dtype=torch.float8_e4m3fn), x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu),
            offs.new_empty(offs.shape))


@torch.library.custom_op("moe_quant::fake_quantize_32x1_k_groups", mutates_args=(), device_types="cuda")
def _fake_quantize_32x1_k_groups_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    data, _, poffs = _quantize_32x1_k_groups_impl(x, mode, offs, out_dtype)
    return data, poffs


@_fake_quantize_32x1_k_groups_op.register_fake
def _(x, mode, offs, out_dtype):
    data_shape, _ = _k_groups_shapes(x.shape[0], x.shape[1], offs.shape[0])
    return x.new_empty(data_shape, dtype=out_dtype), offs.new_empty(offs.shape)


@torch.library.custom_op("moe_quant::quantize_32x1_3d", mutates_args=(), device_types="cuda")
def _quantize_32x1_3d_op(w: torch.Tensor, mode: str, as_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    data, scales = _quantize_32x1_3d_impl(w, mode, torch.float8_e4m3fn, as_bf16)
    return data, scales


@_quantize_32x1_3d_op.register_fake
def _(w, mode, as_bf16=False):
    e, n, k = w.shape
    rp, cp = layouts.blocked_shape(k, n // BLOCK_SIZE)
    return w.new_empty((e, k, n), dtype=torch.float8_e4m3fn), w.new_empty((e, rp * cp), dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("moe_quant::fake_quantize_32x1_3d", mutates_args=(), device_types="cuda")
def _fake_quantize_32x1_3d_op(w: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False) -> torch.Tensor:
    return _quantize_32x1_3d_impl(w, mode, out_dtype, as_bf16)[0]


@_fake_quantize_32x1_3d_op.register_fake
def _(w, mode, out_dtype, as_bf16=False):
    e, n, k = w.shape
    return w.new_empty((e, k, n), dtype=out_dtype)


def quantize_32x1_k_groups(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor):
    """Colwise 32x1 MXFP8 of a wgrad operand ``x (M, R)`` with token groups ``offs``.

    Returns ``(data_t float8_e4m3fn (R, Mp), scales float8_e8m0fnu (round_up(R, 128), ceil(M/32) + 4 G),
    padded_offs int32 (G,))``, ``Mp = round_up(M, 32) + 32 G``: each group's tokens start at a multiple
    of 32, gaps and tail zero. Bit-identical to :func:`moe_quant.reference.quantize_colwise_k_groups`.
    """
    fn = "quantize_32x1_k_groups"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    _check_offs(offs, x, fn)
    _check_device(x, fn)
    return run_quantize_32x1_k_groups(x, mode.value, offs)


def run_quantize_32x1_k_groups(x: torch.Tensor, mode: str, offs: torch.Tensor):
    """:func:`quantize_32x1_k_groups` of arguments its caller has checked (``mode`` a value string): the custom
    op while tracing or on a tensor subclass, else the launch itself (the autograd functions' hot path)."""
    if cc.via_dispatcher(x):
        return torch.ops.moe_quant.quantize_32x1_k_groups(x, mode, offs)
    return _quantize_32x1_k_groups_impl(x, mode, offs, torch.float8_e4m3fn)


def fake_quantize_32x1_k_groups(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor,
                                out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized colwise 32x1 MXFP8 of ``x (M, R)`` in the layout of :func:`quantize_32x1_k_groups`:
    ``(values_t out_dtype (R, Mp), padded_offs int32 (G,))``, in one pass. Bit-identical to
    :func:`moe_quant.reference.fake_quantize_colwise_k_groups`."""
    fn = "fake_quantize_32x1_k_groups"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    _check_offs(offs, x, fn)
    _check_out_dtype(fn, out_dtype)
    _check_device(x, fn)
    return run_fake_quantize_32x1_k_groups(x, mode.value, offs, out_dtype)


def run_fake_quantize_32x1_k_groups(x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype):
    """:func:`fake_quantize_32x1_k_groups` of checked arguments (see :func:`run_quantize_32x1_k_groups`)."""
    if cc.via_dispatcher(x):
        return torch.ops.moe_quant.fake_quantize_32x1_k_groups(x, mode, offs, out_dtype)
    data, _, poffs = _quantize_32x1_k_groups_impl(x, mode, offs, out_dtype)
    return data, poffs


def quantize_3d_along_n(w: torch.Tensor, mode: ScaleMode | str):
    """Expert weights ``w (E, N, K)`` in blocks of 32 along N: ``(data (E, K, N) e4m3, scales (E, blocked
    K x N/32) e8m0)``. Bit-identical to ``reference.quantize_3d(w, mode, "n")``."""
    fn = "quantize_3d_along_n"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn)
    return run_3d_along_n(w, mode.value)


def run_3d_along_n(w: torch.Tensor, mode: str, as_bf16: bool = False):
    """:func:`quantize_3d_along_n` of checked arguments (``mode`` a value string; ``as_bf16``: a float32 ``w``
    quantized as ``w.to(torch.bfloat16)``, rounded in the kernel)."""
    if cc.via_dispatcher(w):
        return torch.ops.moe_quant.quantize_32x1_3d(w, mode, as_bf16)
    return _quantize_32x1_3d_impl(w, mode, torch.float8_e4m3fn, as_bf16)


def fake_quantize_3d_along_n(w: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized ``w (E, N, K)`` in blocks of 32 along N, written ``(E, K, N)`` (N contiguous)."""
    fn = "fake_quantize_3d_along_n"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn)
    _check_out_dtype(fn, out_dtype)
    return run_fake_3d_along_n(w, mode.value, out_dtype)


def run_fake_3d_along_n(w: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False) -> torch.Tensor:
    """:func:`fake_quantize_3d_along_n` of checked arguments (``mode`` a value string; ``as_bf16`` as in
    :func:`run_3d_along_n`)."""
    if cc.via_dispatcher(w):
        return torch.ops.moe_quant.fake_quantize_32x1_3d(w, mode, out_dtype, as_bf16)
    return _quantize_32x1_3d_impl(w, mode, out_dtype, as_bf16)[0]
