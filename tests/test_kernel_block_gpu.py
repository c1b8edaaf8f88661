"""CuTe-DSL kernels of the SwiGLU expert block (``dual``, ``swiglu``, ``dswiglu``) vs the reference, byte for
byte (CUDA only), and the block end to end on the GPU.

The reference: PyTorch's own SwiGLU on the GPU (``F.silu(a) * b`` and its autograd formulas, i.e. PyTorch's
CUDA kernels), then the per-GEMM reference quantizers on the CPU. Every output buffer is filled with 0xFF
bytes before the launch, so a byte the kernel does not write (group padding, tails, scale padding) shows
up as a mismatch.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import DISTRIBUTIONS, group_sizes, make_values, offsets_from_sizes

from moe_quant import block_quantize as bq
from moe_quant import layouts, mxfp8_swiglu_experts, reference, swiglu_experts_unfused
from moe_quant.kernels import compile_cache
from moe_quant.kernels.block import config as config_block
from moe_quant.kernels.block import ops as ops_block
from moe_quant.numerics import ScaleMode

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(compile_cache, "POISON_OUTPUTS", True)
    yield


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str):
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} vs {want.dtype}"
    g = got.contiguous().view(torch.uint8).cpu().reshape(-1)
    w = want.contiguous().view(torch.uint8).cpu().reshape(-1)
    bad = (g != w).nonzero().flatten()
    if bad.numel():
        i = bad[:8].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} bytes differ; first at {i}: "
                             f"got {g[i].tolist()} want {w[i].tolist()}")


def reference_forms(t_gpu: torch.Tensor, offs_cpu: torch.Tensor, mode: ScaleMode, fake: bool, cols_fp8: bool = False):
    """Both forms of a tensor by the CPU reference quantizers (offsets sanitized as the kernel does); ``cols_fp8``
    (with ``fake``): the colwise form as ``block_quantize.colwise_kept`` makes it (fp8 data, plain scales)."""
    offs = layouts.sanitize_offsets(offs_cpu, t_gpu.shape[0]).to(torch.int32)
    return bq._separate_forms(t_gpu.cpu(), mode, offs, fake, cols_fp8)


def check_forms(got, want, what: str):
    (g_row, g_col), (w_row, w_col) = got, want
    names = ("data", "scales") if len(w_row) == 2 else ("values",)
    for n, a, b in zip(names, g_row, w_row):
        assert_bytes_equal(a, b, f"{what} rowwise {n}")
    names = ("data_t", "scales", "padded offs") if len(w_col) == 3 else ("values_t", "padded offs")
    for n, a, b in zip(names, g_col, w_col):
        assert_bytes_equal(a, b, f"{what} colwise {n}")


def kernel_forms(outs, fake):
    return bq._kernel_forms(outs, fake)


dims_r = st.one_of(st.sampled_from([32, 64, 96, 128, 160, 224, 256, 544]), st.integers(1, 24).map(lambda n: 32 * n))
settings_common = dict(
    groups=group_sizes(max_groups=6, max_size=300),
    r=dims_r,
    dist=st.sampled_from(DISTRIBUTIONS),
    mode=st.sampled_from(list(ScaleMode)),
    fake=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    bad_offs=st.sampled_from([None, "negative", "past_m", "decreasing"]),
)


def make_offs(sizes, tail, bad):
    offs = offsets_from_sizes(sizes)
    m = sum(sizes) + tail
    if bad == "negative" and offs.numel():
        offs[0] = -5
    elif bad == "past_m" and offs.numel():
        offs[-1] = m + 77
    elif bad == "decreasing" and offs.numel() > 1:
        offs[0] = offs[-1] + 3
    return offs, m


def inputs(n, m, r, dist, seed):
    return [make_values((m, r), dist, seed + i).cuda() for i in range(n)]


@given(**settings_common)
def test_dual(groups, r, dist, mode, fake, seed, bad_offs):
    offs, m = make_offs(*groups, bad_offs)
    (x,) = inputs(1, m, r, dist, seed)
    got = kernel_forms(ops_block.block_dual(x, mode, offs.cuda(), fake), fake)[0]
    check_forms(got, reference_forms(x, offs, mode, fake), "dual")


@given(**settings_common)
def test_swiglu(groups, r, dist, mode, fake, seed, bad_offs):
    offs, m = make_offs(*groups, bad_offs)
    a, b = inputs(2, m, r, dist, seed)
    got = kernel_forms(ops_block.block_swiglu(a, b, mode, offs.cuda(), fake), fake)[0]
    check_forms(got, reference_forms(reference.swiglu(a, b), offs, mode, fake), "swiglu")


@given(**settings_common)
def test_dswiglu(groups, r, dist, mode, fake, seed, bad_offs):
    offs, m = make_offs(*groups, bad_offs)
    g, a, b = inputs(3, m, r, dist, seed)
    got_a, got_b = kernel_forms(ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), fake), fake)
    grad_a, grad_b = reference.dswiglu(g, a, b)
    check_forms(got_a, reference_forms(grad_a, offs, mode, fake), "dswiglu grad_a")
    check_forms(got_b, reference_forms(grad_b, offs, mode, fake), "dswiglu grad_b")


def check_stacked(outs, g, a, b, offs, mode, what):
    """``block_dswiglu(..., stacked=True)``: both forms of ``[grad_a | grad_b]``, every byte (the buffers are
    poisoned): the rowwise values ``(M, 2R)``, grad_a's in columns ``[:R]`` and grad_b's in ``[R:]`` (rows past
    the last group's end zero in both halves), and the colwise values ``(2R, Mp)`` (the two colwise forms
    stacked along rows), each against the reference forms concatenated."""
    assert len(outs) == 3, f"{what}: {len(outs)} outputs"
    row, col, poffs = outs
    grad_a, grad_b = reference.dswiglu(g, a, b)
    (ra,), (ca, pa) = reference_forms(grad_a, offs, mode, True)
    (rb,), (cb, _) = reference_forms(grad_b, offs, mode, True)
    assert_bytes_equal(row, torch.cat([ra, rb], dim=1), f"{what} stacked rowwise")
    assert_bytes_equal(col, torch.cat([ca, cb]), f"{what} stacked colwise")
    assert_bytes_equal(poffs, pa, f"{what} padded offs")


@given(**{k: v for k, v in settings_common.items() if k != "fake"})
def test_dswiglu_stacked(groups, r, dist, mode, seed, bad_offs):
    offs, m = make_offs(*groups, bad_offs)
    g, a, b = inputs(3, m, r, dist, seed)
    outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=True)
    check_stacked(outs, g, a, b, offs, mode, "dswiglu stacked")


@pytest.mark.parametrize("m,r,sizes", [(0, 64, [0, 0]), (5, 64, []), (300, 32, [0, 0, 0]), (1, 32, [1]),
                                       (0, 32, []), (7, 0, [3])])
def test_dswiglu_stacked_degenerate_shapes(m, r, sizes):
    """M = 0, R = 0, G = 0 (the zero-fill path: every byte of both outputs from the shapes), all groups empty
    (the kernel's tail CTAs zero every row of the (M, 2R) rowwise buffer)."""
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    g, a, b = inputs(3, m, r, "normal", 0)
    outs = ops_block.block_dswiglu(g, a, b, ScaleMode.RCEIL, offs.cuda(), True, stacked=True)
    check_stacked(outs, g, a, b, offs, ScaleMode.RCEIL, f"stacked M={m} R={r} G={len(sizes)}")


@pytest.mark.parametrize("m,r,offs_list", [
    (1000, 96, [3, 3, 63]),  # 937 rows past the end: several tail chunks, both halves
    (700, 544, [129]),  # R % 128 != 0, ragged tail tile
    (300, 160, [100, 700, 50, -5, 10**6, 299]),  # offsets past M, decreasing, negative
    (260, 32, [257, 256]),  # decreasing, 3 rows past the end
])
def test_dswiglu_stacked_long_tails_and_bad_offsets(m, r, offs_list):
    """The tail CTAs zero the rows past the last group's end of the (M, 2R) rowwise buffer (grad_a's half and
    grad_b's half, split between the two outputs' tail CTAs), and nothing outside it, whatever offs holds."""
    offs = torch.tensor(offs_list, dtype=torch.int32)
    for mode in ScaleMode:
        g, a, b = inputs(3, m, r, "wide", m + r)
        outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=True)
        check_stacked(outs, g, a, b, offs, mode, f"stacked M={m} R={r} offs={offs_list}")


def check_cols_fp8(outs, g, a, b, offs, mode, stacked, what):
    """``block_dswiglu(..., True, stacked=stacked, cols_fp8=True)`` (the ``cols_fp8`` variants), every byte (the
    buffers are poisoned): the rowwise forms the bf16 values of the reference (``(M, 2R)`` with ``stacked``), the
    colwise forms the fp8 data and plain K-groups scales ``(R, Mp/32)`` of the reference's 32x1 quantizer
    (``colwise_kept``'s form: every padded 32-token block of the data, the zeros past the last group included; data
    and scales stacked along rows with ``stacked``), and the padded offsets."""
    grad_a, grad_b = reference.dswiglu(g, a, b)
    rows = [reference_forms(t, offs, mode, True)[0][0] for t in (grad_a, grad_b)]
    # (data_t, plain scales, poffs)
    cols = [reference_forms(t, offs, mode, True, cols_fp8=True)[1] for t in (grad_a, grad_b)]
    if stacked:
        assert len(outs) == 4, f"{what}: {len(outs)} outputs"
        row, col, scales, poffs = outs
        assert_bytes_equal(row, torch.cat(rows, dim=1), f"{what} stacked rowwise")
        assert_bytes_equal(col, torch.cat([cols[0][0], cols[1][0]]), f"{what} stacked colwise data")
        assert_bytes_equal(scales, torch.cat([cols[0][1], cols[1][1]]), f"{what} stacked colwise plain scales")
    else:
        assert len(outs) == 7, f"{what}: {len(outs)} outputs"
        poffs = outs[-1]
        for o, name in enumerate(("grad_a", "grad_b")):
            assert_bytes_equal(outs[3 * o], rows[o], f"{what} {name} rowwise values")
            assert_bytes_equal(outs[3 * o + 1], cols[o][0], f"{what} {name} colwise data")
            assert_bytes_equal(outs[3 * o + 2], cols[o][1], f"{what} {name} colwise plain scales")
    assert_bytes_equal(poffs, cols[0][2], f"{what} padded offs")


@given(**{k: v for k, v in settings_common.items() if k != "fake"}, stacked=st.booleans())
def test_dswiglu_cols_fp8(groups, r, dist, mode, seed, bad_offs, stacked):
    offs, m = make_offs(*groups, bad_offs)
    g, a, b = inputs(3, m, r, dist, seed)
    outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=stacked, cols_fp8=True)
    check_cols_fp8(outs, g, a, b, offs, mode, stacked, "dswiglu cols_fp8")


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("m,r,offs_list", [
    (0, 64, [0, 0]), (5, 64, []), (300, 32, [0, 0, 0]), (1, 32, [1]),  # the zero-fill path, all groups empty
    (1000, 96, [3, 3, 63]),  # 937 rows past the end: several tail chunks
    (700, 544, [129]),  # R % 128 != 0, ragged tail tile
    (300, 160, [100, 700, 50, -5, 10**6, 299]),  # offsets past M, decreasing, negative
    (260, 32, [257, 256]),  # decreasing, 3 rows past the end
])
def test_dswiglu_cols_fp8_tails_degenerate_shapes_and_bad_offsets(stacked, m, r, offs_list):
    """The cols_fp8 variants' tail CTAs: the bf16 rowwise rows past the last group's end zeroed (both halves of the
    stacked buffer), the colwise data tail zeroed as the fp8 outputs' is and the plain scales' columns past the last
    group's padded end zero (written by the tail CTAs), no M-groups scales; M = 0, G = 0 and empty groups through the
    zero-fill path; whatever offs holds."""
    offs = torch.tensor(offs_list, dtype=torch.int32)
    for mode in ScaleMode:
        g, a, b = inputs(3, m, r, "wide", m + r)
        outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=stacked, cols_fp8=True)
        check_cols_fp8(outs, g, a, b, offs, mode, stacked, f"cols_fp8 M={m} R={r} offs={offs_list}")


def check_one_form(outs, want: tuple, forms: str, what: str):
    """``block_swiglu(..., forms=forms)``: the one form's buffers then ``poffs``, every byte (poisoned buffers), against
    the reference's ``(rowwise form, colwise form)`` ``want`` (the rowwise one without ``poffs``)."""
    w_row, w_col = want
    expect = (*w_row, w_col[-1]) if forms == "rows" else w_col
    assert len(outs) == len(expect), f"{what}: {len(outs)} outputs, want {len(expect)}"
    for i, (a, b) in enumerate(zip(outs, expect)):
        assert_bytes_equal(a, b, f"{what} {forms} output {i}")


@given(**settings_common, forms=st.sampled_from(["rows", "cols"]))
def test_swiglu_one_form(groups, r, dist, mode, fake, seed, bad_offs, forms):
    """The ``forms`` variants (the block's forward writes h's rowwise form alone, its backward the colwise one): the
    bytes of that form as the both-forms op writes them (tails, padding and scales included), no other buffer."""
    offs, m = make_offs(*groups, bad_offs)
    a, b = inputs(2, m, r, dist, seed)
    outs = ops_block.block_swiglu(a, b, mode, offs.cuda(), fake, forms=forms)
    check_one_form(outs, reference_forms(reference.swiglu(a, b), offs, mode, fake), forms, "swiglu")


@pytest.mark.parametrize("forms", ["rows", "cols"])
@pytest.mark.parametrize("m,r,offs_list", [
    (0, 64, [0, 0]), (5, 64, []), (300, 32, [0, 0, 0]), (1, 32, [1]),  # the zero-fill path, all groups empty
    (1000, 96, [3, 3, 63]),  # 937 rows past the end: several tail chunks
    (700, 544, [129]),  # R % 128 != 0, ragged tail tile (fp8: 4 column tiles a CTA, the last CTA's partly real)
    (300, 160, [100, 700, 50, -5, 10**6, 299]),  # offsets past M, decreasing, negative
])
def test_swiglu_one_form_tails_degenerate_shapes_and_bad_offsets(forms, m, r, offs_list):
    offs = torch.tensor(offs_list, dtype=torch.int32)
    for mode in ScaleMode:
        for fake in (False, True):
            a, b = inputs(2, m, r, "wide", m + r)
            outs = ops_block.block_swiglu(a, b, mode, offs.cuda(), fake, forms=forms)
            check_one_form(outs, reference_forms(reference.swiglu(a, b), offs, mode, fake), forms,
                           f"swiglu M={m} R={r} offs={offs_list} {mode} fake={fake}")


@given(**{k: v for k, v in settings_common.items() if k != "fake"})
def test_dual_cols_fp8(groups, r, dist, mode, seed, bad_offs):
    """dual's ``cols_fp8`` variants (the block's forward on the emulated GEMM: x's rowwise bf16 values and the colwise
    form it keeps, fp8 and plain scales, in one read): every byte against the 1x32 and ``colwise_kept`` references."""
    offs, m = make_offs(*groups, bad_offs)
    (x,) = inputs(1, m, r, dist, seed)
    row, col, scales, poffs = ops_block.block_dual(x, mode, offs.cuda(), True, cols_fp8=True)
    check_forms(((row,), (col, scales, poffs)), reference_forms(x, offs, mode, True, cols_fp8=True), "dual cols_fp8")


@pytest.mark.parametrize("m,r,offs_list", [
    (0, 64, [0, 0]), (5, 64, []), (300, 32, [0, 0, 0]), (1, 32, [1]), (1000, 96, [3, 3, 63]), (700, 544, [129]),
    (300, 160, [100, 700, 50, -5, 10**6, 299]), (260, 32, [257, 256]),
])
def test_dual_cols_fp8_tails_degenerate_shapes_and_bad_offsets(m, r, offs_list):
    offs = torch.tensor(offs_list, dtype=torch.int32)
    for mode in ScaleMode:
        (x,) = inputs(1, m, r, "wide", m + r)
        row, col, scales, poffs = ops_block.block_dual(x, mode, offs.cuda(), True, cols_fp8=True)
        check_forms(((row,), (col, scales, poffs)), reference_forms(x, offs, mode, True, cols_fp8=True),
                    f"dual cols_fp8 M={m} R={r} offs={offs_list} {mode}")


@given(groups=group_sizes(max_groups=5, max_size=200), r=dims_r, mode=st.sampled_from(list(ScaleMode)),
       fake=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rowwise_and_kept_equals_its_two_passes(groups, r, mode, fake, seed):
    """The block's forward forms of x in one read (``block_quantize.rowwise_and_kept``: dual, ``cols_fp8`` on the
    emulated GEMM) are the 1x32 pass's and ``colwise_kept``'s bytes (the rowwise form's rows past the last group's end
    are zeros, no GEMM reads them)."""
    sizes, tail = groups
    offs = offsets_from_sizes(sizes).cuda()
    (x,) = inputs(1, sum(sizes) + tail, r, "normal", seed)
    (got_row, got_kept), end = bq.rowwise_and_kept(x, mode, offs, fake), sum(sizes)
    want_row, want_kept = bq.rowwise(x, mode, offs, fake), bq.colwise_kept(x, mode, offs, fake)
    assert_bytes_equal(got_row[0][:end], want_row[0][:end], "rowwise data")
    for i in range(1, len(want_row)):  # the blocked scales
        assert_bytes_equal(got_row[i], want_row[i], "rowwise scales")
    assert len(got_kept) == len(want_kept)
    for i, (a, b) in enumerate(zip(got_kept, want_kept)):
        assert_bytes_equal(a, b, f"kept colwise form {i}")


@pytest.mark.parametrize("op", ["dual", "swiglu", "dswiglu"])
@pytest.mark.parametrize("m,r,sizes", [(0, 64, [0, 0]), (5, 64, []), (300, 32, [0, 0, 0]), (1, 32, [1])])
def test_degenerate_shapes(op, m, r, sizes):
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    xs = inputs({"dual": 1, "swiglu": 2, "dswiglu": 3}[op], m, r, "normal", 0)
    for fake in (False, True):
        outs = getattr(ops_block, f"block_{op}")(*xs, ScaleMode.RCEIL, offs.cuda(), fake)
        if op == "dual":
            refs = [reference_forms(xs[0], offs, ScaleMode.RCEIL, fake)]
        elif op == "swiglu":
            refs = [reference_forms(reference.swiglu(*xs), offs, ScaleMode.RCEIL, fake)]
        else:
            refs = [reference_forms(t, offs, ScaleMode.RCEIL, fake) for t in reference.dswiglu(*xs)]
        for got, want in zip(kernel_forms(outs, fake), refs):
            check_forms(got, want, f"{op} M={m} G={len(sizes)}")


_SWIGLU_CANDIDATES = list(dict.fromkeys(name for op in config_block.SWIGLU_OPS
                                        for name in config_block.candidates_any_output(op)))  # "default" first


@pytest.mark.parametrize("cand", _SWIGLU_CANDIDATES)
def test_candidates_match_reference(cand):
    """The default and each A/B candidate of the SwiGLU ops (``block.config.candidates``), put in place of the swiglu
    and dswiglu variants that have it (both modes, both outputs, and the stacked form of the default and of dswiglu's
    staged fast-division candidates: pre-lean, lean-unfused), byte for byte: ragged groups with a tail and more
    columns than one tile, on values whose ``a`` stays in the fast path's range (normal), crosses it (wide:
    magnitudes to 2^127), holds NaN and Inf, bf16 subnormals, and a tile of the range's ends (-80, -80.5, -0, bf16
    max, +-Inf), normal values on 6 column tiles; then offsets past M, negative and decreasing, long tails, and M =
    0. With the default, the cols_fp8 dswiglu variants too (bf16 rowwise, fp8 colwise forms; stacked and not)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        dev = torch.device("cuda", torch.cuda.current_device())
        # "default": {}; some are of one output kind only (round: bf16, flat: fp8), in place of that kind's variants
        # (the other kind runs its default), or of one op (pre-t4: swiglu's; lean-unfused: dswiglu's)
        fields = {op: config_block.candidates_any_output(op).get(cand) for op in config_block.SWIGLU_OPS}
        fields = fields["dswiglu"] if fields["dswiglu"] is not None else fields["swiglu"]
        served = ops_block.candidate_in_place(stack, cand, dev, config_block.SWIGLU_OPS) if fields else list(
            config_block.SWIGLU_OPS)
        assert served, cand
        bf16_fields = config_block.candidates("dswiglu", "bfloat16").get(cand)
        stacked_checked = not fields or bf16_fields is not None and config_block.Variant(
            "dswiglu", "bfloat16", "rceil", "bfloat16", stacked=True, **bf16_fields) in config_block.candidate_variants()
        # the cols_fp8 variants are no candidate's (ops.candidate_in_place leaves them): checked with the default
        cols_fp8_checked = not fields
        sizes, tail, r = [0, 1, 127, 129, 300], 13, 288
        offs = offsets_from_sizes(sizes)
        m = sum(sizes) + tail
        inf = float("inf")
        ends = torch.tensor([-80.0, -80.5, -0.0, torch.finfo(torch.bfloat16).max, -79.5, -87.5, 1.0, -1.0, inf, -inf,
                             -88.0, 90.0])
        cases = [(dist, offs, m, r) for dist in ("normal", "wide", "nan_inf", "subnormal", "ends", "grid")]
        # 6 column tiles: the tiles_per_cta candidates' CTAs of 2 / 4 tiles, full ones and one with 2 of its 4
        cases += [("normal", offs, m, 5 * 128 + 32)]
        cases += [("wide", torch.tensor([100, 700, 50, -5, 10**6, 299], dtype=torch.int32), 300, 160),
                  ("nan_inf", torch.tensor([3, 3, 63], dtype=torch.int32), 1000, 96),
                  ("normal", torch.tensor([0, 0], dtype=torch.int32), 0, 64)]
        for dist, offs, m, r in cases:
            if dist == "ends":
                g, a, b = inputs(3, m, r, "normal", 7)
                a = ends.repeat(m * r // ends.numel() + 1)[:m * r].view(m, r).bfloat16().cuda()
            else:
                g, a, b = inputs(3, m, r, dist, 11)
            for mode in ScaleMode:
                for fake in (False, True):
                    what = f"{cand} {dist} M={m} R={r} {mode.value} {'bf16' if fake else 'fp8'}"
                    if "swiglu" in served:
                        got = kernel_forms(ops_block.block_swiglu(a, b, mode, offs.cuda(), fake), fake)[0]
                        check_forms(got, reference_forms(reference.swiglu(a, b), offs, mode, fake), f"swiglu {what}")
                    if "dswiglu" in served:
                        got_a, got_b = kernel_forms(ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), fake), fake)
                        grad_a, grad_b = reference.dswiglu(g, a, b)
                        check_forms(got_a, reference_forms(grad_a, offs, mode, fake), f"dswiglu grad_a {what}")
                        check_forms(got_b, reference_forms(grad_b, offs, mode, fake), f"dswiglu grad_b {what}")
                if "dswiglu" in served and stacked_checked:
                    outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=True)
                    check_stacked(outs, g, a, b, offs, mode, f"dswiglu stacked {what}")
                if "dswiglu" in served and cols_fp8_checked:  # the cols_fp8 variants (the default's: their own)
                    for stacked in (False, True):
                        outs = ops_block.block_dswiglu(g, a, b, mode, offs.cuda(), True, stacked=stacked, cols_fp8=True)
                        check_cols_fp8(outs, g, a, b, offs, mode, stacked, f"dswiglu cols_fp8 {what}")


@pytest.mark.parametrize("cand,out", [(name, o) for o in config_block.OUT_DTYPES
                                      for name, fields in config_block.candidates("dual", o).items() if fields])
def test_dual_candidates_match_reference(cand, out):
    """Each A/B candidate of ``dual`` (``block.config.candidates``: DUAL_CANDIDATES for bf16 outputs,
    DUAL_FP8_CANDIDATES for fp8), put in place of the dual variant of both modes, byte for byte: ragged groups with
    a tail and more columns than one tile, on normal, wide (magnitudes to 2^127), NaN / Inf and subnormal values,
    amaxes that floor saturates, zero blocks, blocks spanning their e4m3 grid (every amax mantissa, elements down to
    2^-20 of it), 6 column tiles (the staged ``dstage-t2`` / ``-t4``: full CTAs and one with 2 of its 4 tiles), and
    offsets past M, negative and decreasing."""
    import contextlib

    dev = torch.device("cuda", torch.cuda.current_device())
    fields = config_block.candidates("dual", out)[cand]
    fake = out == "bfloat16"
    with contextlib.ExitStack() as stack:
        for mode in ScaleMode:
            v = config_block.Variant("dual", "bfloat16", mode.value, out)
            stack.enter_context(ops_block.variant_in_place(v.replace(**fields), dev))
        sizes, tail, r = [0, 1, 127, 129, 300], 13, 288
        cases = [(dist, offsets_from_sizes(sizes), sum(sizes) + tail, r)
                 for dist in ("normal", "wide", "nan_inf", "subnormal", "amax_band", "zero_blocks", "grid")]
        cases.append(("normal", offsets_from_sizes(sizes), sum(sizes) + tail, 5 * 128 + 32))
        cases.append(("wide", torch.tensor([100, 700, 50, -5, 10**6, 299], dtype=torch.int32), 300, 160))
        for dist, offs, m, r in cases:
            (x,) = inputs(1, m, r, dist, 5)
            for mode in ScaleMode:
                got = kernel_forms(ops_block.block_dual(x, mode, offs.cuda(), fake), fake)[0]
                check_forms(got, reference_forms(x, offs, mode, fake), f"dual {cand} {out} {dist} {mode.value}")


# ----------------------------------------------------------------------------- the SwiGLU math, every bf16 value


def all_bf16() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()


def same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str):
    both_nan = got.isnan() & want.isnan()
    diff = (got.view(torch.int16) != want.view(torch.int16)) & ~both_nan
    if diff.any():
        i = diff.nonzero().flatten()[:8]
        raise AssertionError(f"{what}: {int(diff.sum())} values differ, e.g. at {i.tolist()}: got "
                             f"{got[i].float().tolist()} want {want[i].float().tolist()}")


def test_swiglu_math_matches_pytorch_silu_for_every_bf16():
    from moe_quant.kernels.block.kernel import run_swiglu_math

    a = all_bf16()
    one = torch.ones_like(a)
    same_bits_or_both_nan(run_swiglu_math("swiglu", one, a, one), F.silu(a) * one, "silu(a) * 1")
    same_bits_or_both_nan(run_swiglu_math("grad_b", one, a, one), one * F.silu(a), "1 * silu(a)")
    same_bits_or_both_nan(run_swiglu_math("grad_a", one, a, one), torch.ops.aten.silu_backward(one * one, a),
                          "silu_backward(1, a)")


def test_fast_div_math_matches_pytorch_for_every_bf16():
    """The ``fast_div`` variants' math (the division's and reciprocal's fast path where a word's two ``a`` lie in
    [-80, bf16 max], div.rn / rcp.rn elsewhere) for every bf16 ``a``, each value in both halves of its word so
    that every in-range value takes the fast path: equal to PyTorch everywhere. The fast path alone is exact on
    that range (-0 and the subnormals included) and wrong outside it (Inf, NaN, a below about -87), which is why
    the kernel checks the range."""
    from moe_quant.kernels.block.kernel import run_swiglu_math

    a = all_bf16().repeat_interleave(2)
    one = torch.ones_like(a)
    af = a.float()
    fast = (af >= -80) & (af <= torch.finfo(torch.bfloat16).max)
    assert int(fast.sum()) // 2 == 32640 + 17057  # precondition: +0 .. bf16 max and -0 .. -80 take the fast path
    want = {"swiglu": F.silu(a) * one, "grad_b": one * F.silu(a), "grad_a": torch.ops.aten.silu_backward(one, a)}
    for op, w in want.items():
        same_bits_or_both_nan(run_swiglu_math(op, one, a, one, "fast"), w, f"{op}, fast_div math")
        alone = run_swiglu_math(op, one, a, one, "fast_only")
        same_bits_or_both_nan(alone[fast], w[fast], f"{op}, the fast path alone in its range")
        wrong = ((alone.view(torch.int16) != w.view(torch.int16)) & ~(alone.isnan() & w.isnan()))[~fast]
        assert wrong.any(), f"{op}: the fast path alone was right outside its range too (the range check is moot)"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("path", ["plain", "fast"])
def test_swiglu_backward_matches_pytorch_for_every_pair_of_bf16(path, fused):
    """grad_a = silu_backward(g * b, a) and grad_b = g * silu(a) for every bf16 g (b = 1, so g * b = g) and every
    bf16 a: 2^32 pairs, 256 values of g at a time. Every bit of the sigmoid reaches grad_a (fp32 products before
    one bf16 rounding), so this checks grad_a for every input it can get, where the test above sees only g = 1.
    ``fast``: the ``fast_div`` variants' math (a value's fast path is taken where its word's other ``a`` is in
    range too: the neighbours in bit order, so all but the range's two ends). ``fused``: both from the
    ``fused_grads`` variants' one computation (exp(-a) and the reciprocal shared)."""
    from moe_quant.kernels.block.kernel import run_swiglu_math

    suffix = "_fused" if fused else ""
    a_all = all_bf16()
    n = a_all.numel()
    a = a_all.repeat(256)
    b = torch.ones_like(a)
    for first in range(0, n, 256):
        g = a_all[first:first + 256].repeat_interleave(n)
        same_bits_or_both_nan(run_swiglu_math("grad_a" + suffix, g, a, b, path), torch.ops.aten.silu_backward(g, a),
                              f"silu_backward(g, a), g = bf16 values {first}..{first + 255} in bit order")
        same_bits_or_both_nan(run_swiglu_math("grad_b" + suffix, g, a, b, path), g * F.silu(a),
                              f"g * silu(a), g {first}..")


@pytest.mark.parametrize("path", ["lean", "lean_signed"])
def test_lean_range_check_math_for_every_bf16(path):
    """The ``lean`` variants' math (the fast path wherever both ``a`` of a word are at least -80, Inf and NaN
    included) for every bf16 ``a`` and g, b drawn from every bf16 magnitude, each ``a`` in both halves of its word:
    equal to PyTorch bit for bit wherever PyTorch's result is finite, and non-finite wherever PyTorch's is (a
    quantized block holding either is a NaN block); precondition: for ``a = +Inf`` the fast path's NaN is where
    PyTorch has Inf (the case the check no longer sends to div.rn), and below -80 the fast path alone is wrong.
    ``lean_signed``: the same with the ``signed_residual`` division (no sign fix: -0 from the residual's sign)."""
    from moe_quant.kernels.block.kernel import run_swiglu_math

    a = all_bf16().repeat_interleave(2).repeat(4)
    gen = torch.Generator().manual_seed(3)
    g, b = (all_bf16()[torch.randint(0, 1 << 16, (a.numel(),), generator=gen).cuda()] for _ in range(2))
    grad_a, grad_b = reference.dswiglu(g, a, b)
    want = {"swiglu": reference.swiglu(a, b), "grad_a": grad_a, "grad_b": grad_b, "grad_a_fused": grad_a,
            "grad_b_fused": grad_b}
    inf_differs = False
    for op, w in want.items():
        got = run_swiglu_math(op, g, a, b, path)
        finite = w.isfinite()
        same_bits_or_both_nan(got[finite], w[finite], f"{op}, lean math where PyTorch is finite")
        assert not got[~finite].isfinite().any(), f"{op}: a finite result where PyTorch's is not"
        inf_differs |= bool((got.isnan() & w.isinf() & (a == float("inf"))).any())
        alone = run_swiglu_math(op, g, a, b, "fast_only")
        low = (a.float() < -88) & a.isfinite()
        assert ((alone.view(torch.int16) != w.view(torch.int16)) & ~(alone.isnan() & w.isnan()))[low].any(), op
    assert inf_differs  # the lean check sends a = +Inf down the fast path (NaN where PyTorch has Inf)


@pytest.mark.parametrize("seed", range(4))
def test_swiglu_math_matches_pytorch_on_random_triples(seed):
    from moe_quant.kernels.block.kernel import run_swiglu_math

    gen = torch.Generator().manual_seed(seed)
    n = 1 << 20
    g, a, b = ((torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float()))
               .bfloat16().cuda() for _ in range(3))
    same_bits_or_both_nan(run_swiglu_math("swiglu", g, a, b), reference.swiglu(a, b), "swiglu")
    grad_a, grad_b = reference.dswiglu(g, a, b)
    same_bits_or_both_nan(run_swiglu_math("grad_a", g, a, b), grad_a, "grad_a")
    same_bits_or_both_nan(run_swiglu_math("grad_b", g, a, b), grad_b, "grad_b")


# ----------------------------------------------------------------------------- the block end to end


@pytest.mark.parametrize("cols_fp8", [True, False])
@pytest.mark.parametrize("backend", ["emulated", "auto"])
@pytest.mark.parametrize("sizes,tail", [([300, 0, 129, 33], 7), ([1000], 0), ([0, 0], 3)])
def test_block_equals_unfused_on_gpu(backend, sizes, tail, cols_fp8):
    g = torch.Generator().manual_seed(0)
    d, h, e = 256, 192, len(sizes)
    m = sum(sizes) + tail
    x = torch.randn(m, d, generator=g).bfloat16().cuda().requires_grad_()
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16().cuda().requires_grad_()
          for s in ((e, h, d), (e, h, d), (e, d, h))]
    gy = torch.randn(m, d, generator=g).bfloat16().cuda()
    offs = offsets_from_sizes(sizes, "cuda")
    res = []
    for fn in (functools.partial(mxfp8_swiglu_experts, dswiglu_cols_fp8=cols_fp8), swiglu_experts_unfused):
        for t in (x, *ws):
            t.grad = None
        y = fn(x, *ws, offs, backend=backend)
        y.backward(gy)
        res.append([y.detach()[: sum(sizes)], x.grad[: sum(sizes)]] + [w.grad for w in ws])
    for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), *res):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_block_compiles_fullgraph_on_gpu(compile_backend):
    """The block's kernel ops (``moe_quant::block_*``) trace through their fake implementations and the
    compiled block equals eager bit for bit."""
    g = torch.Generator().manual_seed(1)
    d, h, sizes = 128, 96, [200, 0, 57]
    m = sum(sizes)
    x = torch.randn(m, d, generator=g).bfloat16().cuda().requires_grad_()
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16().cuda().requires_grad_()
          for s in ((3, h, d), (3, h, d), (3, d, h))]
    gy = torch.randn(m, d, generator=g).bfloat16().cuda()
    offs = offsets_from_sizes(sizes, "cuda")
    torch._dynamo.reset()
    res = []
    for fn in (mxfp8_swiglu_experts, torch.compile(mxfp8_swiglu_experts, fullgraph=True, backend=compile_backend)):
        for t in (x, *ws):
            t.grad = None
        y = fn(x, *ws, offs)
        y.backward(gy)
        res.append([y.detach(), x.grad] + [w.grad for w in ws])
    for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), *res):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("cols_fp8", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("sizes,tail", [([300, 0, 129, 33], 7), ([0, 0], 3)])
def test_w13_block_equals_its_per_gemm_form_on_gpu(compiled, sizes, tail, cols_fp8):
    """The concatenated-weight block (its dW13 from the stacked colwise form the kernel writes in place)
    against its per-GEMM form, eager and compiled (``fullgraph``: the stacked op's fake implementation)."""
    from moe_quant import mxfp8_swiglu_experts_w13, swiglu_experts_w13_unfused

    g = torch.Generator().manual_seed(2)
    d, h, e = 256, 160, len(sizes)
    m = sum(sizes) + tail
    x = torch.randn(m, d, generator=g).bfloat16().cuda().requires_grad_()
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16().cuda().requires_grad_()
          for s in ((e, 2 * h, d), (e, d, h))]
    gy = torch.randn(m, d, generator=g).bfloat16().cuda()
    offs = offsets_from_sizes(sizes, "cuda")
    block = functools.partial(mxfp8_swiglu_experts_w13, dswiglu_cols_fp8=cols_fp8)
    if compiled:
        torch._dynamo.reset()
        block = torch.compile(block, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (block, swiglu_experts_w13_unfused):
        for t in (x, *ws):
            t.grad = None
        y = fn(x, *ws, offs)
        y.backward(gy)
        res.append([y.detach()[: sum(sizes)], x.grad[: sum(sizes)]] + [w.grad for w in ws])
    if sum(sizes):
        assert res[0][2].abs().sum() > 0  # precondition: dW13 reached both halves' rows
        assert res[0][2][:, :h].abs().sum() > 0 and res[0][2][:, h:].abs().sum() > 0
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), *res):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
