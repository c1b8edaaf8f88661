"""mxfp8_swiglu_experts_w13: the block over concatenated gate and up weights (``w13 = [W1; W3]``, transformers'
``gate_up_proj``) equals its per-GEMM form (``swiglu_experts_w13_unfused``: one MXFP8 GEMM over w13, ``chunk``,
silu, one over w2) bit for bit, output and every gradient; the concatenated scale layouts it relies on; its
argument errors; compile and saved memory as the separate-weights block."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import group_sizes, offsets_from_sizes

from moe_quant import block_quantize as bq
from moe_quant import mxfp8_swiglu_experts, mxfp8_swiglu_experts_w13, swiglu_experts_w13_unfused
from moe_quant import quantize as q
from moe_quant import reference
from moe_quant.autograd import swiglu_block as sb
from moe_quant.numerics import ScaleMode


def make(sizes, tail, d, h, seed, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16, transposed=False):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(sizes) + tail, len(sizes)
    x = torch.randn(m, d, generator=g).to(x_dtype).requires_grad_()
    w13 = (torch.randn(e, 2 * h, d, generator=g) / math.sqrt(d)).to(w_dtype)
    if transposed:  # a (E, D, 2H) parameter, passed as its transpose: strided w13
        w13 = w13.transpose(1, 2).contiguous().requires_grad_()
    else:
        w13.requires_grad_()
    w2 = (torch.randn(e, d, h, generator=g) / math.sqrt(h)).to(w_dtype).requires_grad_()
    gy = torch.randn(m, d, generator=g).to(torch.bfloat16)
    return x, w13, w2, offsets_from_sizes(sizes), gy


def run(fn, x, w13, w2, offs, gy, transposed=False, **kw):
    for t in (x, w13, w2):
        t.grad = None
    y = fn(x, w13.transpose(1, 2) if transposed else w13, w2, offs, **kw)
    y.backward(gy)
    return [y.detach()] + [t.grad.clone() for t in (x, w13, w2)]


def assert_bits_equal(got, want, end):
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), got, want):
        if name in ("y", "dx"):  # rows the GEMMs compute
            a, b = a[:end], b[:end]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        ab, bb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{name}: {(ab != bb).sum().item()} of {ab.numel()} bytes differ"


@given(
    groups=group_sizes(max_groups=4, max_size=140),
    dh=st.sampled_from([(32, 64), (64, 32), (96, 160)]),
    mode=st.sampled_from(list(ScaleMode)),
    dtypes=st.sampled_from([(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.bfloat16, torch.float32)]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_w13_block_equals_its_per_gemm_form_bit_for_bit(groups, dh, mode, dtypes, transposed, seed):
    sizes, tail = groups
    x, w13, w2, offs, gy = make(sizes, tail, *dh, seed, *dtypes, transposed=transposed)
    got = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy, transposed, scale_mode=mode)
    want = run(swiglu_experts_w13_unfused, x, w13, w2, offs, gy, transposed, scale_mode=mode)
    if sum(sizes):  # gradients reached both weights
        assert got[2].abs().sum() > 0 and got[3].abs().sum() > 0
    assert_bits_equal(got, want, sum(sizes))


def test_w13_block_runs_one_gate_up_gemm_for_dx_and_one_for_dw13(monkeypatch):
    calls = {"mm": 0, "block": 0}
    real_mm, real_apply = torch._grouped_mm, sb._SwiGLUExperts.apply
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.__setitem__("mm", calls["mm"] + 1) or real_mm(*a, **k))
    monkeypatch.setattr(sb._SwiGLUExperts, "apply",
                        lambda *a: calls.__setitem__("block", calls["block"] + 1) or real_apply(*a))
    x, w13, w2, offs, gy = make([40, 0, 70], 5, 64, 96, 1)
    run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    # fwd: x W1^T and x W3^T (halves of w13's operand), h W2^T; bwd: dW2, grad_h, dW13, dx -- seven GEMMs,
    # where the separate-weights block runs eight (dW1, dW3, and dx as two GEMMs summed)
    assert calls == {"mm": 7, "block": 1}


def test_w13_dx_is_one_accumulation_not_the_separate_blocks_sum():
    """The two blocks differ only in dx: one fp32 accumulation over 2H here, two bf16 products added there
    (each as its own module's per-GEMM conversion computes it). Forward and weight gradients agree."""
    x, w13, w2, offs, gy = make([60, 90], 0, 64, 96, 2)
    got = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    h = w13.shape[1] // 2
    w1, w3 = (w13.detach()[:, :h].clone().requires_grad_(), w13.detach()[:, h:].clone().requires_grad_())
    x.grad = None
    y = mxfp8_swiglu_experts(x, w1, w3, w2, offs)
    y.backward(gy)
    assert torch.equal(y.detach(), got[0])
    assert torch.equal(torch.cat([w1.grad, w3.grad], 1), got[2])
    assert not torch.equal(x.grad, got[1])  # rounding differs on these inputs (else this test shows nothing)
    assert (x.grad.float() - got[1].float()).abs().max() < 0.05 * got[1].float().abs().max()


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("sizes,tail,w", [([40, 0, 130, 7], 3, 128), ([300], 0, 256), ([0, 0], 9, 128), ([5, 250], 0, 96)])
def test_concat_rowwise_scaled_forms_equal_quantizing_the_concatenation(sizes, tail, w, mode):
    """The rowwise forms of [A | B] from those of A and B: fp8 data and M-groups blocked scales byte for byte
    (padding included), where A's width is whole scale tiles (a multiple of 128)."""
    g = torch.Generator().manual_seed(sum(sizes) + w)
    m = sum(sizes) + tail
    a, b = torch.randn(m, w, generator=g).bfloat16(), torch.randn(m, 64, generator=g).bfloat16()
    offs = offsets_from_sizes(sizes)
    if w % 128:
        with pytest.raises(ValueError, match="whole tiles"):
            bq.concat_rowwise(q.quantize_rowwise(a, mode, offs), q.quantize_rowwise(b, mode, offs))
        return
    got = bq.concat_rowwise(q.quantize_rowwise(a, mode, offs), q.quantize_rowwise(b, mode, offs))
    want = q.quantize_rowwise(torch.cat([a, b], 1), mode, offs)
    for x, y in zip(got, want):
        assert x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_concat_rowwise_emulated_and_colwise_emulated_forms():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(70, 64, generator=g).bfloat16(), torch.randn(70, 96, generator=g).bfloat16()
    offs = offsets_from_sizes([30, 0, 33])
    for mode in ScaleMode:
        (row,) = bq.concat_rowwise((q.fake_quantize_rowwise(a, mode),), (q.fake_quantize_rowwise(b, mode),))
        assert torch.equal(row, q.fake_quantize_rowwise(torch.cat([a, b], 1), mode))
        col = bq.concat_colwise(tuple(q.fake_colwise_k_groups(a, offs, mode, torch.bfloat16)),
                                tuple(q.fake_colwise_k_groups(b, offs, mode, torch.bfloat16)))
        want = q.fake_colwise_k_groups(torch.cat([a, b], 1), offs, mode, torch.bfloat16)
        assert torch.equal(col[0], want[0]) and torch.equal(col[1], want[1])
    scaled = tuple(q.colwise_k_groups(a, offs, ScaleMode.RCEIL))
    assert bq.concat_colwise(scaled, scaled) is None  # group-major scales: the caller runs two GEMMs


@pytest.mark.parametrize(
    "change,err,match",
    [
        (lambda a: a.update(w13=a["w13"][:, :31]), ValueError, "must be even"),
        (lambda a: a.update(w13=a["w13"][:, :, :32]), ValueError, "w13 must be"),
        (lambda a: a.update(w2=a["w2"].transpose(-2, -1)), ValueError, "w2 must be"),
        (lambda a: a.update(w13=a["w13"][:, :32], w2=a["w2"][:, :, :16]), ValueError, "w13: H"),
        (lambda a: a.update(w13=a["w13"][0]), ValueError, "w13 must be 3-D"),
        (lambda a: a.update(offs=a["offs"][:1]), ValueError, "offs must have one entry per expert"),
        (lambda a: a.update(x=a["x"].to(torch.float16)), TypeError, "x must have dtype"),
    ],
)
def test_bad_arguments(change, err, match):
    x, w13, w2, offs, _ = make([10, 20], 0, 64, 32, 9)
    args = dict(x=x, w13=w13, w2=w2, offs=offs)
    change(args)
    with pytest.raises(err, match=match):
        mxfp8_swiglu_experts_w13(args["x"], args["w13"], args["w2"], args["offs"])


def test_torch_compile_fullgraph():
    x, w13, w2, offs, gy = make([40, 50], 0, 64, 64, 6)
    want = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    torch._dynamo.reset()
    got = run(torch.compile(mxfp8_swiglu_experts_w13, fullgraph=True, backend="aot_eager"), x, w13, w2, offs, gy)
    assert_bits_equal(got, want, 90)


def test_zero_width_gives_exact_zeros():
    x, w13, w2, offs, gy = make([5, 6], 0, 32, 32, 7)
    w13z = torch.zeros(2, 0, 32, dtype=torch.bfloat16, requires_grad=True)
    w2z = torch.zeros(2, 32, 0, dtype=torch.bfloat16, requires_grad=True)
    y = mxfp8_swiglu_experts_w13(x, w13z, w2z, offs)
    y.backward(gy)
    assert torch.equal(y, torch.zeros_like(y)) and w13z.grad.shape == w13z.shape


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    x, w13, w2, offs, gy = make([50, 20], 3, 64, 64, 6)
    want = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    got = run(lambda *a: checkpoint(mxfp8_swiglu_experts_w13, *a, use_reentrant=False), x, w13, w2, offs, gy)
    assert_bits_equal(got, want, 70)


@pytest.mark.parametrize("hold", ["bf16-fwd", "fp8", "bf16"])
def test_reuse_scope_quantizes_w13_once_with_the_same_bits(hold):
    from moe_quant import reuse_quantized_weights

    x, w13, w2, offs, gy = make([50, 0, 40], 0, 64, 96, 8)
    want = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    with reuse_quantized_weights([w13, w2], hold=hold) as scope:
        first = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
        second = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy)
    # fwd and dgrad operands of w13 and w2 (bf16-fwd: the fwd ones), made once (the forward's two GEMMs share w13's
    # one operand)
    held = 2 if hold == "bf16-fwd" else 4
    assert scope.misses == held and scope.hits == held
    assert_bits_equal(first, want, 90)
    assert_bits_equal(second, want, 90)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("m,h,sizes", [(70, 64, [30, 0, 36]), (70, 32, [70]), (40, 96, []), (0, 64, [0, 0]),
                                       (33, 64, [0, 0])])
@pytest.mark.parametrize("mode", list(ScaleMode))
def test_dswiglu_stacked_is_the_concatenation_of_the_forms(m, h, sizes, mode):
    """The emulated w13 block's dx and dW13 operands: both forms of [grad_a | grad_b] (on a GPU the kernel writes
    each half in place, tests/test_kernel_block_gpu.py); here the reference pass, against dswiglu's two forms
    concatenated (rowwise along columns, colwise along rows) and against quantizing the concatenation itself,
    rows past the last group's end zero in both halves."""
    g = torch.Generator().manual_seed(3 + m + h)
    gh, a, b = (torch.randn(m, h, generator=g).bfloat16() for _ in range(3))
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    (row,), (col, poffs) = bq.dswiglu_stacked(gh, a, b, mode, offs)
    ((ra,), (ca, pa)), ((rb,), (cb, _)) = bq.dswiglu(gh, a, b, mode, offs, True)
    assert _bytes_equal(row, torch.cat([ra, rb], dim=1)) and row.shape == (m, 2 * h)
    assert _bytes_equal(col, torch.cat([ca, cb], dim=0)) and _bytes_equal(poffs, pa)
    g13 = torch.cat(reference.dswiglu(gh, a, b), dim=1)
    end = int(offs[-1]) if offs.numel() else 0
    want_row = q.fake_quantize_rowwise(g13, mode)
    want_row[end:] = 0
    assert _bytes_equal(row, want_row)
    want_col = q.fake_colwise_k_groups(g13, offs, mode, torch.bfloat16)
    assert _bytes_equal(col, want_col[0]) and _bytes_equal(poffs, want_col[1])


@pytest.mark.parametrize("m,h,sizes", [(300, 96, [100, 0, 150]), (0, 64, [0, 0]), (40, 32, [])])
def test_stacked_op_fake_shapes_match_the_reference_forms(m, h, sizes):
    """The stacked op's fake implementation (what torch.compile traces): the shapes and dtypes of the
    reference forms of [grad_a | grad_b] the kernel must reproduce byte for byte."""
    from moe_quant.kernels.block import ops as ops_block

    x = torch.randn(m, h).bfloat16()
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    row, col, poffs = ops_block._fake_outputs("dswiglu", x, offs, True, stacked=True)
    (w_row,), (w_col, w_poffs) = bq.dswiglu_stacked(x, x, x, ScaleMode.RCEIL, offs)
    for got, want in ((row, w_row), (col, w_col), (poffs, w_poffs)):
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype)


@pytest.mark.parametrize("m,h,sizes", [(0, 64, [0, 0]), (5, 64, []), (0, 32, []), (7, 0, [3])])
def test_stacked_op_zero_fill_path(monkeypatch, m, h, sizes):
    """M R = 0 or G = 0: the stacked op launches no kernel (so this runs on the CPU); every byte of its outputs,
    poisoned first, follows from the shapes: the reference forms of [grad_a | grad_b]."""
    from moe_quant.kernels import compile_cache
    from moe_quant.kernels.block import ops as ops_block

    monkeypatch.setattr(compile_cache, "POISON_OUTPUTS", True)
    g = torch.Generator().manual_seed(m + h)
    gh, a, b = (torch.randn(m, h, generator=g).bfloat16() for _ in range(3))
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    outs = ops_block._impl("dswiglu", (gh, a, b), "rceil", offs, True, True)
    (w_row,), (w_col, w_poffs) = bq.dswiglu_stacked(gh, a, b, ScaleMode.RCEIL, offs)
    assert len(outs) == 3
    for got, want in zip(outs, (w_row, w_col, w_poffs)):
        assert _bytes_equal(got, want)


def test_stacked_block_variants_are_their_own_and_the_others_keep_their_keys():
    """The stacked dSwiGLU variants (row pitch 2R) are variants of their own, bf16 only; every other block
    variant keeps its key (its compiled code, on-disk cache name and measured speed; the keys of a change of
    default are recorded in test_kernel_candidates.py)."""
    from moe_quant.kernels.block.config import Variant, all_variants

    keys = [v.key for v in all_variants()]
    # 12 defaults (3 ops x 2 modes x 2 outputs), 2 stacked, 4 dswiglu cols_fp8, 2 dual cols_fp8, 8 swiglu forms
    assert len(keys) == len(set(keys)) == 28
    assert sorted(k for k in keys if k.endswith(("-rowsonly", "-colsonly"))) == sorted(
        f"{Variant('swiglu', 'bfloat16', m, o).key}-{f}only" for m in ("rceil", "floor")
        for o in ("bfloat16", "float8_e4m3fn") for f in ("rows", "cols"))
    assert [k for k in keys if k.startswith("dual") and "-fp8cols" in k] == [
        "dual-bfloat16-rceil-bfloat16-fp8cols", "dual-bfloat16-floor-bfloat16-fp8cols"]
    with pytest.raises(ValueError, match="forms 'rows' / 'cols' write one form of h: op must be 'swiglu'"):
        Variant("dswiglu", "bfloat16", "rceil", "bfloat16", forms="cols")
    with pytest.raises(ValueError, match="forms must be one of"):
        Variant("swiglu", "bfloat16", "rceil", "bfloat16", forms="row")
    with pytest.raises(ValueError, match="op must be 'dual' or 'dswiglu' with out_dtype 'bfloat16'"):
        Variant("dual", "bfloat16", "rceil", "float8_e4m3fn", cols_fp8=True)
    assert [k for k in keys if "-stacked" in k and "-fp8cols" not in k] == [
        "dswiglu-bfloat16-rceil-bfloat16-stacked-staged-fastdiv-fused-lean-round-sres-stageswizzled",
        "dswiglu-bfloat16-floor-bfloat16-stacked-staged-fastdiv-fused-lean-round-sres-stageswizzled"]
    assert Variant("dswiglu", "bfloat16", "rceil", "bfloat16").key == \
        "dswiglu-bfloat16-rceil-bfloat16-staged-fastdiv-fused-lean-round-sres-stageswizzled"
    for op, out in (("dual", "bfloat16"), ("swiglu", "bfloat16"), ("dswiglu", "float8_e4m3fn")):
        with pytest.raises(ValueError, match="stacked rowwise outputs exist for op 'dswiglu' with bfloat16"):
            Variant(op, "bfloat16", "rceil", out, stacked=True)


def test_emulated_w13_backward_concatenates_no_rowwise_forms(monkeypatch):
    """The emulated w13 block takes dx's operand, [grad_a | grad_b]'s rowwise form, from dswiglu_stacked as it
    is (the kernel writes it in place): no concat_rowwise of its own (the reference pass inside
    dswiglu_stacked concatenates, on the CPU)."""
    inside = []
    own_calls = []
    stacked, concat = bq.dswiglu_stacked, bq.concat_rowwise

    def dswiglu_stacked(*args):
        inside.append(1)
        try:
            return stacked(*args)
        finally:
            inside.pop()

    def concat_rowwise(a, b):
        if not inside:
            own_calls.append(1)
        return concat(a, b)

    monkeypatch.setattr(bq, "dswiglu_stacked", dswiglu_stacked)
    monkeypatch.setattr(bq, "concat_rowwise", concat_rowwise)
    x, w13, w2, offs, gy = make([20, 0, 30], 3, 64, 64, 9)
    got = run(mxfp8_swiglu_experts_w13, x, w13, w2, offs, gy, backend="emulated")
    assert own_calls == []
    monkeypatch.undo()
    assert_bits_equal(got, run(swiglu_experts_w13_unfused, x, w13, w2, offs, gy, backend="emulated"), 50)


def test_stacked_colwise_forms_need_fake_values():
    from moe_quant.kernels.block import ops as ops_block

    t = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stacked colwise forms exist for fake=True"):
        ops_block.block_dswiglu(t, t, t, "rceil", torch.tensor([4], dtype=torch.int32), False, stacked=True)


def test_one_form_and_cols_fp8_ops_refuse_what_they_cannot_write():
    """``block_swiglu``'s ``forms`` names one of both / rows / cols, and dual's ``cols_fp8`` (bf16 rowwise values
    beside fp8 colwise data) needs ``fake``: clear errors before any launch."""
    from moe_quant.kernels.block import ops as ops_block

    t, offs = torch.zeros(4, 32, dtype=torch.bfloat16), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_swiglu: forms must be one of \('both', 'rows', 'cols'\), got 'row'"):
        ops_block.block_swiglu(t, t, "rceil", offs, True, forms="row")
    with pytest.raises(ValueError, match="block_dual: cols_fp8 writes bf16 rowwise values beside fp8 colwise data"):
        ops_block.block_dual(t, "rceil", offs, False, cols_fp8=True)


@pytest.mark.parametrize("fake", [True, False])
def test_the_kernel_path_unpacks_the_block_ops_outputs_into_the_reference_forms(monkeypatch, fake):
    """``block_quantize``'s kernel path (the forward's x forms and one-form h passes, dSwiGLU with and without
    ``cols_fp8``) turns the ops' output lists into the forms the GEMMs take: the same tensors' shapes and dtypes, in
    the same places, as the reference path's (here the ops' fake implementations stand in for the launches, so the
    unpacking runs on the CPU)."""
    from moe_quant.kernels.block import ops as ops_block
    from moe_quant.layouts import sanitize_offsets
    from moe_quant.numerics import ScaleMode

    m, r = 300, 96
    offs = sanitize_offsets(torch.tensor([0, 40, 41, 200, 300], dtype=torch.int32), m).to(torch.int32)
    g, a, b = (torch.randn(m, r, dtype=torch.bfloat16) for _ in range(3))
    mode = ScaleMode.RCEIL
    calls = {
        "rowwise_and_kept": lambda: bq.rowwise_and_kept(g, mode, offs, fake),
        "swiglu_rowwise": lambda: bq.swiglu_rowwise(a, b, mode, offs, fake),
        "swiglu_colwise": lambda: bq.swiglu_colwise(a, b, mode, offs, fake),
        "dswiglu": lambda: bq.dswiglu(g, a, b, mode, offs, fake),
        "dswiglu cols_fp8": lambda: bq.dswiglu(g, a, b, mode, offs, fake, cols_fp8=True),
    }
    want = {name: fn() for name, fn in calls.items()}  # the reference path (no kernels on the CPU)
    launched = []

    def fake_run(op, inputs, mode_, offs_, fake_, extra):
        launched.append(op)
        return ops_block._fake_outputs(op, inputs[0], offs_, fake_, **extra)

    monkeypatch.setattr(bq, "_kernels_serve", lambda *ts: True)
    monkeypatch.setattr(ops_block, "_run", fake_run)
    for name, fn in calls.items():
        launched.clear()
        got = fn()
        assert launched, name  # precondition: the kernel path ran

        def layout(forms):
            if isinstance(forms, torch.Tensor):
                return (tuple(forms.shape), forms.dtype)
            return tuple(layout(f) for f in forms)

        assert layout(got) == layout(want[name]), name
