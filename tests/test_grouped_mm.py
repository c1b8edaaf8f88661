"""mxfp8_grouped_mm: accuracy vs bf16, equality with an independent per-expert loop, autograd,
validation, torch.compile, and the SM100 (scaled) path's arguments against PyTorch's own checks."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import group_sizes, offsets_from_sizes

from moe_quant import from_blocked_3d, from_blocked_k_groups, from_blocked_m_groups, mxfp8_grouped_mm, to_mxfp8
from moe_quant.autograd import grouped_mm as gm
from moe_quant.backends import GemmBackend
from moe_quant.numerics import ScaleMode, dequantize_blocks
from moe_quant import quantize as q
from moe_quant import layouts, reference


def sqnr(x, ref):
    x, ref = x.double(), ref.double()
    return (20 * torch.log10(ref.norm() / (x - ref).norm().clamp_min(1e-30))).item()


def make_problem(sizes, tail, k, n, seed, a_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes) + tail
    A = torch.randn(m, k, generator=g).to(a_dtype).requires_grad_()
    W = (torch.randn(len(sizes), n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16).requires_grad_()
    return A, W, offsets_from_sizes(sizes), torch.randn(m, n, generator=g).to(torch.bfloat16)


def run(A, W, offs, grad_out, **kw):
    A.grad = W.grad = None
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, **kw)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), A.grad.clone(), W.grad.clone()


def bf16_reference(A, W, offs, grad_out):
    A.grad = W.grad = None
    out = torch._grouped_mm(A.to(torch.bfloat16), W.transpose(-2, -1), offs=offs)
    out.backward(grad_out)
    return out.detach(), A.grad.clone(), W.grad.clone()


@given(
    groups=group_sizes(max_groups=5, max_size=200),
    kn=st.sampled_from([(64, 96), (160, 64), (256, 128)]),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(list(ScaleMode)),
)
def test_sqnr_vs_bf16(groups, kn, seed, mode):
    sizes, tail = groups
    total = sum(sizes)
    if total < 64:  # SQNR is a statistic: keep enough tokens
        sizes = sizes[:-1] + [sizes[-1] + 64]
        total += 64
    A, W, offs, go = make_problem(sizes, tail, *kn, seed)
    out, dA, dW = run(A, W, offs, go, scale_mode=mode)
    r_out, r_dA, r_dW = bf16_reference(A, W, offs, go)
    assert sqnr(out[:total], r_out[:total]) >= 27
    assert sqnr(dA[:total], r_dA[:total]) >= 25
    assert sqnr(dW, r_dW) >= 24
    for e, size in enumerate(sizes):
        if size == 0:
            assert bool((dW[e] == 0).all())  # exact zero weight gradient of an expert without tokens


def dq_rows(x, mode):
    """Per-row 1x32 quantize + dequantize via the public to_mxfp8/from_mxfp8 (fp32 result)."""
    d, s = to_mxfp8(x, scale_mode=mode)
    return dequantize_blocks(d, s, torch.float32)


def loop_grouped_mm(A, W, offs_list, grad_out, mode):
    """Independent per-expert loop: quantize each operand the docs/design.md section 4 way, fp32 matmul."""
    m, k = A.shape
    e, n, _ = W.shape
    out = torch.zeros(m, n)
    dA = torch.zeros(m, k)
    dW = torch.zeros(e, n, k)
    start = 0
    for i, end in enumerate(offs_list):
        a, g = A[start:end], grad_out[start:end]
        out[start:end] = dq_rows(a, mode) @ dq_rows(W[i], mode).t()
        dA[start:end] = dq_rows(g, mode) @ dq_rows(W[i].t().contiguous(), mode).t()
        if end > start:  # tokens padded with zeros to a multiple of 32, blocks along tokens
            pad = (-(end - start)) % 32
            a_t = torch.nn.functional.pad(a.t().float(), (0, pad))
            g_t = torch.nn.functional.pad(g.t().float(), (0, pad))
            dW[i] = dq_rows(g_t, mode) @ dq_rows(a_t, mode).t()
        start = end
    return out, dA, dW


@pytest.mark.parametrize("mode", list(ScaleMode))
@pytest.mark.parametrize("a_dtype", [torch.bfloat16, torch.float32])
def test_equals_independent_per_expert_loop(mode, a_dtype):
    sizes, tail = [0, 1, 31, 33, 127, 129, 0, 70], 5
    A, W, offs, go = make_problem(sizes, tail, 96, 64, seed=3, a_dtype=a_dtype)
    out, dA, dW = run(A, W, offs, go, scale_mode=mode)
    l_out, l_dA, l_dW = loop_grouped_mm(A.detach(), W.detach(), offs.tolist(), go, mode)
    t = sum(sizes)
    # same operands; only the fp32 accumulation order and the final bf16 rounding differ
    tol = dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[:t].float(), l_out[:t], **tol)
    torch.testing.assert_close(dA[:t].float(), l_dA[:t], **tol)
    torch.testing.assert_close(dW.float(), l_dW, **tol)
    assert dA.dtype == a_dtype and dW.dtype == torch.bfloat16


def test_out_dtype_fp32_widens_the_bf16_result():
    A, W, offs, go = make_problem([40, 0, 88], 0, 64, 32, seed=1)
    out16 = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)
    out32 = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32, out16.float())


def test_no_tokens_at_all():
    A, W, offs, go = make_problem([0, 0, 0], 0, 64, 32, seed=1)
    out, dA, dW = run(A, W, offs, go)
    assert out.shape == (0, 32) and dA.shape == (0, 64) and bool((dW == 0).all())


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("a_int", TypeError, "A must have dtype"),
        ("a_3d", ValueError, "A must be 2-D"),
        ("w_fp16", TypeError, "W_t must have dtype"),
        ("k_mismatch", ValueError, "contraction"),
        ("k_not_32", ValueError, "multiple of 32"),
        ("n_not_32", ValueError, "N .W_t.shape.2.. = 48"),
        ("offs_int64", TypeError, "offs must have dtype torch.int32"),
        ("offs_2d", ValueError, "offs must be 1-D"),
        ("offs_len", ValueError, "one entry per expert"),
        ("offs_decreasing", ValueError, "non-decreasing"),
        ("offs_past_m", ValueError, "past the number of rows"),
        ("offs_negative", ValueError, "non-negative"),
        ("out_dtype", TypeError, "out_dtype"),
        ("scale_mode", ValueError, "scale_mode"),
        ("backend", ValueError, "backend"),
        ("scaled_on_cpu", ValueError, "capability 10.0"),
    ],
)
def test_bad_input_raises_clear_errors(case, exc, match):
    A = torch.randn(64, 64, dtype=torch.bfloat16)
    W_t = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    kw = {}
    if case == "a_int":
        A = A.to(torch.int32)
    elif case == "a_3d":
        A = A.view(1, 64, 64)
    elif case == "w_fp16":
        W_t = W_t.half()
    elif case == "k_mismatch":
        W_t = torch.randn(2, 96, 32, dtype=torch.bfloat16)
    elif case == "k_not_32":
        A, W_t = torch.randn(64, 48, dtype=torch.bfloat16), torch.randn(2, 48, 32, dtype=torch.bfloat16)
    elif case == "n_not_32":
        W_t = torch.randn(2, 64, 48, dtype=torch.bfloat16)
    elif case == "offs_int64":
        offs = offs.long()
    elif case == "offs_2d":
        offs = offs.view(1, 2)
    elif case == "offs_len":
        offs = torch.tensor([64], dtype=torch.int32)
    elif case == "offs_decreasing":
        offs = torch.tensor([40, 20], dtype=torch.int32)
    elif case == "offs_past_m":
        offs = torch.tensor([32, 65], dtype=torch.int32)
    elif case == "offs_negative":
        offs = torch.tensor([-1, 64], dtype=torch.int32)
    elif case == "out_dtype":
        kw["out_dtype"] = torch.float16
    elif case == "scale_mode":
        kw["scale_mode"] = "round"
    elif case == "backend":
        kw["backend"] = "cublas"
    elif case == "scaled_on_cpu":
        kw["backend"] = "scaled"
    with pytest.raises(exc, match=match):
        mxfp8_grouped_mm(A, W_t, offs, **kw)


def test_unvalidated_bad_offsets_stay_in_bounds():
    """With validation off (as on a GPU), garbage offsets are sanitized: no crash, finite output."""
    A, W, offs, go = make_problem([16, 16, 32], 0, 64, 32, seed=2)
    for bad in ([50, 10, 64], [-5, 1000, 7], [64, 64, 10_000]):
        o = torch.tensor(bad, dtype=torch.int32)
        out, dA, dW = run(A, W, o, go, validate_offsets=False)
        assert out.shape == (64, 32) and bool(dW.isfinite().all())


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_fwd_bwd_no_recompiles():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def step(A, W, offs):
        return mxfp8_grouped_mm(A, W.transpose(-2, -1), offs).float().square().mean()

    A, W, _, _ = make_problem([64, 64, 64], 0, 64, 32, seed=0)
    results = []
    for sizes in ([64, 64, 64], [0, 100, 92], [192, 0, 0], [1, 31, 160]):
        offs = offsets_from_sizes(sizes)
        A.grad = W.grad = None
        loss = step(A, W, offs)
        loss.backward()
        eager = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs).float().square().mean()
        torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-5)
        results.append(W.grad.clone())
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    assert all(bool(r.isfinite().all()) for r in results)


BAD_OFFSETS = {
    "decreasing": ([40, 20], "non-decreasing"),
    "past_m": ([10, 100], "past the number of rows"),
    "negative": ([-3, 64], "non-negative"),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("validate", [True, None])
def test_compiled_validation_raises_like_eager(backend, validate):
    """fullgraph + dynamic, CPU offsets: the compiled call raises the eager ValueError (same text)
    when the graph runs, for every bad offsets tensor, and good ones still give the eager result."""
    torch._dynamo.reset()
    A, W, _, _ = make_problem([32, 32], 0, 64, 32, seed=4)
    A, W_t = A.detach(), W.detach().transpose(-2, -1)
    fn = torch.compile(
        lambda a, w, o: mxfp8_grouped_mm(a, w, o, validate_offsets=validate), fullgraph=True, dynamic=True, backend=backend
    )
    good = offsets_from_sizes([10, 54])
    torch.testing.assert_close(fn(A, W_t, good), mxfp8_grouped_mm(A, W_t, good), rtol=0, atol=0)
    for bad, match in BAD_OFFSETS.values():
        offs = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match=match) as eager:
            mxfp8_grouped_mm(A, W_t, offs, validate_offsets=validate)
        with pytest.raises(ValueError, match=match) as compiled:
            fn(A, W_t, offs)
        assert str(compiled.value) == str(eager.value)
    # other sizes of the same graph (dynamic M) are checked against their own M
    A2 = torch.randn(48, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past the number of rows M = 48"):
        fn(A2, W_t, offsets_from_sizes([10, 39]))


def test_compiled_without_validation_sanitizes():
    """validate_offsets=False (the GPU default): no check, the offsets are clamped, as in eager."""
    torch._dynamo.reset()
    A, W, _, _ = make_problem([32, 32], 0, 64, 32, seed=4)
    A, W_t = A.detach(), W.detach().transpose(-2, -1)
    fn = torch.compile(
        lambda a, w, o: mxfp8_grouped_mm(a, w, o, validate_offsets=False), fullgraph=True, dynamic=True, backend="aot_eager"
    )
    for bad, _ in BAD_OFFSETS.values():
        offs = torch.tensor(bad, dtype=torch.int32)
        clean = gm.sanitize_offsets(offs, 64).to(torch.int32)
        rows = int(clean[-1])
        got, want = fn(A, W_t, offs), mxfp8_grouped_mm(A, W_t, offs, validate_offsets=False)
        assert torch.equal(got[:rows], want[:rows])
        assert torch.equal(want[:rows], mxfp8_grouped_mm(A, W_t, clean)[:rows])



def test_compiled_func_grad_equals_eager():
    """``torch.compile(torch.func.grad(...), fullgraph=True)``: the gradients of eager autograd, bit for bit. Under
    compile the GEMM is custom ops, whose autograd does not serve functorch's ``grad`` (it raised "must override the
    setup_context staticmethod" when traced), so inside transforms the traced autograd function stays."""
    A, W, offs, go = make_problem([40, 0, 56], 0, 64, 32, seed=6)

    def loss(a, w):
        return (mxfp8_grouped_mm(a, w.transpose(-2, -1), offs).float() * go.float()).sum()

    want = torch.autograd.grad(loss(A, W), (A, W))
    assert all(t.abs().sum() > 0 for t in want)  # precondition: nonzero gradients
    torch._dynamo.reset()
    got = torch.compile(torch.func.grad(loss, argnums=(0, 1)), backend="aot_eager", fullgraph=True)(A.detach(),
                                                                                                   W.detach())
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)

# ----------------------------------------------------------------------------- K = 0, N = 0


@pytest.mark.parametrize("k, n", [(0, 32), (64, 0), (0, 0)])
def test_empty_contraction_or_output_dims_give_exact_zeros(k, n):
    """torch._grouped_mm rejects K = 0 and N = 0; the answer is known: zeros, zero / empty gradients."""
    A = torch.randn(40, k, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(3, n, k, dtype=torch.bfloat16, requires_grad=True)
    offs = offsets_from_sizes([10, 0, 25])
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, out_dtype=torch.float32)
    assert out.shape == (40, n) and out.dtype == torch.float32 and bool((out == 0).all())
    out.sum().backward()
    assert A.grad.shape == (40, k) and bool((A.grad == 0).all())
    assert W.grad.shape == (3, n, k) and bool((W.grad == 0).all())


# ----------------------------------------------------------------------------- torch.func


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch._grouped_mm has no batch rule
@pytest.mark.filterwarnings("ignore:torch.searchsorted.*non-contiguous:UserWarning")  # batched offs
@pytest.mark.parametrize("batched", ["A", "W_t", "both", "A_and_offs"])
@pytest.mark.parametrize("seed", range(3))
def test_vmap_equals_a_python_loop(batched, seed):
    """torch.vmap over a leading batch (forward and, via vmap(grad), backward) equals a loop.
    Rows past offs[-1] are unspecified (as in torch._grouped_mm) and not compared."""
    g = torch.Generator().manual_seed(seed)
    B, M, K, N = 3, 90, 64, 32
    sizes = [[10, 0, 50], [0, 33, 57], [31, 1, 9]]
    A = torch.randn(B, M, K, generator=g).to(torch.bfloat16)
    W_t = (torch.randn(B, 3, K, N, generator=g) / 8).to(torch.bfloat16)
    offs = torch.stack([offsets_from_sizes(s) for s in sizes])
    in_dims = {"A": (0, None, None), "W_t": (None, 0, None), "both": (0, 0, None), "A_and_offs": (0, None, 0)}[batched]
    args = tuple(x if d == 0 else x[0] for x, d in zip((A, W_t, offs), in_dims))
    pick = lambda i: tuple(x[i] if d == 0 else x for x, d in zip(args, in_dims))  # noqa: E731

    out = torch.vmap(lambda a, w, o: mxfp8_grouped_mm(a, w, o), in_dims=in_dims)(*args)
    rows = [int(pick(i)[2][-1]) for i in range(B)]
    for i in range(B):
        assert torch.equal(out[i, : rows[i]], mxfp8_grouped_mm(*pick(i))[: rows[i]])

    def loss(a, w, o):  # over the rows every batch element computes (a static slice)
        return mxfp8_grouped_mm(a, w, o)[: min(rows)].float().square().sum()

    grads = torch.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=in_dims)(*args)
    for i in range(B):
        a, w, o = pick(i)
        a, w = a.clone().requires_grad_(), w.clone().requires_grad_()
        loss(a, w, o).backward()
        assert torch.equal(grads[0][i, : min(rows)], a.grad[: min(rows)])
        assert torch.equal(grads[1][i], w.grad)


def test_func_grad_equals_backward():
    A, W, offs, _ = make_problem([40, 0, 70], 6, 96, 64, seed=8)
    A, W_t = A.detach(), W.detach().transpose(-2, -1)
    t = int(offs[-1])
    loss = lambda a, w: mxfp8_grouped_mm(a, w, offs)[:t].float().square().sum()  # noqa: E731
    gA, gW = torch.func.grad(loss, argnums=(0, 1))(A, W_t)
    a, w = A.clone().requires_grad_(), W_t.clone().requires_grad_()
    loss(a, w).backward()
    assert torch.equal(gA[:t], a.grad[:t]) and torch.equal(gW, w.grad)
    # and it is the MXFP8 gradient, not bf16's
    bf16 = torch.func.grad(lambda a: torch._grouped_mm(a, W_t, offs=offs)[:t].float().square().sum())(A)
    assert not torch.equal(bf16[:t], gA[:t])


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch._grouped_mm has no batch rule
def test_vmap_validates_every_batch_element():
    A = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    W_t = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    offs = torch.tensor([[10, 64], [40, 20]], dtype=torch.int32)
    fn = torch.vmap(lambda a, o: mxfp8_grouped_mm(a, W_t, o))
    with pytest.raises(ValueError, match="non-decreasing"):
        fn(A, offs)
    with pytest.raises(ValueError, match="non-decreasing"):  # batch dim of offs last
        torch.vmap(lambda a, o: mxfp8_grouped_mm(a, W_t, o), in_dims=(0, 1))(A, offs.t().contiguous())
    offs[1] = torch.tensor([20, 65])
    with pytest.raises(ValueError, match="past the number of rows"):
        fn(A, offs)


# ----------------------------------------------------------------------------- SM100 scaled path


def test_scaled_path_arguments_pass_pytorch_meta_checks():
    """fwd, dgrad and wgrad of the scaled backend on meta tensors: every torch._scaled_grouped_mm call
    goes through PyTorch's own shape/dtype/stride/scale-size checks (its meta kernel)."""
    m, k, n, e = 300, 256, 128, 4
    A = torch.randn(m, k, dtype=torch.bfloat16, device="meta", requires_grad=True)
    W = torch.randn(e, n, k, dtype=torch.bfloat16, device="meta", requires_grad=True)
    offs = torch.empty(e, dtype=torch.int32, device="meta")
    out = gm._MXFP8GroupedMM.apply(A, W.transpose(-2, -1), offs, ScaleMode.RCEIL, torch.bfloat16, GemmBackend.SCALED)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    out.backward(torch.empty_like(out))
    assert A.grad.shape == (m, k) and W.grad.shape == (e, n, k)


def test_scaled_path_operands_dequantize_to_the_emulated_operands():
    """The real fp8 data + blocked scales the SM100 path feeds the GEMM hold exactly the values the
    emulated path multiplies (checked on CPU through the layout inverses)."""
    sizes, tail = [0, 33, 129, 31, 90], 3
    A, W, offs, go = make_problem(sizes, tail, 96, 64, seed=5)
    A, W = A.detach(), W.detach()
    m, k = A.shape
    e, n, _ = W.shape
    t = sum(sizes)
    mode = ScaleMode.RCEIL
    # fwd operand A: rowwise, M-groups scales
    a, a_s = q.quantize_rowwise(A, mode, offs)
    deq = dequantize_blocks(a, from_blocked_m_groups(a_s, offs, m, k // 32))
    assert torch.equal(deq[:t], q.fake_quantize_rowwise(A, mode)[:t])
    # weights along K and along N, 3D scales
    w, w_s = q.quantize_3d(W, mode, along="k")
    assert torch.equal(dequantize_blocks(w, from_blocked_3d(w_s, n, k // 32)), q.fake_quantize_3d(W, mode, -1))
    w, w_s = q.quantize_3d(W, mode, along="n")
    deq = dequantize_blocks(w, from_blocked_3d(w_s, k, n // 32)).transpose(-2, -1)
    assert torch.equal(deq, q.fake_quantize_3d(W, mode, -2))
    # wgrad operand: colwise along tokens, per-group padded, K-groups scales
    g_t, g_s, padded_offs = q.quantize_colwise_k_groups(go, offs, mode)
    plain = from_blocked_k_groups(g_s, offs, n, m)
    fq_t, fq_offs = q.fake_quantize_colwise_k_groups(go, offs, mode)
    assert torch.equal(dequantize_blocks(g_t, plain), fq_t) and torch.equal(fq_offs, padded_offs)
    # and the padded layout holds exactly the tokens of each group, zeros between
    assert torch.equal(reference.pad_token_groups(reference.unpad_token_groups(fq_t.t(), offs, m), offs), fq_t.t())
    assert padded_offs.tolist() == torch.tensor([32 * math.ceil(s / 32) for s in sizes]).cumsum(0).tolist()


# ----------------------------------------------------------------------------- no tokens (expert parallelism)


@pytest.mark.parametrize("offs_values", [[0, 0, 0], [0, 5, 9]])  # a rank with no tokens; offsets past M = 0
def test_no_tokens_backward_hands_row_major_operands_to_the_quantizers(monkeypatch, offs_values):
    """M = 0 and ``out.float().sum().backward()``: the gradient is an expanded (stride 0) zero-element
    tensor, which ``.contiguous()`` keeps as it is (it counts as contiguous) and the kernels reject.
    Every operand the backward quantizes must have row-major strides."""
    seen = []
    for name in ("fake_rowwise", "fake_colwise_k_groups"):  # the quantizers the GEMMs call
        def spy(x, *args, _orig=getattr(q, name), _name=name, **kwargs):
            seen.append((_name, tuple(x.shape), x.stride()))
            return _orig(x, *args, **kwargs)

        monkeypatch.setattr(q, name, spy)
    A = torch.randn(0, 64, requires_grad=True)
    W = torch.randn(3, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(offs_values, dtype=torch.int32)
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, validate_offsets=False)
    grad = torch.ones((), dtype=out.dtype).expand(out.shape)  # what out.float().sum().backward() hands back
    assert out.shape == (0, 32) and grad.stride() == (0, 0) and grad.is_contiguous()  # the precondition
    out.float().sum().backward()
    assert ("fake_colwise_k_groups", (0, 32), (32, 1)) in seen  # grad_out reached wgrad
    assert all(stride == torch.empty(shape).stride() for _, shape, stride in seen), seen
    assert A.grad.shape == (0, 64) and W.grad.shape == (3, 32, 64) and not W.grad.any()


def test_row_major_copies_zero_element_tensors_with_degenerate_strides():
    t = torch.zeros(()).expand(0, 64)
    assert t.is_contiguous() and t.contiguous().stride() == (0, 0)  # what PyTorch does
    assert layouts.row_major(t).stride() == (64, 1)
    x = torch.randn(8, 64)
    assert layouts.row_major(x) is x and layouts.row_major(x.t()).stride() == (8, 1)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_compiled_gradients_equal_eager(out_dtype):
    """``torch.compile(fullgraph=True)`` of fwd + bwd: output, dA and dW equal eager's bit for bit. Regression:
    the forward returned ``out.to(out_dtype)``, which is ``out`` itself when it already has that dtype, and torch
    2.11's dynamo then traced the backward with a zero output gradient -- every gradient zero (seen on the H100
    with torch 2.11 and on the CPU with torch 2.11; torch 2.13 traces it correctly)."""
    torch.manual_seed(0)
    A = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(3, 32, 64) * 0.1).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor([40, 40, 96], dtype=torch.int32)
    go = torch.randn(96, 32, dtype=out_dtype)

    def f(a, w):
        return mxfp8_grouped_mm(a, w.transpose(-2, -1), offs, out_dtype=out_dtype)

    def run(fn):
        A.grad = W.grad = None
        out = fn(A, W)
        out.backward(go)
        return out.detach(), A.grad, W.grad

    want = run(f)
    assert all(t.abs().sum() > 0 for t in want)  # precondition: nonzero output and gradients
    torch._dynamo.reset()
    got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
