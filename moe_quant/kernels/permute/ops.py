"""Torch op over the received-rows permutation kernel (``kernel.py``); the public entry point, its
argument checks and the reference are :func:`moe_quant.ep.permute_received`. Same conventions as
:mod:`moe_quant.kernels.quantize_1x32.ops` (custom op with a fake implementation, direct call in eager mode)."""

from __future__ import annotations

import contextlib

import torch

from ... import layouts
from ...numerics import BLOCK_SIZE
from .. import compile_cache as cc
from .config import MAX_BLOCKS, Variant

_DEQUANT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def serves(counts: torch.Tensor) -> bool:
    """The kernel's group table holds ``counts``' (rank, expert) blocks (shape only, no device read)."""
    r, e = counts.shape
    return r * e <= MAX_BLOCKS and e <= MAX_BLOCKS


def _shapes(m: int, k: int, n_experts: int, out: str):
    if out == "blocked":
        return layouts.m_groups_blocked_shape(m, k // BLOCK_SIZE, n_experts)
    return m, k // BLOCK_SIZE


# (out, out_dtype name) of every op, as its variant names them
OPS = [("dequant", name) for name in _DEQUANT_DTYPES.values()] + [(out, "float8_e4m3fn") for out in ("blocked", "plain")]


def _key(out: str, out_dtype_name: str) -> tuple:
    """The op's kernel key (``compile_cache.kernel_for``) of the default variant writing ``out``."""
    return ("perm", out, out_dtype_name)


def _kernel(out: str, out_dtype: torch.dtype, device: torch.device) -> cc.Compiled:
    name = _DEQUANT_DTYPES[out_dtype] if out == "dequant" else "float8_e4m3fn"
    return cc.kernel_for(_key(out, name), lambda: Variant(out, name), device)


def variant_in_place(variant: Variant, device: torch.device):
    """Context manager: within it, the op writing ``variant``'s output kind and dtype on ``device`` launches
    ``variant`` (an A/B candidate, ``config.CANDIDATES``) instead of its default variant."""
    return cc.in_place_of(_key(variant.out, variant.out_dtype), variant, device)


@contextlib.contextmanager
def variants_in_place(device: torch.device, **fields):
    """Within the block, every op on ``device`` launches ``Variant(out, out_dtype, **fields)`` (an A/B
    candidate's fields, ``config.CANDIDATES``) instead of its default variant (GPU tests, sanitizer)."""
    with contextlib.ExitStack() as stack:
        for out, name in OPS:
            stack.enter_context(variant_in_place(Variant(out, name, **fields), device))
        yield


_PLANS: dict = cc.plan_table()  # the eager calls' plans (compile_cache.plan): key of _permute_impl -> _plan's


def _plan(shape, n_experts, out, out_dtype, device):
    """``(output dtype, scale shape or None, the compiled kernel on ``device`` or None where nothing launches)`` of a
    call on ``data`` of ``shape`` with ``n_experts`` experts."""
    m, k = shape
    scale_shape = None
    if out != "dequant":
        scale_shape = _shapes(m, k, n_experts, out)
        if scale_shape[0] * scale_shape[1] > cc.INT32_MAX:
            raise ValueError(f"permute_received: scale buffer of {scale_shape[0] * scale_shape[1]} bytes exceeds the "
                             "int32 index range")
        out_dtype = torch.float8_e4m3fn
    if not m * k:
        return out_dtype, scale_shape, None
    return out_dtype, scale_shape, _kernel(out, out_dtype, device)


def _permute_impl(data, scales, counts, out: str, out_dtype: torch.dtype):
    """``data`` e4m3 and ``scales`` e8m0, or their bytes (uint8)."""
    # the launch path of every eager call (host time): one dict lookup for everything that follows from the shapes
    device = data.device
    n_experts = counts.shape[1]
    key = (data.shape, n_experts, out, out_dtype, device)
    res_dtype, scale_shape, kernel = _PLANS.get(key) or cc.plan(_PLANS, key, _plan)
    offs = torch.empty(n_experts, dtype=torch.int32, device=device)
    res = torch.empty(size=key[0], dtype=res_dtype, device=device)
    res_scales = (None if scale_shape is None else
                  torch.empty(size=scale_shape, dtype=torch.float8_e8m0fnu, device=device))
    if cc.POISON_OUTPUTS:
        cc.poison(offs, res, res_scales)
    if kernel is not None:
        if data.dtype is not torch.float8_e4m3fn:  # its bytes
            data = data.view(torch.float8_e4m3fn)
        if scales.dtype is not torch.float8_e8m0fnu:  # its bytes
            scales = scales.view(torch.float8_e8m0fnu)
        kernel.call(cc.aligned(data), cc.aligned(scales), counts, res, res_scales, offs)
    else:  # no rows or K = 0: nothing to move, offs from the (device-side) table, scale buffer all zero
        offs.copy_(layouts.received_group_table(counts, key[0][0])[3])
        if res_scales is not None:
            res_scales.view(torch.uint8).zero_()
    if out == "dequant":
        return res, offs
    return res, res_scales, offs


@torch.library.custom_op("moe_quant::permute_mxfp8", mutates_args=(), device_types="cuda")
def _permute_op(data: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, out: str,
                out_dtype: torch.dtype) -> list[torch.Tensor]:
    return list(_permute_impl(data, scales, counts, out, out_dtype))


@_permute_op.register_fake
def _(data, scales, counts, out, out_dtype):
    m, k = data.shape
    offs = counts.new_empty((counts.shape[1],))
    if out == "dequant":
        return [data.new_empty((m, k), dtype=out_dtype), offs]
    return [data.new_empty((m, k)), data.new_empty(_shapes(m, k, counts.shape[1], out), dtype=torch.float8_e8m0fnu),
            offs]


def permute_mxfp8(data: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, out: str,
                  out_dtype: torch.dtype = torch.bfloat16):
    """The kernel behind :func:`moe_quant.ep.permute_received` (arguments checked there; contiguous CUDA
    tensors, ``serves(counts)``). Byte-identical to :func:`moe_quant.ep.permute.reference_permute_received`."""
    if cc.via_dispatcher(data):
        return tuple(torch.ops.moe_quant.permute_mxfp8(data, scales, counts, out, out_dtype))
    return _permute_impl(data, scales, counts, out, out_dtype)
