"""GPU: the received-rows permutation kernel byte-exact against the reference, outputs poisoned first; the
default and every A/B candidate (``config_permute.CANDIDATES``: gather, scatter and rows orders, register and
shared-memory staging, several tiles per CTA, the dequant pair stores), each for every output kind (bf16 and fp32
dequant)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import backends, to_mxfp8
from moe_quant.ep.permute import OUT_KINDS, reference_permute_received
from moe_quant.kernels import compile_cache
from moe_quant.kernels.permute import config as config_permute
from moe_quant.kernels.permute import ops as ops_permute
from tests.mx_strategies import DISTRIBUTIONS, make_values, received_counts, to_bytes

pytestmark = pytest.mark.gpu

CANDIDATES = list(config_permute.CANDIDATES)  # the first is the default (no fields changed)


def candidate(name: str):
    """Every output kind's op launches A/B candidate ``name`` in place of its default variant."""
    dev = torch.device("cuda", torch.cuda.current_device())
    return ops_permute.variants_in_place(dev, **config_permute.CANDIDATES[name])


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    if not torch.cuda.is_available() or not backends.use_quant_kernels(torch.empty(0, device="cuda")):
        pytest.skip("needs an SM90+ GPU with cutlass-dsl")
    monkeypatch.setattr(compile_cache, "POISON_OUTPUTS", True)


def check(counts, m, k, seed, dist="normal", raw_bytes=False):
    assert k % 32 == 0
    if raw_bytes:  # any fp8 / e8m0 bytes at all (NaN data under finite scales, scale 255, ...)
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = torch.randint(0, 256, (m, k // 32), generator=g, dtype=torch.uint8)
    else:
        data, scales = to_mxfp8(make_values((m, k), dist, seed))
    c = torch.tensor(counts, dtype=torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32).reshape(len(counts), -1)
    assert ops_permute.serves(c)
    for out in OUT_KINDS:
        for out_dtype in ((torch.bfloat16, torch.float32) if out == "dequant" else (torch.bfloat16,)):
            want = reference_permute_received(data, scales, c, out=out, out_dtype=out_dtype)
            got = ops_permute.permute_mxfp8(data.cuda(), scales.cuda(), c.cuda(), out, out_dtype)
            assert len(got) == len(want)
            for i, (g_, w_) in enumerate(zip(got, want)):
                assert g_.shape == w_.shape and g_.dtype == w_.dtype, (out, i)
                assert torch.equal(to_bytes(g_.cpu()), to_bytes(w_)), (out, out_dtype, i, counts, m, k)


@pytest.mark.parametrize("cand", CANDIDATES)
@given(rc=received_counts(max_ranks=8, max_experts=9), k=st.sampled_from([32, 64, 96, 160, 512]),
       dist=st.sampled_from(DISTRIBUTIONS), seed=st.integers(0, 2**31 - 1), raw=st.booleans())
def test_matches_reference(cand, rc, k, dist, seed, raw):
    counts, m = rc
    if not counts:
        counts = [[]]
    with candidate(cand):
        check(counts, m, k, seed, dist, raw_bytes=raw)


@pytest.mark.parametrize("cand", CANDIDATES)
@given(r=st.integers(1, 32), e=st.integers(1, 32), m=st.integers(1, 3000), k=st.sampled_from([32, 224, 1056, 4128]),
       seed=st.integers(0, 2**31 - 1), zeros=st.floats(0, 1), bad=st.booleans())
def test_many_blocks_and_garbage_counts(cand, r, e, m, k, seed, zeros, bad):
    """Up to 1024 blocks (the table's limit), a share of them empty; with ``bad``, negative, huge and
    overflowing counts and totals past M. Many rows per CTA and many CTAs per block."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max(2, 3 * m // (r * e)), (r, e), generator=g)
    counts[torch.rand(r, e, generator=g) < zeros] = 0
    if bad:
        pick = torch.randint(0, 5, (r, e), generator=g)
        counts[pick == 1] = -7
        counts[pick == 2] = 2**31 - 1
        counts[pick == 3] = -(2**31)
    with candidate(cand):
        check(counts.tolist(), m, k, seed, raw_bytes=True)


@pytest.mark.parametrize("cand", CANDIDATES)
@pytest.mark.parametrize("r,e,m,k", [(1, 1, 1, 32), (8, 32, 20000, 2048), (64, 16, 5000, 224), (32, 32, 3000, 7168),
                                     (8, 8, 40000, 96), (2, 3, 300, 32)])
def test_large_and_many_blocks(cand, r, e, m, k):
    g = torch.Generator().manual_seed(r * e)
    counts = torch.randint(0, max(1, 2 * m // (r * e)), (r, e), generator=g)
    counts[0] = 0  # a rank that sends nothing
    counts[:, -1] = 0  # an empty expert
    with candidate(cand):
        check(counts.tolist(), m, k, 7)


@pytest.mark.parametrize("cand", CANDIDATES)
def test_bad_counts_and_empty(cand):
    with candidate(cand):
        check([[-5, 2**31 - 1], [3, 3]], 100, 64, 1)  # negative, overflowing, total past M
        check([[0, 0, 0]], 0, 64, 2)  # M = 0: no launch, offs all zero, blocked buffer zero
        check([[4, 4]], 8, 0, 3)  # K = 0
        check([[]], 50, 64, 4)  # E = 0: every row is past the total
        check([[0, 0], [0, 0]], 70, 64, 5)  # no rows at all: every output row zero
        check([[1000]], 1, 32, 6)  # one row, count past M


def test_past_table_falls_back_to_reference():
    from moe_quant.ep import permute_received
    from moe_quant.kernels.permute.config import MAX_BLOCKS

    c = torch.ones(MAX_BLOCKS + 1, 1, dtype=torch.int32)
    assert not ops_permute.serves(c)
    data, scales = to_mxfp8(make_values((MAX_BLOCKS + 1, 64), "normal", 5))
    got = permute_received(data.cuda(), scales.cuda(), c.cuda(), out="plain")
    want = reference_permute_received(data, scales, c, out="plain")
    assert all(torch.equal(to_bytes(a.cpu()), to_bytes(b)) for a, b in zip(got, want))


def test_no_host_sync():
    data, scales = to_mxfp8(make_values((4096, 512), "normal", 9))
    data, scales = data.cuda(), scales.cuda()
    c = torch.full((4, 8), 100, dtype=torch.int32, device="cuda")
    ops_permute.permute_mxfp8(data, scales, c, "blocked")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for out in OUT_KINDS:
            ops_permute.permute_mxfp8(data, scales, c, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compiles_in_graph():
    data, scales = to_mxfp8(make_values((300, 64), "normal", 11))
    c = torch.tensor([[100, 50], [0, 120]], dtype=torch.int32)
    fn = torch.compile(lambda d, s, c: ops_permute.permute_mxfp8(d, s, c, "dequant"), fullgraph=True)
    got = fn(data.cuda(), scales.cuda(), c.cuda())
    want = reference_permute_received(data, scales, c, out="dequant")
    assert all(torch.equal(to_bytes(a.cpu()), to_bytes(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("m, k", [(1, 32), (257, 64), (4096, 7168), (0, 64)])
@pytest.mark.parametrize("raw", [False, True])
def test_dequantize_rows_is_dequantize_blocks(m, k, raw):
    """``ep.permute.dequantize_rows`` (the permute kernel with one block: how the EP legs dequantize received
    rows in one pass) writes exactly the bytes of ``numerics.dequantize_blocks``, NaN bytes included, on
    rows that start anywhere in a receive buffer (a misaligned scales slice)."""
    from moe_quant.ep.permute import dequantize_rows
    from moe_quant.numerics import dequantize_blocks

    g = torch.Generator().manual_seed(m + k)
    if raw:
        data = torch.randint(0, 256, (m + 3, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = torch.randint(0, 256, (m + 3, k // 32), generator=g, dtype=torch.uint8)
    else:
        data, scales = to_mxfp8(make_values((m + 3, k), "normal", m))
    data, scales = data.cuda()[3:], scales.view(torch.uint8).cuda()[3:]  # rows from the middle of a buffer
    got = dequantize_rows(data, scales, torch.bfloat16)
    want = dequantize_blocks(data, scales, torch.bfloat16)
    assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
