"""CuTe-DSL rowwise 1x32 MXFP8 kernel vs the pure-PyTorch reference, byte for byte (CUDA only).

The reference runs on the CPU (its NaN bytes are the canonical 0x7F / 0x7FC0 / 0x7FC00000
there); every output buffer is filled with 0xFF bytes before the launch, so a byte the
kernel does not write shows up as a mismatch (scale padding included).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mx_strategies import DISTRIBUTIONS, group_sizes, offsets_from_sizes
from mx_strategies import make_values as _make_values

from moe_quant import layouts, reference
from moe_quant.kernels import compile_cache, ops
from moe_quant.numerics import ScaleMode

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(compile_cache, "POISON_OUTPUTS", True)
    yield


def make_values(shape, dist, seed, dtype):
    if torch.Size(shape).numel() == 0:  # (the shared helper's injections need elements)
        return torch.zeros(shape, dtype=dtype)
    return _make_values(shape, dist, seed, dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str):
    g, w = as_bytes(got).reshape(-1), as_bytes(want).reshape(-1)
    assert g.shape == w.shape, f"{what}: {g.shape} vs {w.shape}"
    bad = (g != w).nonzero().flatten()
    if bad.numel():
        i = bad[:8].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} bytes differ; first at {i}: got {g[i].tolist()} want {w[i].tolist()}")


def check_quantize(x_cpu: torch.Tensor, mode: ScaleMode, offs_cpu, layout: str):
    x = x_cpu.cuda()
    offs = None if offs_cpu is None else offs_cpu.cuda()
    data, scales = ops.quantize_1x32(x, mode, offs, scale_layout=layout)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    ref_data, ref_scales = reference.quantize_rowwise(x_cpu, mode, offs_cpu)
    if offs_cpu is None and layout == "blocked":
        ref_scales = layouts.to_blocked(ref_scales)
    assert tuple(scales.shape) == tuple(ref_scales.shape)
    assert_bytes_equal(data, ref_data, "data")
    assert_bytes_equal(scales, ref_scales, "scales")


def check_fake(x_cpu: torch.Tensor, mode: ScaleMode, out_dtype):
    out = ops.fake_quantize_1x32(x_cpu.cuda(), mode, out_dtype)
    assert out.dtype == out_dtype and out.shape == x_cpu.shape
    assert_bytes_equal(out, reference.fake_quantize_rowwise(x_cpu, mode, out_dtype), "fake")


dims_m = st.one_of(st.sampled_from([0, 1, 2, 31, 32, 33, 127, 128, 129, 255, 257]), st.integers(0, 700))
dims_k = st.one_of(st.sampled_from([32, 64, 96, 128, 160, 224, 256, 544, 2048]), st.integers(1, 40).map(lambda n: 32 * n))
modes = st.sampled_from(list(ScaleMode))
dtypes = st.sampled_from([torch.bfloat16, torch.float32])
dists = st.sampled_from(DISTRIBUTIONS)


@given(m=dims_m, k=dims_k, mode=modes, dtype=dtypes, dist=dists, seed=st.integers(0, 2**31 - 1),
       layout=st.sampled_from(["blocked", "plain"]))
def test_quantize_no_groups(m, k, mode, dtype, dist, seed, layout):
    check_quantize(make_values((m, k), dist, seed, dtype), mode, None, layout)


@given(groups=group_sizes(max_groups=8, max_size=300), k=dims_k, mode=modes, dtype=dtypes, dist=dists,
       seed=st.integers(0, 2**31 - 1))
def test_quantize_m_groups(groups, k, mode, dtype, dist, seed):
    sizes, tail = groups
    m = sum(sizes) + tail
    check_quantize(make_values((m, k), dist, seed, dtype), mode, offsets_from_sizes(sizes), "blocked")


@given(m=st.integers(0, 400), g=st.integers(0, 10), k=dims_k, mode=modes, seed=st.integers(0, 2**31 - 1))
def test_quantize_adversarial_offsets(m, g, k, mode, seed):
    """Offsets past M, negative, decreasing: sanitized exactly as layouts.group_bounds does."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.randint(-64, m + 300, (g,), generator=gen, dtype=torch.int32)
    check_quantize(make_values((m, k), "normal", seed, torch.bfloat16), mode, offs, "blocked")


@given(m=dims_m, k=dims_k, mode=modes, dtype=dtypes, dist=dists, seed=st.integers(0, 2**31 - 1),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_fake_quantize(m, k, mode, dtype, dist, seed, out_dtype):
    check_fake(make_values((m, k), dist, seed, dtype), mode, out_dtype)


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize(
    "sizes,k",
    [
        ([0, 1, 31, 33, 127, 129, 0, 300], 2048),  # special sizes, boundaries inside CTA tiles
        ([4000, 0, 5, 4191], 7168),  # large; K % 1024 != 0
        ([1] * 300 + [0] * 50 + [77] * 40, 160),  # G = 390 > one table pass (256)
        ([0, 0, 0], 96),  # only empty groups: the whole buffer is padding
        ([], 64),  # G = 0
    ],
)
def test_quantize_m_groups_fixed(sizes, k, mode):
    m = sum(sizes) + 17
    x = make_values((m, k), "normal", 1234, torch.bfloat16)
    check_quantize(x, mode, offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32), "blocked")


def test_empty_inputs():
    for m, k in [(0, 64), (5, 0), (0, 0)]:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        check_quantize(x, ScaleMode.RCEIL, offsets_from_sizes([0, 0]), "blocked")
        check_quantize(x, ScaleMode.RCEIL, None, "blocked")
        check_quantize(x, ScaleMode.FLOOR, None, "plain")
        check_fake(x, ScaleMode.RCEIL, torch.bfloat16)


def test_specials_bitwise():
    """Largest finite input, bf16 subnormals, zeros, NaN/Inf blocks, RCEIL/FLOOR scale bytes."""
    x = torch.zeros(4, 128, dtype=torch.float32)
    x[0, :32] = torch.finfo(torch.float32).max
    x[1, :32] = 2.0**-133  # smallest bf16 subnormal
    x[2, 32] = float("nan")
    x[3, 64] = -float("inf")
    x[3, 96:] = -(2.0**-149)
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ScaleMode:
            check_quantize(x.to(dtype), mode, None, "plain")
            check_fake(x.to(dtype), mode, torch.bfloat16)
    d, s = ops.quantize_1x32(x.cuda(), ScaleMode.RCEIL, None, "plain")
    assert as_bytes(s)[0, 0] == 247 and as_bytes(s)[2, 1] == 255 and as_bytes(s)[0, 1] == 0
    d, s = ops.quantize_1x32(x.cuda(), ScaleMode.FLOOR, None, "plain")
    assert as_bytes(s)[0, 0] == 246
    d, s = ops.quantize_1x32(x[1:2].to(torch.bfloat16).cuda(), ScaleMode.RCEIL, None, "plain")
    assert as_bytes(d)[0, 0] == 0x08


def test_quantize_offs_device_scalar_types_and_noncontiguous_errors():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offs"):
        ops.quantize_1x32(x, ScaleMode.RCEIL, torch.tensor([64], dtype=torch.int32))  # on the CPU
    with pytest.raises(ValueError, match="contiguous"):
        ops.quantize_1x32(x.t(), ScaleMode.RCEIL)
    with pytest.raises(TypeError, match="offs"):
        ops.quantize_1x32(x, ScaleMode.RCEIL, torch.tensor([64], device="cuda"))


def test_torch_compile_fullgraph():
    x = make_values((300, 224), "normal", 7, torch.bfloat16).cuda()
    offs = offsets_from_sizes([100, 0, 129, 71], "cuda")

    def f(x, offs):
        d, s = ops.quantize_1x32(x, ScaleMode.RCEIL, offs)
        return d, s, ops.fake_quantize_1x32(x, ScaleMode.FLOOR)

    cf = torch.compile(f, fullgraph=True)
    got = cf(x, offs)
    want = f(x, offs)
    for a, b, what in zip(got, want, ("data", "scales", "fake")):
        assert_bytes_equal(a, b, what)
    # a new M reuses the graph's op (dynamic or recompiled) and stays exact
    x2 = make_values((513, 224), "wide", 8, torch.bfloat16).cuda()
    offs2 = offsets_from_sizes([13, 500], "cuda")
    for a, b, what in zip(cf(x2, offs2), f(x2, offs2), ("data", "scales", "fake")):
        assert_bytes_equal(a, b, what)


def test_unaligned_input_storage():
    xg = torch.randn(64 * 96 + 3, dtype=torch.bfloat16, device="cuda")[3:].view(64, 96)  # 6-byte offset
    assert xg.data_ptr() % 16 != 0
    d, s = ops.quantize_1x32(xg, ScaleMode.RCEIL, None, "plain")
    rd, rs = reference.quantize_rowwise(xg.cpu(), ScaleMode.RCEIL)
    assert_bytes_equal(d, rd, "data")
    assert_bytes_equal(s, rs, "scales")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_tensor_of_another_device_launches_there_on_its_current_stream():
    """The launch path runs no device guard (``compile_cache.launch``): the compiled function switches to its
    tensors' device for the launch (and back), and TVM-FFI launches on that device's current stream. ``x`` is
    written on a side stream of device 1 after a long sleep there, and the op is called with device 0 current: a
    launch on device 0, or on device 1's default stream, would read ``x`` unwritten."""
    x_cpu = make_values((512, 256), "normal", 7, torch.bfloat16)
    offs_cpu = offsets_from_sizes([200, 312])
    dev1 = torch.device("cuda", 1)
    src, offs = x_cpu.to(dev1), offs_cpu.to(dev1)
    side = torch.cuda.Stream(dev1)
    side.wait_stream(torch.cuda.current_stream(dev1))
    torch.cuda.set_device(0)
    with torch.cuda.stream(side):  # device 1 current here, its current stream the side one
        x = torch.zeros_like(src)
        torch.cuda._sleep(100_000_000)  # tens of ms of the side stream
        x.copy_(src)
        torch.cuda.set_device(0)
        data, scales = ops.quantize_1x32(x, ScaleMode.RCEIL, offs)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(dev1) == side
    torch.cuda.synchronize(dev1)
    assert data.device == scales.device == dev1
    rd, rs = reference.quantize_rowwise(x_cpu, ScaleMode.RCEIL, offs_cpu)
    assert_bytes_equal(data, rd, "data")
    assert_bytes_equal(scales, rs, "scales")


def test_path_without_tvm_ffi(monkeypatch):
    """The fallback call path (cute.runtime.from_dlpack + explicit stream) gives the same bytes."""
    monkeypatch.setenv("MOE_QUANT_NO_TVM_FFI", "1")
    from moe_quant.kernels.quantize_1x32.config import Variant

    kern = compile_cache.build(Variant("bfloat16", "rceil", "mgroups"), compile_cache.arch(torch.device("cuda")))
    assert not kern.tvm
    x_cpu = make_values((333, 160), "wide", 3, torch.bfloat16)
    offs_cpu = offsets_from_sizes([0, 129, 31, 150])
    x, offs = x_cpu.cuda(), offs_cpu.cuda()
    data = torch.full((333, 160), 0xFF, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scales = torch.full(layouts.m_groups_blocked_shape(333, 5, 4), 0xFF, dtype=torch.uint8, device="cuda")
    kern(x, data, scales, offs)
    rd, rs = reference.quantize_rowwise(x_cpu, ScaleMode.RCEIL, offs_cpu)
    assert_bytes_equal(data, rd, "data")
    assert_bytes_equal(scales, rs, "scales")


def test_second_process_loads_from_disk_cache(tmp_path):
    """A second process finds the exported kernel on disk: no compile, same bytes."""
    if not compile_cache.tvm_ffi_available():
        pytest.skip("the on-disk cache needs apache-tvm-ffi")
    code = textwrap.dedent(
        """
        import sys, time, torch
        t0 = time.perf_counter()
        from moe_quant.kernels import ops
        torch.manual_seed(0); x = torch.randn(1000, 256, device="cuda").bfloat16()
        offs = torch.tensor([100, 600, 1000], dtype=torch.int32, device="cuda")
        t1 = time.perf_counter()
        d, s = ops.quantize_1x32(x, "rceil", offs)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print("RESULT", ops.STATS["compiled"], ops.STATS["disk_hits"], round(t2 - t1, 4),
              int(d.view(torch.uint8).sum()), int(s.view(torch.uint8).sum()))
        """
    )
    env = dict(os.environ, MOE_QUANT_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][0].split()
        runs.append(line)
    assert runs[0][1:3] == ["1", "0"], runs  # first process compiles
    assert runs[1][1:3] == ["0", "1"], runs  # second loads from disk
    assert runs[0][4:] == runs[1][4:]
    print("first-call seconds: compile", runs[0][3], "disk", runs[1][3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_edges_every_exponent(dtype):
    """amax bit patterns over every exponent and the mantissas that decide RCEIL/FLOOR rounding,
    including the subnormal-descale boundary (amax / 448 around 2**-127)."""
    exps = torch.arange(0, 255, dtype=torch.int64)
    mants = torch.tensor([0, 1, 0x1000, 0x400000, 0x400001, 0x7FFFFF, 0x7F0000, 0x10000], dtype=torch.int64)
    bits = ((exps[:, None] << 23) | mants[None, :]).reshape(-1)
    # amax whose fp32(amax * (1/448)) lands on both sides of 2**-127 and 2**-126
    near = torch.tensor([2.0**-127 * 448, 2.0**-126 * 448, 2.0**-118, 2.0**-119], dtype=torch.float64)
    extra = torch.cat([near.float().view(torch.int32).to(torch.int64) + d for d in range(-3, 4)])
    bits = torch.cat([bits, extra])
    amax = bits.to(torch.int32).view(torch.float32)
    x = torch.zeros(amax.numel(), 64, dtype=torch.float32)
    x[:, 5] = amax
    x[:, 6] = -amax / 3
    x[:, 40] = amax * 0.75
    x = x.to(dtype)  # bf16 rounds the patterns: still a sweep
    for mode in ScaleMode:
        check_quantize(x, mode, None, "plain")
        check_fake(x, mode, torch.bfloat16)
