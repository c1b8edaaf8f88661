"""Device helpers shared by the CuTe-DSL quantization kernels.

Everything here is traced inside a ``@cute.kernel`` (straight-line code: no Python
control flow on device values). The numeric constants come from
:mod:`moe_quant.numerics` and the blocked-layout math from :mod:`moe_quant.layouts`,
so the kernels and the reference share one definition of each.

Bit-exactness notes (docs/design.md section 2):

* amax is taken on the magnitude *bit patterns* (``bits & 0x7fffffff`` compared as
  integers): for non-negative IEEE floats integer order is value order, NaN sorts
  above Inf, and subnormals are kept exactly (no flush, no NaN-dropping ``max.f32``).
* every float multiply is an explicit ``mul.rn.f32`` (IEEE, no FTZ, no FMA
  contraction); every fp8/bf16 conversion an explicit ``cvt`` with the rounding the
  contract names.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, nvvm, vector
from cutlass.cutlass_dsl import T

from ..layouts import TILE_BYTES, TILE_COLS, TILE_ROWS, blocked_offset, tile_byte  # noqa: F401  (re-exported)
from ..numerics import _F32_HALF_SUBNORMAL, BLOCK_SIZE, E4M3_MAX_POW2, E8M0_BIAS, E8M0_NAN, RCP_E4M3_MAX_F32_BITS

# fp32 bit patterns used by the scale math.
F32_ABS_MASK = 0x7FFFFFFF
F32_EXP_INF = 0x7F800000  # magnitude bits >= this: Inf or NaN
F32_MANT_MASK = 0x007FFFFF
F32_2POW_M127 = 0x00400000  # 2**-127, an fp32 subnormal

# cutlass element types of the dtype names the kernel configs use.
CUTLASS_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
}

# Canonical NaN patterns written for a block whose scale is E8M0_NAN.
E4M3_NAN_X4 = 0x7F7F7F7F
BF16_NAN_X2 = 0x7FC07FC0
F32_NAN = 0x7FC00000


def _i32(v) -> ir.Value:
    return Int32(v).ir_value()


def _asm(ret_types, args, text: str, constraints: str):
    """Inline PTX; returns one Int32 or a tuple of Int32 (``ret_types`` = number of b32 results)."""
    operands = [Int32(a).ir_value() for a in args]
    if ret_types == 1:
        res = llvm.inline_asm(T.i32(), operands, text, constraints, has_side_effects=False)
        return Int32(res)
    st = llvm.StructType.get_literal([T.i32()] * ret_types)
    res = llvm.inline_asm(st, operands, text, constraints, has_side_effects=False)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i])) for i in range(ret_types))


def opaque(v) -> Int32:
    """``v`` unchanged, through a ``mov`` the compiler must keep where it stands (a side effect): what is computed
    from the result cannot be hoisted above it, e.g. out of a loop (so it is not kept live across the loop)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value()], "mov.b32 $0, $1;", "=r,r", has_side_effects=True))


# ----------------------------------------------------------------------------- global memory


def ld_global_v4(ptr) -> tuple:
    """16-byte load (``ld.global.v4.b32``, or ``ld.shared`` for a shared-memory ``ptr``); 16-byte aligned."""
    vec = cute.arch.load(ptr, ir.VectorType.get([4], T.i32()))
    return tuple(Int32(vector.extract(vec, [], [i])) for i in range(4))


def ld_global_v2(ptr) -> tuple:
    """8-byte load (global or shared, as :func:`ld_global_v4`); 8-byte aligned."""
    vec = cute.arch.load(ptr, ir.VectorType.get([2], T.i32()))
    return tuple(Int32(vector.extract(vec, [], [i])) for i in range(2))


def st_global_v4(ptr, a, b, c, d) -> None:
    vec = vector.from_elements(ir.VectorType.get([4], T.i32()), [_i32(a), _i32(b), _i32(c), _i32(d)])
    cute.arch.store(ptr, vec)


def ld_global_u8(ptr) -> Int32:
    """One byte, zero-extended."""
    return Int32(cute.arch.load(ptr, Uint8))


def cp_async_16(smem_ptr, gmem_ptr, src_bytes) -> None:
    """``cp.async.cg.shared.global``: 16 bytes from ``gmem_ptr`` to ``smem_ptr`` (both 16-byte aligned) with no
    register held while in flight; only the first ``src_bytes`` (0..16) are read, the rest of the 16 are
    zero-filled (0: no read at all). The issuing thread sees them after ``cute.arch.cp_async_commit_group()``
    and ``cute.arch.cp_async_wait_group(0)``."""
    nvvm.cp_async_shared_global(smem_ptr.llvm_ptr, gmem_ptr.llvm_ptr, 16, nvvm.LoadCacheModifierKind.CG,
                                cp_size=_i32(src_bytes))


def st_global_v2(ptr, a, b) -> None:
    vec = vector.from_elements(ir.VectorType.get([2], T.i32()), [_i32(a), _i32(b)])
    cute.arch.store(ptr, vec)


def ld_global_u32_if(ptr, ok) -> Int32:
    """One 32-bit word where ``ok`` (0 elsewhere, nothing read), by a predicated load in one asm block: no branch
    around it, across which ptxas would move later loads ahead of it."""
    addr = Int64(ptr.toint()).ir_value()
    return Int32(llvm.inline_asm(
        T.i32(), [addr, _i32(Int32(cutlass.select_(ok, Int32(1), Int32(0))))],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.b32 $0, [$1];\n}",
        "=r,l,r", has_side_effects=True))


def st_global_u32(ptr, a) -> None:
    cute.arch.store(ptr, Int32(a))


def st_global_u8(ptr, a) -> None:
    cute.arch.store(ptr, Uint8(Int32(a)))


# ----------------------------------------------------------------------------- amax and scale


def bf16x2_to_f32_bits(w):
    """The two bf16 of a packed word as fp32 bit patterns (exact: bf16 is the top half of fp32)."""
    w = Int32(w)
    return w << 16, w & Int32(-65536)  # 0xFFFF0000


_F32X2_TO_BF16X2 = """{
.reg .f32 a, b;
mov.b32 a, $1;
mov.b32 b, $2;
cvt.rn.bf16x2.f32 $0, b, a;
}"""


def f32_bits_as_bf16(words) -> list:
    """fp32 bit patterns rounded to bf16 (RNE, as ``x.to(torch.bfloat16)`` on CUDA: ``cvt.rn``, subnormals
    kept, values past bf16's range to Inf, NaN to a NaN) and widened back: the fp32 bit patterns of the bf16
    values. A kernel that reads fp32 master weights quantizes their bf16 rounding with it, no cast kernel."""
    out = []
    for i in range(0, len(words), 2):
        out += bf16x2_to_f32_bits(_asm(1, [words[i], words[i + 1]], _F32X2_TO_BF16X2, "=r,r,r"))
    return out


def absmax_bits(words) -> Int32:
    """Largest magnitude bit pattern (``bits & 0x7fffffff``) over fp32 bit patterns."""
    m = Int32(words[0]) & F32_ABS_MASK
    for w in words[1:]:
        m = cutlass.max(m, Int32(w) & F32_ABS_MASK)
    return m


def absmax_bf16x2(words) -> Int32:
    """Per-half largest magnitude over packed bf16x2 words (``max.u16x2`` of ``w & 0x7FFF7FFF``, sm_90 and up):
    each half of the result holds the largest magnitude bit pattern among the words' same halves. Widened to fp32
    (``<< 16`` or ``& 0xFFFF0000``) it equals :func:`absmax_bits` over those bf16 values (widening keeps the order
    of the bit patterns; a NaN's exceed Inf's), in one instruction per word instead of two per element."""
    m = Int32(words[0]) & 0x7FFF7FFF
    for w in words[1:]:
        m = _asm(1, [m, Int32(w) & 0x7FFF7FFF], "max.u16x2 $0, $1, $2;", "=r,r,r")
    return m


QUAD_LANES = (1, 2)  # butterfly offsets of 4 consecutive lanes


def quad_max(v, lanes=QUAD_LANES) -> Int32:
    """Max over the 4 lanes that hold one 32-element block: consecutive lanes by default, or the lanes
    reached by the butterfly offsets ``lanes`` (e.g. ``(4, 8)``: lanes ``l, l^4, l^8, l^12``)."""
    for d in lanes:
        v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=d))
    return v


def mul_f32_bits(a, b) -> Int32:
    """IEEE fp32 ``a * b`` (round to nearest even, subnormals kept) on bit patterns."""
    return _asm(1, [a, b], "mul.rn.f32 $0, $1, $2;", "=r,r,r")


def e8m0_from_amax_bits(amax_bits, rceil: bool) -> Int32:
    """Scale byte (as Int32) from the block's fp32 amax bit pattern (non-negative).

    Same definition as :func:`moe_quant.numerics.e8m0_from_amax`.
    """
    amax_bits = Int32(amax_bits)
    nonfinite = amax_bits >= F32_EXP_INF
    if cutlass.const_expr(rceil):
        d = mul_f32_bits(amax_bits, Int32(RCP_E4M3_MAX_F32_BITS))
        e = (d >> 23) & 0xFF
        mant = d & F32_MANT_MASK
        # normal: round up if any mantissa bit is set; subnormal: up to 2**-126 only above 2**-127
        up = cutlass.select_(e == 0, mant > _F32_HALF_SUBNORMAL, mant != 0)
        e = e + Int32(cutlass.select_(up, Int32(1), Int32(0)))
        e = cutlass.min(e, Int32(254))
    else:
        e = ((amax_bits >> 23) & 0xFF) - E4M3_MAX_POW2
        e = cutlass.min(cutlass.max(e, Int32(0)), Int32(254))
    return Int32(cutlass.select_(nonfinite, Int32(E8M0_NAN), e))


def e8m0_from_amax_bits_short(amax_bits, rceil: bool) -> Int32:
    """:func:`e8m0_from_amax_bits` in about 7 instructions instead of 17, the same byte for every magnitude bit
    pattern (bit 31 clear; ``tests/test_numerics.py`` checks the formula against ``numerics.e8m0_from_amax``: every
    mantissa where d crosses the subnormal rules, samples of every exponent). RCEIL: ``d = amax * fp32(1/448)``
    rounded up to a power of two is the exponent field of ``bits(d) + 0x7FFFFF`` (a carry iff any mantissa bit is
    set); a subnormal ``d`` rounds up only above 2^-127 (mantissa 0x400000), so there the addend is 0x3FFFFF.
    FLOOR: ``max(exponent - 8, 0)``. No clamp to 254: a finite fp32 amax gives at most 247 in either mode
    (``amax / 448 < 2^120``), and a non-finite one 255."""
    amax_bits = Int32(amax_bits)
    if cutlass.const_expr(rceil):
        d = mul_f32_bits(amax_bits, Int32(RCP_E4M3_MAX_F32_BITS))
        subnormal = d < Int32(F32_MANT_MASK + 1)
        up = Int32(cutlass.select_(subnormal, Int32(_F32_HALF_SUBNORMAL - 1), Int32(F32_MANT_MASK)))
        e = (d + up) >> 23
    else:
        e = cutlass.max((amax_bits >> 23) - E4M3_MAX_POW2, Int32(0))
    return Int32(cutlass.select_(amax_bits >= F32_EXP_INF, Int32(E8M0_NAN), e))


def e8m0_reciprocal_bits_short(s) -> Int32:
    """:func:`e8m0_reciprocal_bits` for the bytes a finite block can have (s <= 247, :func:`e8m0_from_amax_bits_short`)
    in one instruction: ``(254 - s) << 23``; for s = 255 (a NaN block, whose elements are replaced) a
    meaningless pattern."""
    return Int32((2 * E8M0_BIAS) << 23) - (Int32(s) << 23)


def e8m0_reciprocal_bits(s) -> Int32:
    """``2**(127 - s)`` as an fp32 bit pattern for s in [0, 254] (2**-127 is a subnormal)."""
    e = Int32(2 * E8M0_BIAS) - Int32(s)
    return Int32(cutlass.select_(e > 0, e << 23, Int32(F32_2POW_M127)))


def e8m0_value_bits(s) -> Int32:
    """``2**(s - 127)`` as an fp32 bit pattern for s in [0, 254]."""
    s = Int32(s)
    return Int32(cutlass.select_(s > 0, s << 23, Int32(F32_2POW_M127)))


# ----------------------------------------------------------------------------- element conversion

_Q4_BODY = """{
.reg .b16 lo, hi;
.reg .f32 a, b, c, d, r;
mov.b32 r, $5;
mov.b32 a, $1;
mov.b32 b, $2;
mov.b32 c, $3;
mov.b32 d, $4;
mul.rn.f32 a, a, r;
mul.rn.f32 b, b, r;
mul.rn.f32 c, c, r;
mul.rn.f32 d, d, r;
cvt.rn.satfinite.e4m3x2.f32 lo, b, a;
cvt.rn.satfinite.e4m3x2.f32 hi, d, c;
mov.b32 $0, {lo, hi};
}"""


def quantize4(x0, x1, x2, x3, rcp_bits) -> Int32:
    """Four fp32 (bit patterns) times ``rcp`` -> four e4m3 bytes (RNE, saturating), packed little-endian."""
    return _asm(1, [x0, x1, x2, x3, rcp_bits], _Q4_BODY, "=r,r,r,r,r,r")


def _dq4_decode(word: str, scale: str) -> str:
    """PTX prologue shared by the dequantizers: four e4m3 bytes in ``word`` -> fp32 a, b, c, d; ``scale`` -> s."""
    return f"""{{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 p, q;
.reg .f32 a, b, c, d, s;
mov.b32 s, {scale};
mov.b32 {{lo, hi}}, {word};
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {{h0, h1}}, p;
mov.b32 {{h2, h3}}, q;
cvt.f32.f16 a, h0;
cvt.f32.f16 b, h1;
cvt.f32.f16 c, h2;
cvt.f32.f16 d, h3;
"""


_DQ4_BF16_BODY = _dq4_decode("$2", "$3") + """mul.rn.f32 a, a, s;
mul.rn.f32 b, b, s;
mul.rn.f32 c, c, s;
mul.rn.f32 d, d, s;
cvt.rn.bf16x2.f32 $0, b, a;
cvt.rn.bf16x2.f32 $1, d, c;
}"""


def dequantize4_bf16(word, scale_bits):
    """Four packed e4m3 bytes times ``2**(s-127)`` -> two bf16x2 words (fp32 product, RNE to bf16)."""
    return _asm(2, [word, scale_bits], _DQ4_BF16_BODY, "=r,=r,r,r")


_DQ4_F32_BODY = _dq4_decode("$4", "$5") + """mul.rn.f32 $0, a, s;
mul.rn.f32 $1, b, s;
mul.rn.f32 $2, c, s;
mul.rn.f32 $3, d, s;
}"""


def dequantize4_f32(word, scale_bits):
    """Four packed e4m3 bytes times ``2**(s-127)`` -> four fp32 bit patterns (exact)."""
    return _asm(4, [word, scale_bits], _DQ4_F32_BODY, "=r,=r,=r,=r,r,r")


def quantize_block8(xs, rceil: bool, lanes=QUAD_LANES, amax=None, short: bool = False, nan_words: bool = True):
    """This lane's 8 fp32 bit patterns of a 32-element block held by 4 lanes (a quad: consecutive lanes, or
    those of the butterfly offsets ``lanes``), as MXFP8: ``(q0, q1, s, is_nan)`` -- two words of packed e4m3
    bytes (canonical NaN for a non-finite block), the block's e8m0 scale byte and whether it is NaN. amax
    over the quad (this lane's: ``absmax_bits(xs)``, or ``amax`` where the caller has it), then the exact
    recipes above. ``short``: the scale and its reciprocal by :func:`e8m0_from_amax_bits_short` and
    :func:`e8m0_reciprocal_bits_short` (the same bytes, fewer instructions); ``nan_words=False``: the e4m3 words
    of a NaN block are left as computed (a caller that replaces them, :func:`dequantize8`, saves the selects)."""
    amax = quad_max(absmax_bits(xs) if amax is None else amax, lanes)
    s = e8m0_from_amax_bits_short(amax, rceil) if short else e8m0_from_amax_bits(amax, rceil)
    is_nan = s == E8M0_NAN
    rcp = e8m0_reciprocal_bits_short(s) if short else e8m0_reciprocal_bits(s)
    q0 = quantize4(xs[0], xs[1], xs[2], xs[3], rcp)
    q1 = quantize4(xs[4], xs[5], xs[6], xs[7], rcp)
    if nan_words:
        q0 = Int32(cutlass.select_(is_nan, Int32(E4M3_NAN_X4), q0))
        q1 = Int32(cutlass.select_(is_nan, Int32(E4M3_NAN_X4), q1))
    return q0, q1, s, is_nan


def dequantize8(q0, q1, s, is_nan, f32: bool) -> list:
    """Eight e4m3 bytes (two packed words) times ``2**(s-127)``, as the words a fake-quant output stores:
    four bf16x2 words, or eight fp32 words when ``f32``; the canonical NaN for a NaN block (``is_nan``)."""
    sv = e8m0_value_bits(s)
    if f32:
        words = [*dequantize4_f32(q0, sv), *dequantize4_f32(q1, sv)]
        nan = Int32(F32_NAN)
    else:
        words = [*dequantize4_bf16(q0, sv), *dequantize4_bf16(q1, sv)]
        nan = Int32(BF16_NAN_X2)
    return [cutlass.select_(is_nan, nan, w) for w in words]


def st_global_words(ptr, words) -> None:
    """Four or eight 32-bit words to 16-byte aligned ``ptr`` (32-bit element pointer for eight)."""
    st_global_v4(ptr, *words[:4])
    if len(words) == 8:
        st_global_v4(ptr + 4, *words[4:])


# ----------------------------------------------------------------------------- bf16 outputs by rounding (round_bf16)
# (the block kernel's and the 32x1 kernel's ``round_bf16`` variants)

# The dequantized bf16 value of an element x of a block with scale 2^k is x rounded (RNE) to e4m3's grid scaled by
# 2^k: to 4 significant bits where |x| >= 2^(k-6) (e4m3 normal), to a multiple of q = 2^(k-9) below (subnormal), at
# most 448 2^k (satfinite: floor mode only; an RCEIL scale keeps amax 2^-k <= 448) -- exactly, as long as the
# products are normal: fp32(x) 2^-k is exact, the e4m3 conversion rounds once, the product with 2^k and its bf16
# rounding are exact for k >= -116. That rounding is one bf16 addition of a constant and its subtraction: C = 24 *
# 2^max(e, k-6) (e: x's exponent, so ulp(C) = 2^(max(e, k-6) - 3), the grid's spacing at x, and x + C stays in C's
# binade for either sign of x; C / ulp(C) = 192 is even, so ties go to the even grid point as cvt.rn does): x + C -
# C, then x's sign (a zero result is +0; a tiny negative x must give -0, as its e4m3 byte 0x80 dequantizes). On
# packed bf16x2 words both halves at once: ``C0 = max.u16x2(x & 0x7F807F80, 2^(k-6))``, ``fma.rn.bf16x2(C0, 24, x)``,
# ``fma.rn.bf16x2(C0, -24, t)``, the sign: 5 instructions a word and form (7 in floor mode: the ``min.u16x2`` with
# 448 2^k on the magnitude) instead of about 17 (quantize, dequantize). A block whose amax is non-finite, at least
# 2^124 (24 C0 would overflow) or in (0, 2^-108) (k < -116) is quantized and dequantized as before (no real data has
# the last two; zero blocks take the rounding). tests/test_numerics.py checks the recipe against
# numerics.fake_quantize_blocks on the CPU (every amax mantissa, every element pattern within 2^-19 of it).
_GRID = """{
.reg .b32 c, t, s, k, nk;
mov.b32 k, 0x41C041C0;
mov.b32 nk, 0xC1C0C1C0;
and.b32 c, $1, 0x7F807F80;
max.u16x2 c, c, $2;
fma.rn.bf16x2 t, c, k, $1;
fma.rn.bf16x2 t, c, nk, t;
%s
and.b32 s, $1, 0x80008000;
or.b32 $0, t, s;
}"""
GRID_AMAX_LOW, GRID_AMAX_HIGH = 19 << 7, 251 << 7  # bf16 bits of 2^-108 and 2^124: the rounded blocks' amax range


def grid_bf16x2(w, t2, sat=None) -> Int32:
    """The packed word ``w`` rounded to the e4m3 grid of :data:`_GRID` (``t2``: the blocks' 2^(k-6) per half, as bf16
    bits; ``sat``: floor mode's 448 2^k per half). On the signed value: for a negative x, ``C - |x|`` stays in C's
    binade and rounds as ``|x|`` does (C on the grid, C / ulp even), so ``t - C`` is ``-round(|x|)``, and the sign put
    back makes a zero -0. The exponent bits of ``w`` are taken in each form (kept for both forms, 32 more registers
    would be live)."""
    if sat is None:
        return _asm(1, [w, t2], _GRID % "", "=r,r,r")
    return _asm(1, [w, t2, sat], _GRID % "and.b32 t, t, 0x7FFF7FFF;\nmin.u16x2 t, t, $3;", "=r,r,r,r")


def max_u16x2(a, b) -> Int32:
    return _asm(1, [a, b], "max.u16x2 $0, $1, $2;", "=r,r,r")


def prmt(a, b, sel: int) -> Int32:
    return _asm(1, [a, b], f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r")

def quad_max_u16x2(amax2, lanes=QUAD_LANES) -> Int32:
    """:func:`quad_max` of packed bf16x2 magnitude words (``max.u16x2``): both halves' maxima over the lanes at once."""
    for d in lanes:
        amax2 = max_u16x2(amax2, cute.arch.shuffle_sync_bfly(amax2, offset=d))
    return amax2


def grid_params(amax2, rceil: bool):
    """Per half of ``amax2`` (two blocks' amax, bf16 bits): ``(2^(k-6), 448 2^k)`` of the block's scale 2^k, packed
    as bf16 bits (the second ``None`` in RCEIL mode). RCEIL: k = E - 8, or E - 7 where amax's mantissa exceeds 1.75
    (the exponent field of ``amax + 0x1F``: ``fp32(amax / 448)`` is a power of two exactly at 1.75); floor: k = E - 8.
    Clamped at 2^-127 so that no borrow crosses the halves (a block below 2^-108 is not rounded)."""
    bump = 0x001F001F if rceil else 0
    kb = _asm(1, [amax2], f"add.u32 $0, $1, {bump:#x};\nand.b32 $0, $0, 0x7F807F80;", "=r,r")
    t0 = max_u16x2(kb, Int32(0x07000700)) - Int32(0x07000700)
    return t0, (None if rceil else kb | 0x00600060)


def grid_track(hi, lo, amax2):
    """Running ``(hi, lo)`` of the packed amax words seen so far (``None``, ``None`` at first): ``max.u16x2`` of them,
    and ``min.s16x2`` of ``amax2 + 0x7FFF7FFF`` (per half 0x7FFF for a zero, 0x7FFF + a for a nonzero a: negative as
    s16, ordered as a), so the smallest nonzero amax; :func:`grid_any_exception` reads them."""
    key = _asm(1, [amax2], "add.u32 $0, $1, 0x7FFF7FFF;", "=r,r")
    if hi is None:
        return amax2, key
    return max_u16x2(hi, amax2), _asm(1, [lo, key], "min.s16x2 $0, $1, $2;", "=r,r,r")


def grid_any_exception(hi, lo):
    """Whether any block seen by :func:`grid_track` is one :func:`grid_exception` flags: the largest amax at least
    2^124 (or non-finite), or the smallest nonzero one below 2^-108."""
    top = cutlass.max(hi << 16, hi & Int32(-65536))  # the largest half, in the top half (bit 31 clear)
    low = cutlass.min(lo << 16, lo & Int32(-65536))  # the smallest key, signed
    return (top >= Int32(GRID_AMAX_HIGH << 16)) | (low < Int32((0x7FFF + GRID_AMAX_LOW - 0x10000) << 16))


def grid_exception(amax16):
    """Whether a block (amax ``amax16``, bf16 bits) is quantized and dequantized instead of rounded (:data:`_GRID`)."""
    return (amax16 >= GRID_AMAX_HIGH) | ((amax16 != 0) & (amax16 < GRID_AMAX_LOW))


# ----------------------------------------------------------------------------- groups


def warp_inclusive_max(v, lane) -> Int32:
    """Inclusive prefix max over the lanes of a warp (lane 0 first)."""
    for d in (1, 2, 4, 8, 16):
        v = cutlass.max(v, cute.arch.shuffle_sync_up(v, offset=d))  # lanes < d get their own value
    return v


def warp_inclusive_sum(v, lane) -> Int32:
    """Inclusive prefix sum over the lanes of a warp."""
    for d in (1, 2, 4, 8, 16):
        y = cute.arch.shuffle_sync_up(v, offset=d)
        v = v + Int32(cutlass.select_(lane >= d, y, Int32(0)))
    return v


def sanitized_group_ends(raw, m, lane, carry_end):
    """One warp-wide step of the group table, 32 groups (one per lane) at a time.

    ``raw`` is this lane's ``offs[g]`` (0 past the last group). Returns ``(end, prev)``: the
    sanitized end ``max_{j<=g} clamp(offs[j], 0, M)`` and the previous group's end (the start of
    group g), continuing from ``carry_end`` -- the same definition as
    :func:`moe_quant.layouts.sanitize_offsets`. Both kernels build their group tables on it.
    """
    e = cutlass.min(cutlass.max(Int32(raw), Int32(0)), Int32(m))
    e = cutlass.max(warp_inclusive_max(e, lane), Int32(carry_end))
    prev = cute.arch.shuffle_sync_up(e, offset=1)
    prev = Int32(cutlass.select_(lane == 0, Int32(carry_end), prev))
    return e, prev


def m_groups_table_step(raw, m, lane, carry_end, carry_pend):
    """One warp-wide step of the M-groups (blocked scales) group table, 32 groups at a time.

    On :func:`sanitized_group_ends`, plus each group padded to a multiple of 128 rows: returns
    ``(end, shift, pend, carry_end, carry_pend)`` -- the sanitized end, the row shift ``P_g - start_g``
    of the group's rows in the padded buffer, the padded end ``P_{g+1}``, and the carries for the next
    32 groups (lane 31's end and padded end)."""
    e, prev = sanitized_group_ends(raw, m, lane, carry_end)
    pad = round_up_tile_rows(e - prev)
    pend = carry_pend + warp_inclusive_sum(pad, lane)
    return (e, pend - pad - prev, pend, cute.arch.shuffle_sync(e, offset=31),
            cute.arch.shuffle_sync(pend, offset=31))


def round_up_tile_rows(n) -> Int32:
    """``round_up(n, 128)`` for non-negative Int32 ``n`` (the M-groups per-group padding)."""
    return (Int32(n) + (TILE_ROWS - 1)) & Int32(-TILE_ROWS)


def round_up_block(n) -> Int32:
    """``round_up(n, 32)`` for non-negative Int32 ``n`` (the K-groups per-group token padding)."""
    return (Int32(n) + (BLOCK_SIZE - 1)) & Int32(-BLOCK_SIZE)


@cute.jit
def zero_scale_tile_padding(scales, p0: Int32, nc: Int32, buf_rows: Int32, in_group: Int32, nreal: Int32,
                            tid: Int32, threads: cutlass.Constexpr):
    """Zero the bytes of the M-groups (or whole-matrix) blocked scale buffer's row tile at row ``p0`` that
    hold no real scale: the whole tile (up to ``buf_rows``) when ``in_group == 0`` (the tail after the last
    group), else its local rows ``>= nreal``. One CTA of ``threads`` threads per tile; 4-byte stores."""
    base = scales.iterator + Int64(p0) * Int64(nc * 4)
    if in_group == 0:
        # Tail after the last group: rows [p0, min(p0 + 128, buf_rows)) are all zero; contiguous.
        n_words = (cutlass.min(p0 + TILE_ROWS, buf_rows) - p0) * nc
        for w in cutlass.range(tid, n_words, threads):
            st_global_u32(base + w * 4, 0)
    elif nreal < TILE_ROWS:
        # Group tile: local rows q >= nreal are padding. Word wi = 128 j + 4 l + w holds
        # rows q = 32 w + l of column tile j (docs/design.md section 3).
        n_words = nc * TILE_ROWS
        for wi in cutlass.range(tid, n_words, threads):
            q = (wi % 4) * 32 + (wi // 4) % 32
            if q >= nreal:
                st_global_u32(base + wi * 4, 0)


@cute.jit
def upper_bound(t, n: Int32, key: Int32) -> Int32:
    """Smallest i in [0, n) with ``t[i] > key`` (binary search of a non-decreasing table, e.g. group ends);
    the caller guarantees ``t[n-1] > key``."""
    lo = Int32(0)
    hi = n - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if Int32(t[mid]) > key:
            hi = mid
        else:
            lo = mid + 1
    return lo


@cute.jit
def upper_bounds(t, n: Int32, keys) -> list:
    """:func:`upper_bound` of every key in ``keys`` (a list; ``n >= 1``), searched together level by level:
    per level one shared-memory load per key, the keys' loads independent of each other, so the search
    costs ``floor(log2 n) + 1`` dependent loads, not that many per key one key after the other. Branchless
    binary lifting (``pos`` counts the entries ``<= key``); a key with no entry above it gets ``n - 1``."""
    pos = cute.make_rmem_tensor(len(keys), Int32)
    for u in cutlass.range_constexpr(len(keys)):
        pos[u] = Int32(0)
    step = Int32(1) << (Int32(31) - Int32(cute.arch.clz(n)))  # the largest power of two <= n
    while step > 0:
        for u in cutlass.range_constexpr(len(keys)):
            p = Int32(pos[u])
            nxt = p + step
            below = Int32(t[cutlass.min(nxt, n) - 1]) <= keys[u]
            pos[u] = Int32(cutlass.select_((nxt <= n) & below, nxt, p))
        step = step >> 1
    return [cutlass.min(Int32(pos[u]), n - 1) for u in range(len(keys))]


@cute.jit
def store_blocked_scale(scales, r: Int32, c: Int32, kb: Int32, nc: Int32, s: Int32):
    """Scale byte ``s`` of buffer row ``r``, column ``c`` into a blocked scale buffer (``nc`` column tiles,
    ``kb`` real columns); the row's last real scale also zeroes its pad columns ``[kb, 4 nc)``, which live
    in the same 4-byte word."""
    store_blocked_scale_at(scales, blocked_offset(r, c, nc), c, kb, nc, s)


@cute.jit
def store_blocked_scale_at(scales, dest, c: Int32, kb: Int32, nc: Int32, s: Int32):
    """:func:`store_blocked_scale` of a scale whose byte ``dest`` (``blocked_offset(r, c, nc)``) the caller has."""
    sp = scales.iterator
    st_global_u8(sp + dest, s)
    if c == kb - 1:
        for j in cutlass.range_constexpr(1, 4):
            if c + j < nc * 4:
                st_global_u8(sp + (dest + j), 0)


def e4m3_has_nan(words):
    """Whether any byte of the packed e4m3 words is a NaN (0x7F or 0xFF): a byte's magnitude plus one reaches
    bit 7 only from 0x7F, and no carry crosses into the next byte."""
    acc = Int32(0)
    for w in words:
        acc = acc | ((Int32(w) & 0x7F7F7F7F) + 0x01010101)
    return (acc & Int32(-0x7F7F7F80)) != 0  # 0x80808080


def canonical_nan_words(words, f32: bool) -> list:
    """Output words of a dequantization with every NaN element replaced by the canonical positive NaN
    (bf16 0x7FC0, fp32 0x7FC00000), as :func:`moe_quant.numerics.dequantize_blocks` writes it: a NaN e4m3
    byte under a finite scale decodes to a NaN whose bits the conversion picks."""
    out = []
    for w in words:
        w = Int32(w)
        if f32:
            out.append(Int32(cutlass.select_((w & F32_ABS_MASK) > F32_EXP_INF, Int32(F32_NAN), w)))
        else:
            lo = w & 0xFFFF
            hi = w & Int32(-65536)
            lo = Int32(cutlass.select_((lo & 0x7FFF) > 0x7F80, Int32(0x7FC0), lo))
            hi = Int32(cutlass.select_((hi & 0x7FFF0000) > 0x7F800000, Int32(0x7FC00000), hi))
            out.append(hi | lo)
    return out


def as_i64(v) -> Int64:
    return Int64(v)
