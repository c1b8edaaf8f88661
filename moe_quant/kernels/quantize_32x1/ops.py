"""Torch ops over the colwise 32x1 CuTe-DSL kernel (``kernel.py``): wgrad operands with K groups and
3D expert weights along N. Same conventions as :mod:`moe_quant.kernels.quantize_1x32.ops`."""

from __future__ import annotations

import torch

from ... import layouts
from ...numerics import BLOCK_SIZE, ScaleMode
from .. import compile_cache as cc
from .config import Variant
from ..quantize_1x32.ops import (IN_DTYPES, _check_device, _check_offs, _check_out_dtype, _check_w, _check_x,
                                 _hot_path)

_OUT_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _key(in_dtype: torch.dtype, mode: str, groups: str, out_dtype: torch.dtype, as_bf16: bool) -> tuple:
    """The ops' kernel key (``compile_cache.kernel_for``) of the default variant with these fields."""
    return ("q32x1", in_dtype, mode, groups, out_dtype, as_bf16)


def _spec(dtype: torch.dtype, mode: str, groups: str, out_dtype: torch.dtype, as_bf16: bool) -> tuple:
    """``(key, make_variant)`` of the default variant for an input of ``dtype``: the one home of both."""
    as_bf16 = as_bf16 and dtype == torch.float32  # a bf16 input is its own rounding
    return (_key(dtype, mode, groups, out_dtype, as_bf16),
            lambda: Variant(IN_DTYPES[dtype], mode, groups, _OUT_NAMES[out_dtype], as_bf16=as_bf16))


def _kernel_32x1(x: torch.Tensor, mode: str, groups: str, out_dtype: torch.dtype, as_bf16: bool = False) -> cc.Compiled:
    return cc.kernel_for(*_spec(x.dtype, mode, groups, out_dtype, as_bf16), x.device)


def variant_in_place(variant: Variant, device: torch.device):
    """Context manager: within it, the op that launches the default variant with ``variant``'s dtypes, mode,
    groups and ``as_bf16`` on ``device`` launches ``variant`` (an A/B candidate, ``config.CANDIDATES``) instead."""
    key = _key(getattr(torch, variant.in_dtype), variant.mode, variant.groups, getattr(torch, variant.out_dtype),
               variant.as_bf16)
    return cc.in_place_of(key, variant, device)


def _k_groups_shapes(m: int, r: int, g: int):
    mp = layouts.k_groups_padded_len(m, g)
    return (r, mp), layouts.k_groups_blocked_shape(r, m, g)


# the eager calls' plans (compile_cache.plan): key of each impl below -> its _plan_* function's answer
_K_GROUPS_PLANS: dict = cc.plan_table()
_3D_PLANS: dict = cc.plan_table()


def _plan_k_groups(shape, g, dtype, mode, out_dtype, device):
    """``(data shape, scale shape or None, the compiled kernel on ``device`` or None where nothing launches)`` of a
    K-groups call on ``x`` of ``shape`` and ``dtype`` with ``g`` groups."""
    m, r = shape
    data_shape, scale_shape = _k_groups_shapes(m, r, g)
    if out_dtype != torch.float8_e4m3fn:
        scale_shape = None
    elif scale_shape[0] * scale_shape[1] > cc.INT32_MAX:
        raise ValueError(f"quantize_32x1: scale buffer of {scale_shape[0] * scale_shape[1]} bytes exceeds the int32 "
                         "index range")
    if not data_shape[0] * data_shape[1]:
        return data_shape, scale_shape, None
    return data_shape, scale_shape, cc.kernel_for(*_spec(dtype, mode, "kgroups", out_dtype, False), device)


def _quantize_32x1_k_groups_impl(x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype):
    return _launch_k_groups(x, x.shape, x.dtype, x.device, mode, offs, out_dtype)


def _launch_k_groups(x, shape, dtype, device, mode: str, offs: torch.Tensor, out_dtype: torch.dtype):
    """:func:`_quantize_32x1_k_groups_impl` of ``x``'s shape, dtype and device, read by the caller (the public op
    reads them once, for its checks and here)."""
    # the launch path of every eager call (host time): one dict lookup for everything that follows from the shapes
    g = offs.shape[0]
    key = (shape, g, dtype, mode, out_dtype, device)
    plans = _K_GROUPS_PLANS
    data_shape, scale_shape, kernel = plans.get(key) or cc.plan(plans, key, _plan_k_groups)
    data = torch.empty(size=data_shape, dtype=out_dtype, device=device)
    scales = None if scale_shape is None else torch.empty(size=scale_shape, dtype=torch.float8_e8m0fnu,
                                                          device=device)
    poffs = torch.empty(g, dtype=torch.int32, device=device)
    if cc.POISON_OUTPUTS:
        cc.poison(data, scales, poffs)
    if kernel is not None:
        kernel.call(cc.aligned(x), data, scales, offs, poffs)
    else:  # R = 0, or M = G = 0: no CTA, but the padded offsets still follow from offs
        poffs.copy_(layouts.padded_group_offsets(offs, shape[0]))
    return data, scales, poffs


def _plan_3d(shape, dtype, mode, out_dtype, as_bf16, device):
    """``(data shape, scale shape or None, the compiled kernel on ``device`` or None where nothing launches)`` of a
    call on ``w`` of ``shape`` (E, N, K) and ``dtype``."""
    e, n, k = shape
    scale_shape = None
    if out_dtype == torch.float8_e4m3fn:
        rp, cp = layouts.blocked_shape(k, n // BLOCK_SIZE)
        scale_shape = (e, rp * cp)
    if not e * n * k:
        return (e, k, n), scale_shape, None
    return (e, k, n), scale_shape, cc.kernel_for(*_spec(dtype, mode, "uniform", out_dtype, as_bf16), device)


def _quantize_32x1_3d_impl(w: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False):
    device = w.device
    key = (w.shape, w.dtype, mode, out_dtype, as_bf16, device)
    data_shape, scale_shape, kernel = _3D_PLANS.get(key) or cc.plan(_3D_PLANS, key, _plan_3d)
    data = torch.empty(size=data_shape, dtype=out_dtype, device=device)
    scales = None if scale_shape is None else torch.empty(size=scale_shape, dtype=torch.float8_e8m0fnu,
                                                          device=device)
    if cc.POISON_OUTPUTS:
        cc.poison(data, scales)
    if kernel is not None:
        e, n, k = key[0]
        kernel.call(cc.aligned(w.view(e * n, k)), data, scales, None, None)
    elif scales is not None:
        scales.view(torch.uint8).zero_()
    return data, scales


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
    hot = _hot_path(x, offs, mode) if offs is not None else None
    if hot is not None:
        shape, dtype, device, value = hot
        return _launch_k_groups(x, shape, dtype, device, value, offs, torch.float8_e4m3fn)
    # anything else (tracing, a subclass, another spelling of the mode, bad arguments): each check in turn
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
    return _launch_k_groups(x, x.shape, x.dtype, x.device, mode, offs, torch.float8_e4m3fn)


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
