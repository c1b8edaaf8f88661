"""mxfp8_grouped_mm on a CUDA GPU: accuracy, agreement with the CPU path, no host synchronization."""

import math

import pytest
import torch
from mx_strategies import offsets_from_sizes

from moe_quant import mxfp8_grouped_mm
from moe_quant.numerics import ScaleMode

pytestmark = pytest.mark.gpu


def sqnr(x, ref):
    x, ref = x.double(), ref.double()
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


def problem(sizes, k, n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    A = torch.randn(m, k, generator=g).to(torch.bfloat16)
    W = (torch.randn(len(sizes), n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16)
    go = torch.randn(m, n, generator=g).to(torch.bfloat16)
    A, W = A.to(device).requires_grad_(), W.to(device).requires_grad_()
    return A, W, go.to(device), offsets_from_sizes(sizes, device)


def fwd_bwd(A, W, go, offs, **kw):
    A.grad = W.grad = None
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, **kw)
    out.backward(go.to(out.dtype))
    return out.detach(), A.grad, W.grad


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_cuda_matches_cpu_and_bf16(mode):
    sizes = [0, 1, 31, 33, 127, 129, 300, 0, 511]
    A, W, go, offs = problem(sizes, 256, 128, "cuda")
    out, dA, dW = fwd_bwd(A, W, go, offs, scale_mode=mode)
    Ac, Wc, goc, offsc = problem(sizes, 256, 128, "cpu")
    c_out, c_dA, c_dW = fwd_bwd(Ac, Wc, goc, offsc, scale_mode=mode)
    # same quantized operands on both devices; GEMM accumulation order may differ
    tol = dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.cpu().float(), c_out.float(), **tol)
    torch.testing.assert_close(dA.cpu().float(), c_dA.float(), **tol)
    torch.testing.assert_close(dW.cpu().float(), c_dW.float(), **tol)
    A.grad = W.grad = None
    r_out = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs)
    r_out.backward(go)
    assert sqnr(out, r_out) >= 27 and sqnr(dA, A.grad) >= 25 and sqnr(dW, W.grad) >= 24
    assert bool((dW[0] == 0).all()) and bool((dW[7] == 0).all())


def test_no_host_device_sync_in_fwd_bwd():
    A, W, go, offs = problem([100, 0, 412, 512], 512, 256, "cuda")
    fwd_bwd(A, W, go, offs)  # warm up: kernel compilation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(A, W, go, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_garbage_offsets_on_gpu_do_not_fault():
    A, W, go, offs = problem([64, 64, 128], 128, 64, "cuda")
    for bad in ([300, 10, 256], [-7, 99999, 5], [256, 256, 256]):
        out, dA, dW = fwd_bwd(A, W, go, torch.tensor(bad, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        assert bool(dW.isfinite().all())



def test_empty_experts_get_exact_zero_gradient_from_recycled_memory():
    """On Hopper the emulated wgrad relies on torch._grouped_mm writing zeros for empty groups
    (backends.grouped_mm_zero_fills_empty_groups): check it on memory the allocator recycles from a
    NaN-filled block, for the plain op and through mxfp8_grouped_mm."""
    from moe_quant import backends

    sizes = [0, 64, 0, 96, 32, 0]
    A, W, go, offs = problem(sizes, 256, 128, "cuda")
    for _ in range(3):
        junk = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MB, then back to the cache
        del junk
        _, _, dW = fwd_bwd(A, W, go, offs)
        assert dW.isfinite().all()
        for e, size in enumerate(sizes):
            if size == 0:
                assert bool((dW[e] == 0).all()), f"expert {e}: {dW[e].abs().max()}"
        junk = torch.full((64 << 20,), float("nan"), device="cuda")
        del junk
        a_t = A.detach().t().contiguous().t()  # (M, K) with tokens contiguous, as the wgrad operands
        raw = torch._grouped_mm(go.t(), a_t, offs=offs)  # (E, N, K)
        if backends.grouped_mm_zero_fills_empty_groups(A.device):
            for e, size in enumerate(sizes):
                if size == 0:
                    assert bool((raw[e] == 0).all()), f"torch._grouped_mm left expert {e} unwritten"


@pytest.mark.parametrize("scale_mode", list(ScaleMode))
@pytest.mark.parametrize("offs_values", [[0, 0, 0, 0], [0, 3, 7, 7]])  # EP rank without tokens; offsets past M
def test_no_tokens_forward_and_backward(scale_mode, offs_values):
    """An expert layer that receives no tokens (expert parallelism): M = 0, and the gradient of
    ``out.float().sum()`` is an expanded zero-element tensor (strides 0) that the 32x1 kernel used to reject."""
    A = torch.randn(0, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(offs_values, dtype=torch.int32, device="cuda")
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, scale_mode=scale_mode)
    assert out.shape == (0, 128)
    out.float().sum().backward()
    torch.cuda.synchronize()
    assert A.grad.shape == (0, 256)
    assert W.grad.shape == (4, 128, 256) and not W.grad.any()


def test_kernel_ops_take_expanded_zero_element_inputs():
    from moe_quant.kernels import ops

    x = torch.zeros((), device="cuda", dtype=torch.bfloat16).expand(0, 64)
    offs = torch.zeros(3, dtype=torch.int32, device="cuda")
    data, scales, poffs = ops.quantize_32x1_k_groups(x, "rceil", offs)
    assert data.shape[0] == 64 and poffs.tolist() == [0, 0, 0]
    d, s = ops.quantize_1x32(x, "rceil", offs, scale_layout="blocked")
    assert d.shape == (0, 64)
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_compiled_fwd_bwd_equals_eager(backend, w_dtype):
    """``torch.compile(fullgraph=True)`` of the per-GEMM path on the GPU with gradients: output, dA and dW equal
    eager's bit for bit. Regression: with torch 2.11 the traced backward got a zero output gradient (the forward
    returned ``out.to(out_dtype)``, an alias of ``out``), so every gradient was zero and torchtitan's per-GEMM
    experts did not learn."""
    sizes = [0, 100, 31, 257, 128]
    A, W, go, offs = problem(sizes, 256, 192, "cuda", seed=3)
    W = W.detach().to(w_dtype).requires_grad_()
    want = fwd_bwd(A, W, go, offs)
    assert all(t.abs().sum() > 0 for t in want)  # precondition: nonzero output and gradients

    def f(a, w, o):
        return mxfp8_grouped_mm(a, w.transpose(-2, -1), o)

    torch._dynamo.reset()
    A.grad = W.grad = None
    out = torch.compile(f, backend=backend, fullgraph=True)(A, W, offs)
    out.backward(go)
    got = (out.detach(), A.grad, W.grad)
    m = offs[-1].item()
    for name, a, b in zip(("out", "dA", "dW"), got, want):
        if name != "dW":
            a, b = a[:m], b[:m]  # rows past offs[-1] are unspecified
        assert a.dtype == b.dtype and torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


class _CastLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of the fp32 -> bf16 copies made while active."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst_dtype = kwargs.get("dtype") if func is torch.ops.aten._to_copy.default else args[0].dtype
            if src.dtype == torch.float32 and dst_dtype == torch.bfloat16:
                self.casts.append(tuple(src.shape))
        return func(*args, **kwargs)


def test_fp32_master_weights_quantized_without_a_bf16_copy():
    """fp32 weights (torchtitan's single-GPU and autocast master weights) are quantized as their bf16 rounding by
    the kernels themselves: output and gradients equal those of the same weights cast to bf16 by torch (dW is
    the bf16 weight's gradient, widened), for the per-GEMM GEMM and the SwiGLU block, and no fp32 -> bf16 copy
    of a weight is made (the cast's copy was 6 bytes per element read and written, twice per weight per step)."""
    from moe_quant import mxfp8_swiglu_experts

    sizes = [0, 100, 31, 257, 128]
    A, W16, go, offs = problem(sizes, 256, 192, "cuda", seed=4)
    # off the bf16 grid: the weights' low 16 bits random, so their bf16 rounding is not their truncation
    g = torch.Generator(device="cuda").manual_seed(5)
    low = torch.randint(0, 1 << 16, W16.shape, device="cuda", generator=g, dtype=torch.int32)
    W32 = ((W16.detach().float().view(torch.int32) & ~0xFFFF) | low).view(torch.float32).requires_grad_()
    W16 = W32.detach().to(torch.bfloat16).requires_grad_()
    assert not torch.equal(W16.detach().float(), W32.detach())  # precondition: fp32 values not bf16 values

    want = fwd_bwd(A, W16, go, offs)
    fwd_bwd(A, W32, go, offs)  # warm-up (kernel compilation)
    with _CastLog() as log:
        got = fwd_bwd(A, W32, go, offs)
    assert W32.shape not in log.casts and W32.transpose(-2, -1).shape not in log.casts, log.casts
    m = offs[-1].item()
    assert torch.equal(got[0][:m], want[0][:m]) and torch.equal(got[1][:m], want[1][:m])
    assert got[2].dtype == torch.float32 and torch.equal(got[2], want[2].float())

    # the SwiGLU block: w1, w3 (E, H, D), w2 (E, D, H), fp32 against their bf16 casts
    e, d, h = len(sizes), 256, 128
    ws32 = [(torch.randn(e, *s, device="cuda", generator=g) * 0.05).requires_grad_() for s in ((h, d), (h, d), (d, h))]
    ws16 = [w.detach().to(torch.bfloat16).requires_grad_() for w in ws32]
    x = A.detach().requires_grad_()
    gy = torch.randn(x.shape[0], d, device="cuda", generator=g).bfloat16()

    def run(ws):
        x.grad = None
        for w in ws:
            w.grad = None
        y = mxfp8_swiglu_experts(x, *ws, offs)
        y.backward(gy)
        return [y.detach()[:m], x.grad[:m]] + [w.grad for w in ws]

    want = run(ws16)
    run(ws32)
    with _CastLog() as log:
        got = run(ws32)
    assert not any(w.shape in log.casts or w.transpose(-2, -1).shape in log.casts for w in ws32), log.casts
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b.float() if i >= 2 else b), i


@pytest.mark.parametrize("carveout", [8, 32])
def test_sm_carveout_changes_no_bit(carveout):
    """The EP pipeline's ``sm_carveout`` (moe_quant.ep.pipeline.SmWindow) makes torch's GEMMs target fewer SMs:
    the MXFP8 grouped GEMM's forward and both gradients keep every bit, large enough that the GEMMs' grid
    depends on the SM count (more tiles than SMs)."""
    sizes = [1024, 0, 3000, 2048, 77]
    A, W, go, offs = problem(sizes, 2048, 1024, "cuda", seed=7)
    ref = [t.clone() for t in fwd_bwd(A, W, go, offs)]
    assert torch._C._get_sm_carveout_experimental() is None
    try:
        torch._C._set_sm_carveout_experimental(carveout)
        got = fwd_bwd(A, W, go, offs)
    finally:
        torch._C._set_sm_carveout_experimental(None)
    for r, g in zip(ref, got):
        assert torch.equal(r.view(torch.int16), g.view(torch.int16))


def test_sm_carveout_leaving_no_sm_is_refused():
    from moe_quant.ep import MXFP8TokenDispatcher

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = MXFP8TokenDispatcher(4, 2, transport="p2p", chunks=2, sm_carveout=sms)
    with pytest.raises(ValueError, match="sm_carveout"):
        d._carveout(torch.zeros(1, device="cuda"))
    assert MXFP8TokenDispatcher(4, 2, transport="p2p", chunks=2, sm_carveout=sms - 1)._carveout(
        torch.zeros(1, device="cuda")) == sms - 1
