"""GPU: the fingerprint kernel equals the reference exactly (any length, dtype and storage offset, 16-byte aligned
or not, grids of many CTAs, several launches per tensor, every A/B candidate), and the reuse scope fingerprints
its weights with the kernel, synchronizes once on exit and still raises on a write through ``.data``."""

import warnings

import pytest
import torch
from conftest import spy_on
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import backends, reuse_quantized_weights
from moe_quant import fingerprint as fp
from moe_quant.kernels.fingerprint import ops as ops_fingerprint
from moe_quant.kernels.fingerprint.config import Variant, candidate_variants

pytestmark = pytest.mark.gpu

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.float64]


@pytest.fixture(autouse=True)
def _needs_kernels():
    if not torch.cuda.is_available() or not backends.use_quant_kernels(torch.empty(0, device="cuda")):
        pytest.skip("needs an SM90+ GPU with cutlass-dsl")


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8, device="cuda")


def view_of(dtype, numel: int, offset: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at element ``offset`` of a fresh allocation that ends where the view ends."""
    size = torch.tensor([], dtype=dtype).element_size()
    return random_bytes((offset + numel) * size, seed).view(dtype)[offset:]


def check(t: torch.Tensor, **kw) -> int:
    """The kernel's fingerprint of ``t`` (CUDA) equals the reference's on the CPU; returns it."""
    got = ops_fingerprint.fingerprint_bytes(fp.as_bytes(t), **kw)
    assert got.device == t.device and got.dtype == torch.int64 and got.shape == ()
    want = int(fp.reference_fingerprint(t.cpu()))
    assert int(got) == want, (t.dtype, t.numel(), t.storage_offset(), t.data_ptr() % 16, kw)
    return want


@given(dtype=st.sampled_from(DTYPES), numel=st.one_of(st.integers(0, 40), st.integers(0, 20000)),
       offset=st.integers(0, 24), seed=st.integers(0, 2**31 - 1))
def test_matches_reference(dtype, numel, offset, seed):
    t = view_of(dtype, numel, offset, seed)
    want = check(t)
    assert int(fp.fingerprint(t)) == want  # the entry point takes the kernel here


@pytest.mark.parametrize("offset", [0, 1, 2, 4, 7, 8, 9, 12, 15])
@pytest.mark.parametrize("vectors", [0, 1, 2, 255, 256, 257, 1023, 1024, 1025, 4097])
def test_every_tail_length_at_every_alignment(offset, vectors):
    """``16 * vectors + r`` bytes for every tail ``r`` in [0, 16): the byte-wise tail, one or two words; the
    start 16-byte aligned, 8-byte aligned (one staged head word) or neither (all staged)."""
    for r in range(16):
        check(view_of(torch.uint8, 16 * vectors + r, offset, offset * 100 + r))


@pytest.mark.parametrize("n, offset", [(40 << 20, 0), ((40 << 20) + 13, 0), ((10 << 20) + 7, 8), ((10 << 20) + 9, 3)])
def test_grids_of_many_ctas_and_the_candidates(n, offset):
    """A persistent grid walking tens of tiles per CTA (1 CTA per SM), a full one (8 per SM) and more CTAs than fit
    at once (32 per SM), for every A/B candidate."""
    t = view_of(torch.uint8, n, offset, n)
    want = int(fp.reference_fingerprint(t.cpu()))
    for variant in (Variant(), *candidate_variants()):
        for ctas_per_sm in (1, 8, 32):
            got = int(ops_fingerprint.fingerprint_bytes(t, variant=variant, ctas_per_sm=ctas_per_sm))
            assert got == want, (variant, ctas_per_sm)


def test_large_tensor():
    """2**24 + 3 words (128 MiB and 24 bytes), in place and as a misaligned bf16 view (staged, several pieces)."""
    t = view_of(torch.int64, (1 << 24) + 3, 0, 7)
    check(t)
    check(t.view(torch.bfloat16)[1:-1])


@pytest.mark.parametrize("offset", [0, 3, 8, 16])
def test_several_launches_per_tensor(offset, monkeypatch):
    """Pieces of at most 4096 bytes (in place) or 1040 bytes (staged): every launch starts at its word number."""
    monkeypatch.setattr(ops_fingerprint, "MAX_LAUNCH_BYTES", 4096)
    monkeypatch.setattr(ops_fingerprint, "STAGE_BYTES", 1040)
    for n in (4095, 4096, 4097, 3 * 4096 + 5, 50000):
        b = view_of(torch.uint8, n, offset, n)
        assert len(ops_fingerprint.pieces(b.data_ptr(), n)) > 1 or (n <= 4096 and offset % 16 == 0)
        check(b)


def test_multi_dim_non_contiguous_and_empty_tensors():
    w = torch.randn(8, 96, 160, device="cuda", dtype=torch.bfloat16)
    for t in (w, w.transpose(-2, -1), w[:, 1:], w[3], w[:0], torch.randn((), device="cuda")):
        check(t)
    assert int(ops_fingerprint.fingerprint_bytes(torch.empty(0, dtype=torch.uint8, device="cuda"))) == 0


def test_the_input_is_not_written_and_the_reference_runs_on_cuda():
    t = view_of(torch.uint8, 3_000_001, 5, 11)
    before = t.clone()
    want = check(t)
    assert torch.equal(t, before)
    assert int(fp.reference_fingerprint(t)) == want  # the reference on the GPU: the same integers


def test_one_flipped_bit_in_a_dsv3_expert_weight_changes_it():
    w = torch.randn(8, 2048, 7168, device="cuda", dtype=torch.bfloat16)
    before = int(fp.fingerprint(w))
    w.view(torch.int16).view(-1)[12_345_677] ^= 1 << 9
    assert int(fp.fingerprint(w)) != before


def _model():
    from test_reuse import micro_batches, model

    return model().cuda(), [x.cuda() for x in micro_batches(2)]


def test_reuse_scope_fingerprints_with_the_kernel_and_syncs_once_on_exit(monkeypatch):
    kernel_calls = spy_on(monkeypatch, ops_fingerprint, "fingerprint_bytes")
    reference_calls = spy_on(monkeypatch, fp, "reference_words_sum")
    m, xs = _model()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with reuse_quantized_weights(m, hold="fp8") as scope:  # both operands held: the dgrad ones served too
                for x in xs:
                    m(x).float().sum().backward()
                sources = len(scope.served)
                torch.cuda.synchronize()
                caught.clear()
                torch.cuda.set_sync_debug_mode("warn")  # counts the synchronizations of the exit check
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # one warning per synchronizing call ("called a synchronizing CUDA operation"); torch 2.11 also warns once that
    # the mode is a prototype, which is not a synchronization
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    # the second micro-batch's fwd and dgrad operands of w1, w3, w2 in two layers: the dgrad ones on the
    # autograd engine's device thread, served through the scopes its forward kept
    assert sources == 6 and scope.hits == 12
    assert len(kernel_calls) == 2 * sources and not reference_calls  # first use and exit, kernel only
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("write", ["data_mul", "one_bit"])
def test_reuse_scope_on_cuda_raises_on_a_write_through_data(write):
    m, xs = _model()
    w = m.layers[0].moe.experts.w1
    with pytest.raises(RuntimeError, match="1 weight\\(s\\) it served changed inside the scope"):
        with reuse_quantized_weights(m):
            m(xs[0]).float().sum().backward()
            with torch.no_grad():
                if write == "data_mul":
                    w.data.mul_(2)
                else:
                    w.data.view(torch.int16).view(-1)[-1] ^= 1  # the lowest bit of the last element
            m(xs[1]).float().sum().backward()
