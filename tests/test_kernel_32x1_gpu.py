"""CuTe-DSL colwise 32x1 MXFP8 kernel (wgrad K-groups operands, 3D weights along N) and the 3D-along-K
path over the 1x32 kernel, vs the pure-PyTorch reference, byte for byte (CUDA only).

The reference runs on the CPU; every output buffer is filled with 0xFF bytes before the launch, so a
byte the kernel does not write (padding between groups, the tail, scale padding) shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import DISTRIBUTIONS, group_sizes, make_values, offsets_from_sizes

from moe_quant import layouts, reference
from moe_quant.kernels import compile_cache, ops
from moe_quant.kernels.quantize_32x1 import config as config_32x1
from moe_quant.kernels.quantize_32x1 import ops as ops_32x1
from moe_quant.numerics import BLOCK_SIZE, ScaleMode

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(compile_cache, "POISON_OUTPUTS", True)
    yield


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str):
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} vs {want.dtype}"
    g, w = as_bytes(got).reshape(-1), as_bytes(want).reshape(-1)
    bad = (g != w).nonzero().flatten()
    if bad.numel():
        i = bad[:8].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} bytes differ; first at {i}: "
                             f"got {g[i].tolist()} want {w[i].tolist()}")


def colwise_values(m: int, r: int, dist: str, seed: int, dtype) -> torch.Tensor:
    """``(M, R)`` values whose 32-element runs *along tokens* follow ``dist`` (the strategies block the last dim)."""
    if m * r == 0:
        return torch.zeros(m, r, dtype=dtype)
    return make_values((r, m), dist, seed, dtype).t().contiguous()


def check_k_groups(x_cpu: torch.Tensor, offs_cpu: torch.Tensor, mode: ScaleMode):
    x, offs = x_cpu.cuda(), offs_cpu.cuda()
    d, s, p = ops.quantize_32x1_k_groups(x, mode, offs)
    rd, rs, rp = reference.quantize_colwise_k_groups(x_cpu, offs_cpu, mode)
    assert_bytes_equal(d, rd, "data_t")
    assert_bytes_equal(s, rs, "scales")
    assert_bytes_equal(p, rp, "padded offs")
    for out_dtype in (torch.bfloat16, torch.float32):
        v, p2 = ops.fake_quantize_32x1_k_groups(x, mode, offs, out_dtype)
        rv, _ = reference.fake_quantize_colwise_k_groups(x_cpu, offs_cpu, mode, out_dtype)
        assert_bytes_equal(v, rv, f"fake {out_dtype}")
        assert_bytes_equal(p2, rp, "padded offs (fake)")


def check_3d(w_cpu: torch.Tensor, mode: ScaleMode):
    w = w_cpu.cuda()
    for along, quant, fake in (("n", ops.quantize_3d_along_n, ops.fake_quantize_3d_along_n),
                               ("k", ops.quantize_3d_along_k, ops.fake_quantize_3d_along_k)):
        d, s = quant(w, mode)
        rd, rs = reference.quantize_3d(w_cpu, mode, along)
        assert_bytes_equal(d, rd, f"3d along {along} data")
        assert_bytes_equal(s, rs, f"3d along {along} scales")
        src = w_cpu.transpose(-2, -1) if along == "n" else w_cpu
        for out_dtype in (torch.bfloat16, torch.float32):
            assert_bytes_equal(fake(w, mode, out_dtype), reference.fake_quantize_3d(src, mode, -1, out_dtype),
                               f"3d along {along} fake {out_dtype}")


dims_r = st.one_of(st.sampled_from([32, 64, 96, 128, 160, 224, 256, 544]), st.integers(1, 24).map(lambda n: 32 * n))
modes = st.sampled_from(list(ScaleMode))
dtypes = st.sampled_from([torch.bfloat16, torch.float32])
dists = st.sampled_from(DISTRIBUTIONS)
seeds = st.integers(0, 2**31 - 1)


@given(groups=group_sizes(max_groups=8, max_size=300), r=dims_r, mode=modes, dtype=dtypes, dist=dists, seed=seeds)
def test_k_groups(groups, r, mode, dtype, dist, seed):
    sizes, tail = groups
    m = sum(sizes) + tail
    check_k_groups(colwise_values(m, r, dist, seed, dtype), offsets_from_sizes(sizes), mode)


@given(m=st.integers(0, 500), g=st.integers(0, 12), r=dims_r, mode=modes, seed=seeds)
def test_k_groups_adversarial_offsets(m, g, r, mode, seed):
    """Offsets past M, negative, decreasing: sanitized exactly as layouts.group_bounds does."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.randint(-64, m + 300, (g,), generator=gen, dtype=torch.int32)
    check_k_groups(colwise_values(m, r, "normal", seed, torch.bfloat16), offs, mode)


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize(
    "sizes,r",
    [
        ([0, 1, 31, 33, 127, 129, 0, 300], 2048),  # special sizes
        ([4000, 0, 5, 4191], 7168),  # large; R % 1024 != 0
        ([1] * 40 + [0] * 10 + [77] * 40, 160),  # G = 90: several warp passes of the group scan
        ([3] * 1000, 64),  # G = 1000
        ([0, 0, 0], 96),  # only empty groups: data and scales are all padding
        ([], 64),  # G = 0
    ],
)
def test_k_groups_fixed(sizes, r, mode):
    m = sum(sizes) + 17
    x = colwise_values(m, r, "wide", 1234, torch.bfloat16)
    check_k_groups(x, offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32), mode)


@pytest.mark.parametrize("cand", [name for name, fields in config_32x1.CANDIDATES.items() if fields])
def test_candidates_match_reference(cand):
    """Each A/B candidate (``config.CANDIDATES``), put in place of the bf16-input variants of both group kinds, both
    modes and all three outputs (``config.with_candidate``: a field that does not apply to a variant left out), byte
    for byte: ragged groups with R % 128 == 64 (a half scale tile) and more column tiles than a raster group, 3D
    weights with N % 128 != 0. Candidates with per-element fields (``config.ELEMENT_FIELDS``) also on NaN / Inf, bf16
    subnormals, amaxes that floor saturates, zero blocks and blocks spanning their e4m3 grid (round_bf16's exception
    and rounding cases) in both modes, and on empty groups only, offsets past M, negative and decreasing, G = 0 and
    M = 0."""
    import contextlib

    dev = torch.device("cuda", torch.cuda.current_device())
    per_element = bool(set(config_32x1.CANDIDATES[cand]) & set(config_32x1.ELEMENT_FIELDS))
    with contextlib.ExitStack() as stack:
        for v in config_32x1.all_variants():
            if v.in_dtype == "bfloat16":
                stack.enter_context(ops_32x1.variant_in_place(
                    config_32x1.with_candidate(v, config_32x1.CANDIDATES[cand]), dev))
        for sizes, r in (([0, 1, 31, 33, 127, 129, 0, 300], 2144), ([4000, 0, 5, 4191], 7168), ([3] * 100, 64)):
            x = colwise_values(sum(sizes) + 17, r, "wide", 99, torch.bfloat16)
            check_k_groups(x, offsets_from_sizes(sizes), ScaleMode.RCEIL)
        for shape in ((3, 160, 96), (2, 2048, 7168), (5, 96, 2080)):
            check_3d(make_values(shape, "normal", 5, torch.bfloat16), ScaleMode.RCEIL)
        if not per_element:  # a CTA order or tile width: the same code per element
            return
        sizes = [0, 1, 31, 33, 127, 129, 0, 300]
        for i, dist in enumerate(("nan_inf", "subnormal", "amax_band", "zero_blocks", "grid", "normal")):
            x = colwise_values(sum(sizes) + 17, 544, dist, 7 + i, torch.bfloat16)
            for mode in ScaleMode:
                check_k_groups(x, offsets_from_sizes(sizes), mode)
        for m, r, offs in ((500, 96, [100, 700, 50, -5, 10**6, 499]), (96, 64, [0, 0, 0]), (300, 64, []),
                           (0, 128, [0, 0, 0])):
            x = colwise_values(m, r, "wide", m + r, torch.bfloat16)
            for mode in ScaleMode:
                check_k_groups(x, torch.tensor(offs, dtype=torch.int32), mode)
        for i, dist in enumerate(("nan_inf", "amax_band", "grid")):  # blocks along N: drawn as (E, K, N)
            w = make_values((3, 96, 160), dist, 21 + i, torch.bfloat16).transpose(-2, -1).contiguous()
            for mode in ScaleMode:
                check_3d(w, mode)


@given(e=st.integers(1, 5), n=st.integers(1, 10).map(lambda v: 32 * v), k=st.integers(1, 10).map(lambda v: 32 * v),
       mode=modes, dtype=dtypes, dist=dists, seed=seeds)
def test_3d(e, n, k, mode, dtype, dist, seed):
    check_3d(make_values((e, n, k), dist, seed, dtype), mode)


@pytest.mark.parametrize("shape", [(8, 256, 512), (3, 160, 96), (2, 2048, 7168)])
def test_3d_fixed(shape):
    for mode in ScaleMode:
        check_3d(make_values(shape, "normal", 5, torch.bfloat16), mode)


def test_empty_inputs():
    for m, r, sizes in [(0, 64, [0, 0]), (40, 0, [10, 30]), (0, 0, [0]), (0, 64, [])]:
        check_k_groups(torch.zeros(m, r, dtype=torch.bfloat16),
                       offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32), ScaleMode.RCEIL)
    for shape in [(0, 64, 32), (2, 0, 64), (2, 32, 0)]:
        check_3d(torch.zeros(shape, dtype=torch.bfloat16), ScaleMode.RCEIL)


def test_specials_bitwise():
    """Largest finite input, bf16 subnormals, zeros, NaN/Inf blocks along tokens; the NaN block's padding is NaN."""
    x = torch.zeros(100, 64, dtype=torch.float32)
    x[:32, 0] = torch.finfo(torch.float32).max
    x[:32, 1] = 2.0**-133  # smallest bf16 subnormal
    x[40, 2] = float("nan")
    x[97, 3] = -float("inf")  # group 1's last block: real tokens 64..67 of 68, padding 68..95
    x[64:, 4] = -(2.0**-149)
    offs = torch.tensor([32, 100], dtype=torch.int32)  # group 1: 68 tokens, padded to 96
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ScaleMode:
            check_k_groups(x.to(dtype), offs, mode)
    d, s, _ = ops.quantize_32x1_k_groups(x.cuda(), ScaleMode.RCEIL, offs.cuda())
    plain = as_bytes(layouts.from_blocked_k_groups(s.cpu(), offs, 64, 100))  # column j: padded tokens 32j..
    assert plain[0, 0] == 247 and plain[1, 0] == 0 and plain[2, 1] == 255 and plain[3, 3] == 255
    assert as_bytes(d)[3, 32 + 64 + 10] == 0x7F  # padding token (68..95) of group 1's NaN block


def test_offsets_not_read_past_g_and_any_g():
    """The group scan reads exactly G offsets; a CTA count far above the work exits cleanly."""
    x = colwise_values(5000, 96, "normal", 3, torch.bfloat16)
    base = torch.tensor([100, 100, 4000, 5000, 5000], dtype=torch.int32)
    storage = torch.cat([base, torch.full((7,), -(2**31), dtype=torch.int32)])
    offs = storage[:5]
    check_k_groups(x, offs, ScaleMode.FLOOR)


def test_torch_compile_fullgraph():
    x = colwise_values(300, 224, "normal", 7, torch.bfloat16).cuda()
    w = make_values((4, 96, 160), "normal", 8, torch.bfloat16).cuda()
    offs = offsets_from_sizes([100, 0, 129, 71], "cuda")

    def f(x, w, offs):
        d, s, p = ops.quantize_32x1_k_groups(x, ScaleMode.RCEIL, offs)
        v, _ = ops.fake_quantize_32x1_k_groups(x, ScaleMode.FLOOR, offs)
        wd, ws = ops.quantize_3d_along_n(w, ScaleMode.RCEIL)
        wk, wks = ops.quantize_3d_along_k(w, ScaleMode.RCEIL)
        return d, s, p, v, wd, ws, ops.fake_quantize_3d_along_n(w, ScaleMode.RCEIL), wk, wks

    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(x, w, offs), f(x, w, offs)):
        assert_bytes_equal(a, b, "compiled vs eager")


def test_index_math_past_int32():
    """M * R > 2**31: the last group sits at input rows and output columns past the int32 range."""
    r = 7168
    m = (2**31) // r + 1200
    tail = 4000
    x = torch.empty(m, r, dtype=torch.bfloat16, device="cuda").normal_()
    offs_cpu = torch.tensor([m - tail, m], dtype=torch.int32)
    assert m * r > 2**31
    d, s, p = ops.quantize_32x1_k_groups(x, ScaleMode.RCEIL, offs_cpu.cuda())
    x_last = x[m - tail:].cpu()
    rd, rs, _ = reference.quantize_colwise_k_groups(x_last, torch.tensor([tail], dtype=torch.int32), ScaleMode.RCEIL)
    p0 = layouts.round_up(m - tail, BLOCK_SIZE)
    assert_bytes_equal(d[:, p0:p0 + layouts.round_up(tail, BLOCK_SIZE)], rd[:, : layouts.round_up(tail, BLOCK_SIZE)],
                       "last group data")
    rp = layouts.round_up(r, layouts.TILE_ROWS)
    s0 = layouts.ceil_div(m - tail, layouts.TILE_ROWS) * 4 * rp  # byte where group 1's scale tiles start
    n_bytes = layouts.ceil_div(tail, layouts.TILE_ROWS) * 4 * rp
    got = s.view(torch.uint8).reshape(-1)[s0:s0 + n_bytes]
    assert_bytes_equal(got, rs.view(torch.uint8).reshape(-1)[:n_bytes], "last group scales")
    assert p.cpu().tolist() == [p0, p0 + layouts.round_up(tail, BLOCK_SIZE)]


def test_argument_errors():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="offs"):
        ops.quantize_32x1_k_groups(x, ScaleMode.RCEIL, offs.cpu())
    with pytest.raises(ValueError, match="contiguous"):
        ops.quantize_32x1_k_groups(x.t(), ScaleMode.RCEIL, offs)
    with pytest.raises(ValueError, match="mode"):
        ops.quantize_32x1_k_groups(x, "garbage", offs)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize_3d_along_n(torch.randn(2, 48, 64, device="cuda", dtype=torch.bfloat16), "rceil")
    with pytest.raises(ValueError, match="contiguous"):
        ops.quantize_3d_along_n(torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2), "rceil")
    with pytest.raises(TypeError, match="out_dtype"):
        ops.fake_quantize_3d_along_n(torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16), "rceil",
                                     torch.float16)


# ----------------------------------------------------------------------------- fp32 weights read as bf16


def fp32_off_the_bf16_grid(shape, dist: str, seed: int) -> torch.Tensor:
    """fp32 values of ``dist`` with random low 16 bits: their bf16 rounding (RNE) differs from truncation and
    from the fp32 value itself, and some sit just past an e4m3 rounding tie or a power of two."""
    x = make_values(shape, dist, seed, torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    low = torch.randint(0, 1 << 16, x.shape, generator=g, dtype=torch.int32)
    return ((x.view(torch.int32) & ~0xFFFF) | low).view(torch.float32)


def check_3d_as_bf16(w_cpu: torch.Tensor, mode: ScaleMode):
    """Every 3D weight op with ``as_bf16`` on fp32 ``w`` equals the same op on ``w.to(bfloat16)`` (CUDA's cast,
    as the unconverted model casts its master weights) and the reference of that, byte for byte."""
    w = w_cpu.cuda()
    w16 = w.to(torch.bfloat16)
    w16_cpu = w16.cpu()
    for along, run_q, run_fake in (("n", ops.run_3d_along_n, ops.run_fake_3d_along_n),
                                   ("k", ops.run_3d_along_k, ops.run_fake_3d_along_k)):
        d, s = run_q(w, mode.value, True)
        rd, rs = reference.quantize_3d(w16_cpu, mode, along)
        assert_bytes_equal(d, rd, f"3d along {along} data (fp32 as bf16)")
        assert_bytes_equal(s, rs, f"3d along {along} scales (fp32 as bf16)")
        for out_dtype in (torch.bfloat16, torch.float32):
            got = run_fake(w, mode.value, out_dtype, True)
            assert_bytes_equal(got, run_fake(w16, mode.value, out_dtype), f"3d along {along} fake {out_dtype}")


@given(e=st.integers(1, 4), n=st.integers(1, 10).map(lambda v: 32 * v), k=st.integers(1, 10).map(lambda v: 32 * v),
       mode=modes, dist=dists, seed=seeds)
def test_3d_fp32_as_bf16(e, n, k, mode, dist, seed):
    check_3d_as_bf16(fp32_off_the_bf16_grid((e, n, k), dist, seed), mode)


def test_3d_fp32_as_bf16_rounds_before_quantizing():
    """Inputs where the rounding matters (so a kernel quantizing the fp32 values would fail the check above):
    values just above an e4m3 tie (1 + 1/16 + 2^-20: fp32 rounds up to 1.125, bf16 to the tie, which RNE takes
    down to 1), just below a power of two (bf16 rounds 2 - 2^-23 up to 2: the block's scale changes), fp32's
    largest value (bf16 Inf: a NaN block), fp32 subnormals below bf16's smallest, NaN."""
    w = fp32_off_the_bf16_grid((3, 256, 160), "normal", 11)
    w[0, :, 0] = 1 + 2**-4 + 2**-20
    w[0, :32, 1:32] = 0.5
    w[1, :, 0] = 2 - 2**-23
    w[1, 5, 40] = torch.finfo(torch.float32).max
    w[2, :, :32] = 2.0**-140
    w[2, 7, 70] = float("nan")
    for mode in ScaleMode:
        w16 = w.cuda().to(torch.bfloat16)
        for run_fake in (ops.run_fake_3d_along_k, ops.run_fake_3d_along_n):
            direct = run_fake(w.cuda(), mode.value, torch.bfloat16)  # the fp32 values themselves
            assert not torch.equal(as_bytes(direct), as_bytes(run_fake(w16, mode.value, torch.bfloat16)))
        check_3d_as_bf16(w, mode)
