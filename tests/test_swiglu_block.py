"""mxfp8_swiglu_experts: the fused SwiGLU expert block equals the unfused converted block (three
mxfp8_grouped_mm calls and PyTorch's silu) bit for bit, output and every gradient; torch.compile,
activation checkpointing, saved-activation memory, argument errors."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import group_sizes, offsets_from_sizes

from benchmarks.bench_block import bf16_block
from moe_quant import block_quantize as bq
from moe_quant import layouts, reference
from moe_quant import mxfp8_swiglu_experts, swiglu_experts_unfused
from moe_quant.autograd import grouped_mm as gm
from moe_quant.numerics import ScaleMode


def make_block(sizes, tail, d, h, seed, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(sizes) + tail, len(sizes)
    x = torch.randn(m, d, generator=g).to(x_dtype).requires_grad_()
    w1 = (torch.randn(e, h, d, generator=g) / math.sqrt(d)).to(w_dtype).requires_grad_()
    w3 = (torch.randn(e, h, d, generator=g) / math.sqrt(d)).to(w_dtype).requires_grad_()
    w2 = (torch.randn(e, d, h, generator=g) / math.sqrt(h)).to(w_dtype).requires_grad_()
    gy = torch.randn(m, d, generator=g).to(torch.bfloat16)
    return x, w1, w3, w2, offsets_from_sizes(sizes), gy


def run(fn, x, w1, w3, w2, offs, gy, **kw):
    for t in (x, w1, w3, w2):
        t.grad = None
    y = fn(x, w1, w3, w2, offs, **kw)
    y.backward(gy)
    return [y.detach()] + [t.grad.clone() for t in (x, w1, w3, w2)]


def assert_bits_equal(got, want, end):
    """Output and dx compared on the rows the GEMMs compute (``< offs[-1]``); weight gradients whole."""
    names = ("y", "dx", "dw1", "dw3", "dw2")
    for name, a, b in zip(names, got, want):
        if name in ("y", "dx"):
            a, b = a[:end], b[:end]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        ai = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
        bi = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        assert torch.equal(ai, bi), f"{name}: {(ai != bi).sum().item()} of {ai.numel()} differ"


class Counts:
    """How often each fused pass and mxfp8_grouped_mm ran (the MXFP8 block path was taken)."""

    def __init__(self, monkeypatch):
        self.n = {"rowwise": 0, "colwise": 0, "colwise_kept": 0, "rowwise_and_kept": 0, "colwise_operand": 0,
                  "dual": 0, "swiglu": 0, "swiglu_rowwise": 0, "swiglu_colwise": 0, "dswiglu": 0}
        for name in self.n:
            orig = getattr(bq, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                self.n[_name] += 1
                return _orig(*a, **k)

            monkeypatch.setattr(bq, name, wrapped)


@given(
    groups=group_sizes(max_groups=4, max_size=140),
    dh=st.sampled_from([(32, 64), (64, 32), (96, 160)]),
    mode=st.sampled_from(list(ScaleMode)),
    dtypes=st.sampled_from([(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.bfloat16, torch.float32)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_block_equals_unfused_bit_for_bit(groups, dh, mode, dtypes, seed):
    sizes, tail = groups
    x, w1, w3, w2, offs, gy = make_block(sizes, tail, *dh, seed, *dtypes)
    got = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy, scale_mode=mode)
    want = run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy, scale_mode=mode)
    assert_bits_equal(got, want, sum(sizes))


def test_block_path_taken_and_unfused_path_not(monkeypatch):
    counts = Counts(monkeypatch)
    calls = []
    orig = gm._MXFP8GroupedMM.apply
    monkeypatch.setattr(gm._MXFP8GroupedMM, "apply", lambda *a: calls.append(1) or orig(*a))
    x, w1, w3, w2, offs, gy = make_block([40, 0, 70], 5, 64, 96, 0)
    run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy)
    # per GEMM: A's and grad_out's rowwise and colwise forms, one pass each (the forms of moe_quant.block_quantize);
    # none of the block's fused passes
    assert len(calls) == 3 and counts.n == {**dict.fromkeys(counts.n, 0), "rowwise": 6, "colwise": 6}
    counts.n = dict.fromkeys(counts.n, 0)
    calls.clear()
    run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)
    # x: rowwise once for w1 and w3 and its colwise form kept (forward: one pass where the kernels serve, here the
    # reference's two inside it), read back once for their wgrads (backward); h's rowwise form from a and b in
    # forward, its colwise form in backward; grad_y both at once
    once = {"rowwise": 1, "colwise": 0, "colwise_kept": 1, "rowwise_and_kept": 1, "colwise_operand": 1, "dual": 1,
            "swiglu": 0, "swiglu_rowwise": 1, "swiglu_colwise": 1, "dswiglu": 1}
    assert counts.n == once
    assert not calls
    counts.n.update(dict.fromkeys(counts.n, 0))
    run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy, dswiglu_cols_fp8=True)
    # dswiglu_cols_fp8: grad_a's and grad_b's colwise forms made in fp8 by dSwiGLU and each read back once too
    assert counts.n == {**once, "colwise_operand": 3}
    assert not calls


def test_block_differs_from_bf16_and_tracks_it():
    """The block really quantizes (not bf16 bit for bit) yet stays close to the bf16 block."""
    x, w1, w3, w2, offs, gy = make_block([100, 60, 90], 0, 128, 96, 3)
    got = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)
    ref = run(bf16_block, x, w1, w3, w2, offs, gy)
    for a, b in zip(got, ref):
        assert not torch.equal(a, b)
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 0.1


@pytest.mark.parametrize("sizes,tail", [([0, 0, 0], 0), ([0, 0, 0], 7), ([], 0), ([0, 33, 0], 0), ([1], 0)])
def test_empty_and_tiny(sizes, tail):
    if not sizes:
        sizes = [0]
    x, w1, w3, w2, offs, gy = make_block(sizes, tail, 32, 32, 1)
    got = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)
    want = run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy)
    assert_bits_equal(got, want, sum(sizes))
    for i, s in enumerate(sizes):  # an expert without tokens gets an exact zero gradient
        if s == 0:
            assert not got[2][i].any() and not got[4][i].any()


@pytest.mark.parametrize("d,h", [(0, 32), (32, 0)])
def test_zero_width(d, h):
    x, w1, w3, w2, offs, gy = make_block([3, 2], 0, d, h, 2)
    got = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)
    want = run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy)
    assert_bits_equal(got, want, 5)


def test_only_requested_gradients():
    x, w1, w3, w2, offs, gy = make_block([20, 30], 0, 64, 64, 4)
    w1.requires_grad_(False)
    x.requires_grad_(False)
    y = mxfp8_swiglu_experts(x, w1, w3, w2, offs)
    dw3, dw2 = torch.autograd.grad(y, (w3, w2), gy)
    y2 = swiglu_experts_unfused(x, w1, w3, w2, offs)
    ew3, ew2 = torch.autograd.grad(y2, (w3, w2), gy)
    assert torch.equal(dw3, ew3) and torch.equal(dw2, ew2)


def test_torch_compile_fullgraph():
    x, w1, w3, w2, offs, gy = make_block([50, 0, 30], 4, 64, 96, 5)
    want = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)
    torch._dynamo.reset()
    compiled = torch.compile(mxfp8_swiglu_experts, fullgraph=True, backend="aot_eager")
    got = run(compiled, x, w1, w3, w2, offs, gy)
    assert_bits_equal(got, want, 80)


def test_torch_compile_fullgraph_of_a_view_of_an_intermediate():
    """In a model the block's x is an intermediate of the compiled graph (tokens gathered by expert, viewed):
    the forward's saved forms must reach the backward graph (a saved view of a forward intermediate made
    dynamo fail: 'An intermediate tensor ... aliases an input or output')."""
    x, w1, w3, w2, offs, gy = make_block([50, 0, 30], 4, 64, 96, 5)
    wide = torch.cat([x.detach(), x.detach()], 1).requires_grad_()

    def block(wide, w1, w3, w2, offs):
        return mxfp8_swiglu_experts(wide[:, :64].contiguous().view(x.shape), w1, w3, w2, offs)

    torch._dynamo.reset()  # compiled first: an eager call before it had hidden the failure (warm caches)
    got = run(torch.compile(block, fullgraph=True, backend="aot_eager"), wide, w1, w3, w2, offs, gy)
    want = run(block, wide, w1, w3, w2, offs, gy)
    assert_bits_equal(got, want, 80)


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    x, w1, w3, w2, offs, gy = make_block([50, 20], 0, 64, 64, 6)
    want = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy)

    def ckpt(x, w1, w3, w2, offs):
        return checkpoint(mxfp8_swiglu_experts, x, w1, w3, w2, offs, use_reentrant=False)

    got = run(ckpt, x, w1, w3, w2, offs, gy)
    assert_bits_equal(got, want, 70)


def _saved_bytes(fn, *args):
    """Bytes of the tensors autograd saves for backward (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_saved_activations_at_most_bf16():
    x, w1, w3, w2, offs, _ = make_block([256, 128, 256], 0, 256, 128, 7)
    weights = sum(w.untyped_storage().nbytes() for w in (w1, w3, w2))
    fused = _saved_bytes(mxfp8_swiglu_experts, x, w1, w3, w2, offs) - weights
    bf16 = _saved_bytes(bf16_block, x, w1, w3, w2, offs) - weights
    unfused = _saved_bytes(swiglu_experts_unfused, x, w1, w3, w2, offs) - weights
    assert fused <= bf16, (fused, bf16)
    assert fused < unfused, (fused, unfused)


def test_double_backward_raises():
    x, w1, w3, w2, offs, gy = make_block([20], 0, 32, 32, 8)
    y = mxfp8_swiglu_experts(x, w1, w3, w2, offs)
    (dx,) = torch.autograd.grad(y, x, gy, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


@pytest.mark.parametrize(
    "change,err,match",
    [
        (lambda a: a.update(x=a["x"].to(torch.float16)), TypeError, "x must have dtype"),
        (lambda a: a.update(x=a["x"][:, :48]), ValueError, "w1 must be"),
        (lambda a: a.update(w3=a["w3"][:, :, :32]), ValueError, "w3 must have the shape"),
        (lambda a: a.update(w2=a["w2"].transpose(-2, -1)), ValueError, "w2 must be"),
        (lambda a: a.update(w1=a["w1"][0]), ValueError, "w1 must be 3-D"),
        (lambda a: a.update(offs=a["offs"].long()), TypeError, "offs must have dtype torch.int32"),
        (lambda a: a.update(offs=a["offs"][:1]), ValueError, "offs must have one entry per expert"),
        (lambda a: a.update(offs=torch.tensor([5, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
        (lambda a: a.update(offs=torch.tensor([5, 999], dtype=torch.int32)), ValueError, "past the number of rows"),
        (lambda a: a.update(scale_mode="nearest"), ValueError, "scale_mode"),
        (lambda a: a.update(backend="scaled"), ValueError, "backend='scaled'"),
        (lambda a: a.update(dswiglu_cols_fp8=1), TypeError, "dswiglu_cols_fp8 must be a bool, got int"),
    ],
)
def test_bad_arguments(change, err, match):
    x, w1, w3, w2, offs, _ = make_block([10, 20], 0, 64, 32, 9)
    args = dict(x=x, w1=w1, w3=w3, w2=w2, offs=offs)
    change(args)
    kw = {k: args.pop(k) for k in ("scale_mode", "backend", "dswiglu_cols_fp8") if k in args}
    with pytest.raises(err, match=match):
        mxfp8_swiglu_experts(args["x"], args["w1"], args["w3"], args["w2"], args["offs"], **kw)


def test_h_not_multiple_of_32():
    x, w1, w3, w2, offs, _ = make_block([10], 0, 64, 48, 10)
    with pytest.raises(ValueError, match="w1: H"):
        mxfp8_swiglu_experts(x, w1, w3, w2, offs)


def test_bench_block_cpu_smoke(tmp_path, capsys):
    from benchmarks import bench_block

    out = tmp_path / "block.json"
    assert bench_block.main(["--device", "cpu", "--tiny", "--rounds", "1", "--shapes", "dsv3", "--m", "128",
                             "--micro-batches", "2", "--json", str(out)]) == 0
    import json

    res = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in res] == ["bf16", "unfused", "fused", "unfused+reuse", "fused+reuse", "bf16-w13",
                                           "unfused-w13", "fused-w13", "fused-w13+reuse"]
    assert [r["micro_batches"] for r in res] == [1, 1, 1, 2, 2, 1, 1, 1, 2]
    assert all(r["ratio_to_bf16"] > 0 for r in res) and res[5]["ratio_to_bf16"] == 1.0  # w13 vs bf16-w13
    assert "vs bf16" in capsys.readouterr().out


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("m,r,sizes", [(300, 96, [100, 0, 150]), (0, 64, [0, 0]), (40, 32, [])])
def test_kernel_op_shapes_match_the_reference_forms(fake, m, r, sizes):
    """The block ops' fake implementations (what torch.compile traces) give the shapes and dtypes of the
    reference forms the kernels must reproduce byte for byte."""
    from moe_quant.kernels.block import ops as ops_block

    x = torch.randn(m, r).bfloat16()
    offs = offsets_from_sizes(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    for op, n in (("dual", 1), ("swiglu", 1), ("dswiglu", 2)):
        outs = ops_block._fake_outputs(op, x, offs, fake)
        forms = bq._kernel_forms(outs, fake)
        assert len(forms) == n
        want = bq._separate_forms(x, ScaleMode.RCEIL, offs, fake)
        for got in forms:
            for g, w in zip(got, want):
                assert [(tuple(t.shape), t.dtype) for t in g] == [(tuple(t.shape), t.dtype) for t in w], op
    schema = str(torch.ops.moe_quant.block_dswiglu.default._schema)
    assert schema.endswith("-> Tensor[]"), schema


@given(groups=group_sizes(max_groups=4, max_size=140), dh=st.sampled_from([(32, 64), (256, 128), (96, 160)]),
       seed=st.integers(0, 2**31 - 1))
def test_block_keeps_a_b_and_x_colwise_fp8_per_row(groups, dh, seed):
    """What lives from forward to backward (every saved storage but the weights): a and b in bf16 (2H bytes a row
    each) and x's colwise form in fp8 with plain e8m0 scales (D + D/32 bytes per padded row), no x and no form of
    h; with x routed to the experts as in a MoE (a gather of the tokens, whose backward keeps only the index), the
    bf16 block keeps x, a, silu(a), b and h. Pinned exactly, per row."""
    sizes, tail = groups
    d, h = dh
    x0, w1, w3, w2, offs, _ = make_block(sizes, tail, d, h, seed)
    m, e = x0.shape[0], len(sizes)
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed))
    weights = sum(w.untyped_storage().nbytes() for w in (w1, w3, w2))

    def saved(fn):  # the routed copy of x is the block's alone
        return _saved_bytes(lambda: fn(x0[perm], w1, w3, w2, offs)) - weights

    mp = layouts.k_groups_padded_len(m, e)
    offs_bytes = 4 * e  # the sanitized offsets and the padded ones: (E,) int32 each
    want = 2 * (m * h * 2) + (d * mp + d * mp // 32) + 2 * offs_bytes + 8 * m  # + the gather's int64 index
    assert saved(mxfp8_swiglu_experts) == want
    plain = saved(bf16_block)
    # precondition: the bf16 block keeps x, a, silu(a), b, h (and offs)
    assert plain == m * d * 2 + 4 * (m * h * 2) + 8 * m + offs_bytes
    if m >= 64:  # per row, past the padding of small groups: less than the bf16 block
        assert want < plain


def test_block_frees_a_and_b_once_dswiglu_read_them(monkeypatch):
    """An eager backward frees the saved a and b after the dSwiGLU pass (before x's form is read back and the
    weight-gradient and dx GEMMs run), unless the graph is retained: then a second backward gives the same
    gradients."""
    import weakref

    seen, alive_then = [], []
    swiglu, operand = bq.swiglu_rowwise, bq.colwise_operand  # the forward's h pass sees a and b first

    def spy_swiglu(a, b, *args):
        seen.append((weakref.ref(a), weakref.ref(b)))
        return swiglu(a, b, *args)

    def spy_operand(*args):
        alive_then.append([r() is not None for r in seen[0]])
        return operand(*args)

    monkeypatch.setattr(bq, "swiglu_rowwise", spy_swiglu)
    monkeypatch.setattr(bq, "colwise_operand", spy_operand)
    x, w1, w3, w2, offs, gy = make_block([40, 0, 70], 5, 64, 96, 11)
    want = run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy)
    got = run(mxfp8_swiglu_experts, x, w1, w3, w2, offs, gy, dswiglu_cols_fp8=True)
    assert_bits_equal(got, want, 110)
    # x's form read back, then grad_a's and grad_b's fp8 colwise forms (dswiglu_cols_fp8)
    assert alive_then == [[False, False]] * 3, alive_then
    seen.clear(), alive_then.clear()
    y = mxfp8_swiglu_experts(x, w1, w3, w2, offs, dswiglu_cols_fp8=True)
    first = torch.autograd.grad(y, (x, w1, w3, w2), gy, retain_graph=True)
    second = torch.autograd.grad(y, (x, w1, w3, w2), gy)
    assert alive_then == [[True, True]] * 3 + [[False, False]] * 3, alive_then  # kept while the graph is retained
    assert_bits_equal([y.detach(), *first], want, 110)  # rows past the groups' end are unspecified
    assert_bits_equal([y.detach(), *second], want, 110)


# ----------------------------------------------------------------------------- dswiglu_cols_fp8: grad_a's and grad_b's
# colwise forms in fp8 until their weight gradients' GEMMs (issue 54)


def _w13_block(x, w1, w3, w2, offs, **kw):
    from moe_quant import mxfp8_swiglu_experts_w13

    return mxfp8_swiglu_experts_w13(x, torch.cat([w1, w3], dim=1), w2, offs, **kw)


@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("compile_backend", [None, "aot_eager", "inductor"])
def test_dswiglu_cols_fp8_gives_the_same_bits_on_and_off(compile_backend, concat):
    """The switch changes where grad_a's and grad_b's colwise forms are bf16 (from dSwiGLU on, or only from just before
    their weight gradients' GEMMs), never a bit of the output or a gradient: eager and compiled, separate and
    concatenated gate-up weights, an empty group and rows past the last group."""
    block = _w13_block if concat else mxfp8_swiglu_experts
    sizes, tail = [96, 0, 33, 160], 5
    x, w1, w3, w2, offs, gy = make_block(sizes, tail, 64, 96, 3)
    got = {}
    for on in (True, False):
        fn = block
        if compile_backend:
            torch._dynamo.reset()
            fn = torch.compile(block, fullgraph=True, backend=compile_backend)
        got[on] = run(fn, x, w1, w3, w2, offs, gy, dswiglu_cols_fp8=on)
    assert got[True][2].abs().sum() > 0 and got[True][3].abs().sum() > 0  # precondition: dW1 and dW3 made
    assert_bits_equal(got[True], got[False], sum(sizes))
    if not concat:
        assert_bits_equal(got[True], run(swiglu_experts_unfused, x, w1, w3, w2, offs, gy), sum(sizes))


@pytest.mark.parametrize("concat", [False, True])
def test_dswiglu_cols_fp8_makes_the_colwise_forms_in_fp8(monkeypatch, concat):
    """With the switch (the default) the backward's dSwiGLU pass hands on grad_a's and grad_b's colwise forms (or the
    stacked one) as fp8 data and plain e8m0 scales, as the block keeps x's (``colwise_kept``), and each is read back
    (``colwise_operand``) once for its weight gradient; without it, bf16 values from dSwiGLU on, nothing read back but
    x's form."""
    made, read, depth = [], [], [0]
    for name in ("dswiglu", "dswiglu_stacked"):
        orig = getattr(bq, name)

        def wrapped(*a, _orig=orig, _stacked=name == "dswiglu_stacked", **k):
            depth[0] += 1
            try:
                out = _orig(*a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # the backward's call (the CPU's stacked reference calls dswiglu inside)
                made.extend(f[1] for f in ([out] if _stacked else out))  # the colwise forms
            return out

        monkeypatch.setattr(bq, name, wrapped)
    orig_operand = bq.colwise_operand
    monkeypatch.setattr(bq, "colwise_operand", lambda kept, fake: read.append(kept) or orig_operand(kept, fake))
    block = _w13_block if concat else mxfp8_swiglu_experts
    x, w1, w3, w2, offs, gy = make_block([64, 0, 96], 3, 64, 96, 4)
    m, h = x.shape[0], w1.shape[1] * (2 if concat else 1)
    mp = layouts.k_groups_padded_len(m, 3)
    for on in (True, False):
        made.clear(), read.clear()
        run(block, x, w1, w3, w2, offs, gy, dswiglu_cols_fp8=on)
        assert len(made) == (1 if concat else 2), made
        for col in made:
            if on:
                data_t, scales, _ = col
                assert data_t.dtype == torch.float8_e4m3fn and tuple(data_t.shape) == (h, mp)
                assert scales.dtype == torch.float8_e8m0fnu and tuple(scales.shape) == (h, mp // 32)
            else:
                assert col[0].dtype == torch.bfloat16 and len(col) == 2
        assert len(read) == 1 + (len(made) if on else 0)  # x's form, then each fp8 colwise form once


def _kernel_like_dswiglu(grad_h, a, b, mode, offs, fake, stacked=False, cols_fp8=False):
    """What ``block_dswiglu`` returns (its doc), made by the reference quantizers on the CPU: with ``cols_fp8``, per
    output the bf16 rowwise values, the colwise fp8 data and its plain K-groups scales (R, Mp/32) (stacked: the two
    outputs' data and scales each stacked along rows)."""
    assert fake and cols_fp8
    rows, cols = [], []
    for t in reference_dswiglu(grad_h, a, b):
        rows.append(bq._separate_forms(t, mode, offs, True)[0][0])
        data_t, scales, poffs = reference.quantize_colwise_k_groups_plain(t, offs, mode)
        cols.append((data_t, scales, poffs))
    if stacked:
        return [torch.cat(rows, dim=1), torch.cat([c[0] for c in cols]), torch.cat([c[1] for c in cols]), cols[0][2]]
    return [rows[0], *cols[0][:2], rows[1], *cols[1][:2], cols[0][2]]


def reference_dswiglu(grad_h, a, b):
    return reference.dswiglu(grad_h, a, b)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("m,r,offs_list", [(300, 96, [100, 100, 250]), (200, 64, [0, 0]), (40, 32, []),
                                           (130, 160, [150, 5, 129])])
def test_dswiglu_cols_fp8_reads_the_kernel_outputs_as_the_reference_forms(monkeypatch, stacked, m, r, offs_list):
    """``block_quantize.dswiglu`` / ``dswiglu_stacked`` with ``cols_fp8`` on the kernels' outputs (here made by the
    reference quantizers, in the op's layout: plain K-groups scales, as ``colwise_kept`` makes them) give the reference
    path's forms byte for byte: the rowwise bf16 values, the colwise fp8 data, the plain scales as they are (stacked:
    both halves' stacked), the padded offsets; and the op's fake outputs (what torch.compile traces) have the kernels'
    shapes and dtypes."""
    from moe_quant.kernels.block import ops as ops_block

    g = torch.Generator().manual_seed(5)
    grad_h, a, b = (torch.randn(m, r, generator=g).bfloat16() for _ in range(3))
    offs = layouts.sanitize_offsets(torch.tensor(offs_list, dtype=torch.int32), m).to(torch.int32)
    mode = ScaleMode.RCEIL
    if stacked:
        want = bq.dswiglu_stacked(grad_h, a, b, mode, offs, cols_fp8=True)
    else:
        want = bq.dswiglu(grad_h, a, b, mode, offs, True, cols_fp8=True)
    outs = _kernel_like_dswiglu(grad_h, a, b, mode, offs, True, stacked, True)
    fake = ops_block._fake_outputs("dswiglu", grad_h, offs, True, stacked, True)
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in outs]
    monkeypatch.setattr(bq, "_kernels_serve", lambda *t: True)
    monkeypatch.setattr(ops_block, "block_dswiglu", lambda *args, **kw: _kernel_like_dswiglu(*args, **kw))
    got = (bq.dswiglu_stacked(grad_h, a, b, mode, offs, cols_fp8=True) if stacked
           else bq.dswiglu(grad_h, a, b, mode, offs, True, cols_fp8=True))
    flat = lambda forms: [t for f in (forms if stacked else [f for pair in forms for f in pair]) for t in f]  # noqa: E731
    assert len(flat(got)) == len(flat(want))
    for x, y in zip(flat(got), flat(want)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
