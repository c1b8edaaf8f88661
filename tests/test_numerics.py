"""Reference MXFP8 numerics: bit-identical to torchao's to_mx, and docs/design.md section 2 special values."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from mx_strategies import DISTRIBUTIONS, make_values, to_bytes

from moe_quant import from_mxfp8, to_mxfp8
from moe_quant.numerics import (E8M0_NAN, ScaleMode, dequantize_blocks, e8m0_from_amax, e8m0_to_fp32,
                                fake_quantize_blocks)

to_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor").to_mx
SCM = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode
TORCHAO_MODE = {ScaleMode.RCEIL: SCM.RCEIL, ScaleMode.FLOOR: SCM.FLOOR}


def torchao_reference(x, mode):
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, TORCHAO_MODE[mode])
    return data, scale


@given(
    rows=st.integers(1, 48),
    kblocks=st.integers(1, 8),
    dist=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(list(ScaleMode)),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_bit_identical_to_torchao(rows, kblocks, dist, seed, mode, dtype):
    """Every scale byte, and the data of every block where torchao follows docs/design.md, match to_mx.

    torchao departs from docs/design.md section 2 in three places, each pinned by its own test below:
    Inf-holding blocks get a finite scale (254 RCEIL / 247 FLOOR) instead of 255 (Inf is left out
    of this comparison); FLOOR NaN blocks keep 0 for their finite elements instead of NaN; and a
    block whose scale is byte 0 (2**-127) is scaled by 1 (RCEIL) or 2**126 (FLOOR) instead of
    2**127, so its tiny values are flushed or halved rather than quantized.
    """
    x = make_values((rows, 32 * kblocks), dist, seed, dtype, inject_inf=False)
    data, scale = to_mxfp8(x, scale_mode=mode)
    ref_data, ref_scale = torchao_reference(x, mode)
    assert scale.dtype == torch.float8_e8m0fnu and data.dtype == torch.float8_e4m3fn
    assert torch.equal(to_bytes(scale), to_bytes(ref_scale))
    s = to_bytes(scale).repeat_interleave(32, dim=-1)
    comparable = (s != E8M0_NAN) & (s != 0)
    if mode is ScaleMode.RCEIL:
        comparable |= s == E8M0_NAN
    assert torch.equal(to_bytes(data)[comparable], to_bytes(ref_data)[comparable])
    assert bool((to_bytes(data)[s == E8M0_NAN] == 0x7F).all())
    # byte-0 blocks: the docs/design.md element rule, x * 2**127, rounded and saturated
    tiny = s == 0
    expect = (x.float()[tiny] * 2.0**127).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(to_bytes(data)[tiny], to_bytes(expect))


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "-nan"])
def test_non_finite_blocks(mode, special):
    x = torch.randn(4, 64)
    x[1, 40] = float(special.replace("-", "")) * (-1 if special.startswith("-") else 1)
    data, scale = to_mxfp8(x, scale_mode=mode)
    s = to_bytes(scale)
    assert s[1, 1] == 255 and bool((s[[0, 2, 3]] != 255).all()) and s[1, 0] != 255
    assert bool((to_bytes(data)[1, 32:] == 0x7F).all())
    deq = from_mxfp8(data, scale)
    assert bool(deq[1, 32:].isnan().all()) and bool(deq[1, :32].isfinite().all())
    assert bool((deq[1, 32:].view(torch.int16) == 0x7FC0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_special_values(dtype):
    finfo = torch.finfo(dtype)
    x = torch.zeros(4, 32, dtype=dtype)
    x[1, 0] = finfo.max  # largest finite input
    x[2, :] = finfo.smallest_normal * 0  # all-zero block
    x[3, 0] = torch.tensor(2.0**-133, dtype=torch.float32).to(torch.bfloat16).to(dtype)  # smallest bf16 subnormal
    for mode, largest in [(ScaleMode.RCEIL, 247), (ScaleMode.FLOOR, 246)]:
        data, scale = to_mxfp8(x, scale_mode=mode)
        s = to_bytes(scale)
        assert s[0, 0] == 0 and bool((to_bytes(data)[0] == 0).all())  # all-zero -> scale byte 0, data 0
        assert s[1, 0] == largest
        assert s[2, 0] == 0
        assert s[3, 0] == 0 and to_bytes(data)[3, 0] == 0x08  # 2^-133 / 2^-127 = 2^-6 -> e4m3 0x08 (subnormal)


def test_rceil_rounding_definition():
    # amax*(1/448) exactly a power of two keeps its exponent; one ulp more rounds up
    amax = torch.tensor([448.0, 448.0 * 2**-100, 1.0, 0.0, float("inf"), float("nan")])
    s = e8m0_from_amax(amax, ScaleMode.RCEIL)
    bump = e8m0_from_amax(torch.nextafter(amax[:1], torch.tensor([1e9])), ScaleMode.RCEIL)
    assert s[0] == 127 + 0 + (1 if float(torch.tensor(448.0) * torch.tensor(1 / 448.0)) > 1 else 0)
    assert bump[0] >= s[0]
    assert s[3] == 0 and s[4] == E8M0_NAN and s[5] == E8M0_NAN
    # FLOOR: floor(log2(amax)) - 8
    f = e8m0_from_amax(torch.tensor([448.0, 512.0, 1.0, 2.0**-140]), ScaleMode.FLOOR)
    assert f.tolist() == [127 + 8 - 8, 127 + 9 - 8, 127 - 8, 0]


def test_floor_saturates():
    x = torch.full((1, 32), 500.0)  # FLOOR scale 2^0 -> 500 saturates to 448
    data, scale = to_mxfp8(x, scale_mode="floor")
    assert to_bytes(scale)[0, 0] == 127 and bool((data.float() == 448).all())


def test_e8m0_to_fp32_exact():
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_fp32(s)
    expect = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(v[:255].double(), expect) and bool(v[255].isnan())


@given(rows=st.integers(1, 16), kblocks=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(list(ScaleMode)))
@example(rows=1, kblocks=1, seed=144709294, mode=ScaleMode.FLOOR)  # a block norm error of 6.08% (FLOOR saturates)
def test_dequantize_is_exact_and_close(rows, kblocks, seed, mode):
    x = make_values((rows, 32 * kblocks), "normal", seed, torch.float32)
    data, scale = to_mxfp8(x, scale_mode=mode)
    deq32 = dequantize_blocks(data, scale, torch.float32)
    deq16 = from_mxfp8(data, scale)
    assert torch.equal(deq16.float(), deq32)  # the dequantized values are exact in bf16
    # every element within half an e4m3 step of x: 2^-4 |x| in the normal range (3 mantissa bits), 2^-10 s
    # among the subnormals (spacing 2^-9 s); FLOOR may put |x| above 448 s, which saturates to exactly 448 s
    s = e8m0_to_fp32(to_bytes(scale)).repeat_interleave(32, dim=1)
    err, mag = (deq32 - x).abs(), x.abs()
    sat = mag > 448 * s
    assert mode is ScaleMode.FLOOR or not bool(sat.any())  # RCEIL scales amax to at most 448
    assert torch.equal(deq32[sat], torch.copysign(448 * s[sat], x[sat]))
    assert bool((err[~sat] <= (mag * 2.0**-4 + s * 2.0**-10)[~sat]).all())


def test_scale_mode_parse():
    assert ScaleMode.parse("RCEIL") is ScaleMode.RCEIL
    with pytest.raises(ValueError, match="scale_mode"):
        ScaleMode.parse("nearest")


def _enum_parse(cls, value):
    """What ``Choice.parse`` computed before its table lookup: the member ``cls(value.lower())``, or None."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.lower())
        except ValueError:
            return None
    return None


def _choice_classes():
    from moe_quant.backends import GemmBackend
    from moe_quant.ep.dispatcher import Transport
    from moe_quant.ep.legs import Wire

    return [ScaleMode, GemmBackend, Transport, Wire]


_CHOICE_VALUES = [m for cls in _choice_classes() for m in cls] + [m.value for cls in _choice_classes() for m in cls]


@given(st.sampled_from(_choice_classes()),
       st.one_of(st.sampled_from(_CHOICE_VALUES), st.sampled_from(_CHOICE_VALUES).map(str.upper),
                 st.sampled_from(_CHOICE_VALUES).map(str.title), st.text(max_size=8), st.integers(), st.none()))
def test_choice_parse_is_the_enum_lookup(cls, value):
    """``Choice.parse`` looks the lower-cased text up in the enum's value table (host time): the same member as
    ``cls(value.lower())`` for every text and every member of any choice, and the same ``ValueError`` otherwise."""
    want = _enum_parse(cls, value)
    if want is None:
        with pytest.raises(ValueError, match=cls.__argname__):
            cls.parse(value)
    else:
        assert cls.parse(value) is want


def _short_scale(amax_bits: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """The kernels' short scale formula (``cute_utils.e8m0_from_amax_bits_short``, the ``lean`` block variants) on
    fp32 magnitude bit patterns (int64 holding values below 2^31), in PyTorch's integer ops."""
    amax = amax_bits.to(torch.int32).view(torch.float32)
    if mode is ScaleMode.RCEIL:
        from moe_quant.numerics import RCP_E4M3_MAX_F32_BITS

        rcp = torch.tensor(RCP_E4M3_MAX_F32_BITS, dtype=torch.int32).view(torch.float32)
        d = (amax * rcp).view(torch.int32).to(torch.int64)  # IEEE fp32 multiply, subnormals kept (as mul.rn.f32)
        e = (d + torch.where(d < 0x800000, 0x3FFFFF, 0x7FFFFF)) >> 23
    else:
        e = ((amax_bits >> 23) - 8).clamp(min=0)
    return torch.where(amax_bits >= 0x7F800000, E8M0_NAN, e).to(torch.uint8)


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_kernel_short_scale_formula_equals_the_reference(mode):
    """The short scale formula of the ``lean`` block variants equals ``numerics.e8m0_from_amax`` on fp32 amax bit
    patterns: every mantissa of the exponent fields 8-10 (where d = amax / 448 crosses 2^-127 and 2^-126, the two
    subnormal rules), and for each of the 256 exponent fields its mantissa edges and 2^16 random mantissas."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF], dtype=torch.int64)
    mant = torch.cat([edges, torch.randint(0, 1 << 23, (1 << 16,), generator=gen)])
    chunks = [(e << 23) | torch.arange(1 << 23, dtype=torch.int64) for e in (8, 9, 10)]
    chunks.append((torch.arange(256, dtype=torch.int64).unsqueeze(1) << 23 | mant).flatten())
    for bits in chunks:
        want = e8m0_from_amax(bits.to(torch.int32).view(torch.float32), mode)
        got = _short_scale(bits, mode)
        bad = (got != want).nonzero().flatten()
        assert not bad.numel(), (f"{mode.value}: {bad.numel()} amax patterns differ, e.g. "
                                 f"{[hex(int(bits[i])) for i in bad[:4]]}: got {got[bad[:4]].tolist()} "
                                 f"want {want[bad[:4]].tolist()}")


# The kernels' bf16 outputs rounded on the packed words (``round_bf16``, kernels/cute_utils.py ``_GRID``,
# ``grid_params``, ``grid_exception``), modelled here element by element on bf16 bit patterns: the constants are the
# kernel's (2^-108 and 2^124 as bf16 bits, 24 = 1.5 * 2^4, the RCEIL bump 0x1F, 2^(k-6) = Kb - 14 << 7).
_GRID_LOW, _GRID_HIGH = 19 << 7, 251 << 7


def _rn_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to bf16 once (RNE on the bit pattern: 8 significant bits), as bf16 bit patterns
    (int64); the values here are normal bf16 magnitudes or zero."""
    b = v.view(torch.int64)
    mag = b & 0x7FFFFFFFFFFFFFFF
    mag = (mag + (1 << 44) - 1 + ((mag >> 45) & 1)) & ~((1 << 45) - 1)
    out = mag.view(torch.float64).to(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return out | ((b < 0).to(torch.int64) << 15)


def _bf16_value(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _grid_model(blocks: torch.Tensor, mode: ScaleMode):
    """(rounded bf16 bits, which blocks the kernel rounds) of blocks of bf16 bit patterns (int64, (..., 32))."""
    mag = blocks & 0x7FFF
    amax = mag.amax(-1, keepdim=True)
    rounded = (amax < _GRID_HIGH) & ((amax == 0) | (amax >= _GRID_LOW))
    kb = (amax + (0x1F if mode is ScaleMode.RCEIL else 0)) & 0x7F80
    t0 = kb.clamp(min=0x700) - 0x700  # 2^(k-6) of the block's scale 2^k
    c0 = torch.maximum(blocks & 0x7F80, t0)
    big_c = _bf16_value(c0) * 24  # exact
    t = _rn_bf16(_bf16_value(blocks) + big_c)  # fma.rn.bf16x2(C0, 24, x): x + C exact in float64, rounded once
    y = _rn_bf16(_bf16_value(t) - big_c)  # exact
    if mode is ScaleMode.FLOOR:
        y = torch.minimum(y & 0x7FFF, kb | 0x60)  # 448 2^k
    return (y & 0x7FFF) | (blocks & 0x8000), rounded.squeeze(-1)


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_kernel_grid_rounding_equals_fake_quantize(mode):
    """The block kernels' ``round_bf16`` recipe (each element rounded to its block's e4m3 grid by adding and
    subtracting ``24 * 2^max(e, k-6)`` in bf16, then its sign) equals ``numerics.fake_quantize_blocks`` byte for byte
    on every block it rounds: every amax mantissa at amax exponents across the range (2^-108 to 2^123, where the
    scale rounds up or not), the block's other elements every bf16 pattern of both signs within 2^-19 of the amax
    (e4m3 normal and subnormal, ties, values that round to zero); and random blocks of raw bits (most of them
    flagged and left to the exact path: the test checks that the flag holds the non-finite, huge and tiny ones)."""
    gen = torch.Generator().manual_seed(0)
    tested = 0
    for e in (-109, -108, -107, -90, -20, -1, 0, 1, 7, 8, 60, 122, 123, 124):
        field = e + 127
        amax = (field << 7) | torch.arange(128, dtype=torch.int64)  # every mantissa
        below = ((field - torch.arange(20, dtype=torch.int64)).clamp(min=0).unsqueeze(1) << 7
                 | torch.arange(128, dtype=torch.int64)).flatten()
        below = torch.cat([below, below | 0x8000, torch.tensor([0, 0x8000, 1, 0x8001])])
        below = below[torch.randperm(below.numel(), generator=gen)]
        n = -(-below.numel() // 31)
        rest = torch.cat([below, below[: n * 31 - below.numel()]]).view(n, 31)
        blocks = torch.cat([amax.view(128, 1, 1).expand(128, n, 1), (rest.unsqueeze(0) & 0xFFFF).expand(128, n, 31)
                            .clone()], -1)
        blocks = torch.where((blocks & 0x7FFF) > amax.view(128, 1, 1), amax.view(128, 1, 1), blocks)  # keep amax
        blocks = blocks.view(-1, 32)
        got, rounded = _grid_model(blocks, mode)
        assert bool(rounded.all()) == (-108 <= e < 124)
        want = fake_quantize_blocks(_bf16_value(blocks).to(torch.bfloat16), mode).view(torch.int16).to(torch.int64)
        bad = ((got != (want & 0xFFFF)) & rounded.unsqueeze(-1)).nonzero()
        assert not bad.numel(), (f"{mode.value} amax 2^{e}: {bad.shape[0]} elements differ, e.g. block "
                                 f"{[hex(int(v)) for v in blocks[bad[0, 0]]]} element {int(bad[0, 1])}: got "
                                 f"{hex(int(got[tuple(bad[0])]))} want {hex(int(want[tuple(bad[0])]) & 0xFFFF)}")
        tested += int(rounded.sum())
    raw = torch.randint(0, 1 << 16, (1 << 16, 32), generator=gen, dtype=torch.int64)
    spread = raw & 0x807F | ((torch.randint(100, 140, (1 << 16, 1), generator=gen) - torch.randint(
        0, 24, (1 << 16, 32), generator=gen)) << 7)  # a random exponent per block, elements spread below it
    grid = make_values((1 << 11, 1024), "grid", 5).view(torch.int16).to(torch.int64).view(-1, 32) & 0xFFFF
    for blocks in (raw, spread, grid):
        got, rounded = _grid_model(blocks, mode)
        amax = _bf16_value(blocks).abs().amax(-1)
        in_range = amax.isfinite() & ((amax == 0) | ((amax >= 2.0**-108) & (amax < 2.0**124)))
        assert not bool((rounded & ~in_range).any())
        want = fake_quantize_blocks(_bf16_value(blocks).to(torch.bfloat16), mode).view(torch.int16).to(torch.int64)
        assert torch.equal(got[rounded], want[rounded] & 0xFFFF), mode
        tested += int(rounded.sum())
    assert tested > 300_000
