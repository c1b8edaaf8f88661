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


def _permute_impl(data, scales, counts, out: str, out_dtype: torch.dtype):
    m, k = data.shape
    n_experts = counts.shape[1]
    offs = cc.empty((n_experts,), torch.int32, data.device)
    if out == "dequant":
        res = cc.empty((m, k), out_dtype, data.device)
        res_scales = None
    else:
        res = cc.empty((m, k), torch.float8_e4m3fn, data.device)
        res_scales = cc.empty(_shapes(m, k, n_experts, out), torch.uint8, data.device)
        if res_scales.numel() > cc.INT32_MAX:
            raise ValueError(f"permute_received: scale buffer of {res_scales.numel()} bytes exceeds the int32 index range")
    if data.numel():
        cc.launch(_kernel(out, out_dtype, data.device), cc.aligned(data.view(torch.uint8)),
                  cc.aligned(scales.view(torch.uint8)), counts, res.view(torch.uint8) if out != "dequant" else res,
                  res_scales, offs)
    else:  # no rows or K = 0: nothing to move, offs from the (device-side) table, scale buffer all zero
        offs.copy_(layouts.received_group_table(counts, m)[3])
        if res_scales is not None:
            res_scales.zero_()
    if out == "dequant":
        return res, offs
    return res, res_scales.view(torch.float8_e8m0fnu), offs


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
    return _permute_impl(data, scales.view(torch.uint8), counts, out, out_dtype)
