"""MXFP8 numerics (OCP MX v1.0): the one definition of scale math, element cast and
dequantization. Everything else (layouts, reference quantizers, kernels) builds on
these functions; docs/design.md section 2 is the contract.

A scale is an e8m0 byte ``s`` meaning ``2**(s - 127)``; 255 is NaN. One scale covers
``BLOCK_SIZE`` consecutive elements along the contraction dimension.
"""

from __future__ import annotations

import struct

import torch

from .choices import Choice

BLOCK_SIZE = 32
E4M3_MAX = 448.0
_E4M3_MAX_INT = 448
E4M3_MAX_POW2 = 8  # floor(log2(448))
E8M0_BIAS = 127
E8M0_NAN = 255
# fp32(1/448) as an fp32 bit pattern: the reference multiplies by this fp32 scalar, the kernels by these bits
RCP_E4M3_MAX_F32_BITS = struct.unpack("<I", struct.pack("<f", 1.0 / E4M3_MAX))[0]

_F32_EXP_MASK = 0xFF
_F32_MANT_MASK = 0x7FFFFF
_F32_HALF_SUBNORMAL = 0x400000  # mantissa bits of 2**-127 in an fp32 subnormal


class ScaleMode(Choice):
    """How a block's e8m0 scale is derived from its amax."""

    RCEIL = "rceil"  # round amax/448 up to a power of two (Blackwell cvt.rp.satfinite.ue8m0)
    FLOOR = "floor"  # floor(log2(amax)) - 8; the element cast saturates to +-448
    __argname__ = "scale_mode"


def e8m0_from_amax(amax: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """Scale byte (uint8) of each block from its fp32 amax.

    RCEIL: the e8m0 byte of ``amax * fp32(1/448)`` rounded up to a power of two:
    the fp32 exponent field, plus one if any mantissa bit is set (an fp32
    subnormal therefore rounds up only above 2**-127).
    FLOOR: ``floor(log2(amax)) - 8`` from the exponent field, clamped to [0, 254].
    Non-finite amax gives 255 in both modes.
    """
    mode = ScaleMode.parse(mode, "mode")  # never let a string fall through to FLOOR
    amax = amax.to(torch.float32)
    if mode is ScaleMode.RCEIL:
        # the fp32 scalar made from its bit pattern: a float module constant read here (as a Python float or
        # through torch.tensor) becomes a symbolic float under torch.compile(dynamic=True), and dynamo (2.11 to
        # 2.13) fails to lift it into the second autograd.Function that reads it ("lift_tracked_freevar_to_input
        # should not be called on root SubgraphTracer"); an int constant is not made symbolic there
        rcp = amax.new_full((), RCP_E4M3_MAX_F32_BITS, dtype=torch.int32).view(torch.float32)
        descale = amax * rcp
        bits = descale.view(torch.int32)
        exp = (bits >> 23) & _F32_EXP_MASK
        mant = bits & _F32_MANT_MASK
        # normal: round up if any mantissa bit is set; subnormal (< 2**-126): to 2**-126 only above 2**-127
        round_up = torch.where(exp == 0, mant > _F32_HALF_SUBNORMAL, mant != 0)
        exp = (exp + round_up.to(torch.int32)).clamp(max=254)
    else:
        bits = amax.view(torch.int32)
        exp = ((bits >> 23) & _F32_EXP_MASK) - E4M3_MAX_POW2
        exp = exp.clamp(min=0, max=254)
    finite = torch.isfinite(amax)
    return torch.where(finite, exp, E8M0_NAN).to(torch.uint8)


def e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """``2**(s - 127)`` as fp32 (exact, 2**-127 included); NaN for byte 255."""
    s = scale.view(torch.uint8).to(torch.int32)
    normal = (s << 23).view(torch.float32)
    value = torch.where(s == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(s == E8M0_NAN, torch.full_like(value, float("nan")), value)


def e8m0_reciprocal_fp32(scale: torch.Tensor) -> torch.Tensor:
    """``2**(127 - s)`` as fp32 (exact for every byte up to 254); NaN for 255.

    Byte 0 needs 2**127 and byte 254 needs 2**-127 (an fp32 subnormal): both exact.
    """
    s = scale.view(torch.uint8).to(torch.int32)
    e = 254 - s  # biased exponent field of 2**(127-s)
    normal = (e.clamp(min=1) << 23).view(torch.float32)
    value = torch.where(e == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(s == E8M0_NAN, torch.full_like(value, float("nan")), value)


def cast_to_e4m3(x_scaled_fp32: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even, saturating cast of fp32 values to float8_e4m3fn (NaN stays NaN)."""
    # int bounds (exactly 448): a float module constant would be a symbolic float under dynamic shapes (see
    # e8m0_from_amax)
    return x_scaled_fp32.clamp(-_E4M3_MAX_INT, _E4M3_MAX_INT).to(torch.float8_e4m3fn)


def quantize_blocks(x: torch.Tensor, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim in blocks of 32.

    Returns ``(data float8_e4m3fn, same shape as x; scales uint8, (..., K/32))``.
    A block holding NaN or Inf gets scale 255 and all its data bytes 0x7F (canonical NaN).
    """
    k = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    amax = blocks.abs().amax(dim=-1)
    # amax of a block holding both NaN and Inf must be non-finite: abs().amax propagates NaN.
    scale = e8m0_from_amax(amax, mode)
    rcp = e8m0_reciprocal_fp32(scale).unsqueeze(-1)
    nan_block = (scale == E8M0_NAN).unsqueeze(-1)
    # canonical positive NaN (e4m3 0x7F) for every element of a non-finite block
    scaled = torch.where(nan_block, torch.full_like(blocks, float("nan")), blocks * rcp)
    data = cast_to_e4m3(scaled)
    return data.reshape(x.shape), scale


def dequantize_blocks(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``float(q) * 2**(s-127)`` in fp32, then rounded to ``out_dtype`` (last dim blocked by 32).

    NaN data or a NaN scale (255) gives the canonical positive NaN (bf16 0x7FC0).
    """
    k = data.shape[-1]
    q = data.reshape(*data.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    value = (q * e8m0_to_fp32(scale).unsqueeze(-1)).to(out_dtype).reshape(data.shape)
    # set NaN after the cast: vectorized fp32->bf16 casts pick their own NaN bits (0xFFFF on x86). The result
    # is a tensor of its own, no view of an intermediate: autograd Functions save these values for backward,
    # and dynamo cannot carry a saved view of a forward intermediate into the backward graph
    return torch.where(value.isnan(), torch.full((), float("nan"), dtype=out_dtype, device=value.device), value)


def fake_quantize_blocks(
    x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``dequantize_blocks(*quantize_blocks(x))``: what an MXFP8 GEMM sees of ``x``."""
    data, scale = quantize_blocks(x, mode)
    return dequantize_blocks(data, scale, out_dtype)
