"""What the SwiGLU block keeps on a CUDA GPU, and the reuse scope's fp8 operands read back by the kernels (issue 54).

On Hopper the block keeps x's colwise form as the 32x1 kernel's fp8 data with its K-groups scales unblocked, and
reads it back with the permute kernel's dequantization; a reuse scope keeps each weight operand as the 3-D
kernels' fp8 data with unblocked scales, read back the same way. Both must give the bits of quantizing the bf16
values directly (the fake-quantizing kernels); the CPU tests check the reference path.
"""

import math

import pytest
import torch
from mx_strategies import offsets_from_sizes

from moe_quant import mxfp8_swiglu_experts, reuse_quantized_weights
from moe_quant import layouts

pytestmark = pytest.mark.gpu


def block_inputs(sizes, d, h, w_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, m = len(sizes), sum(sizes)
    x = torch.randn(m, d, generator=g).bfloat16().cuda().requires_grad_()
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).to(w_dtype).cuda().requires_grad_()
          for s in ((e, h, d), (e, h, d), (e, d, h))]
    gy = torch.randn(m, d, generator=g).bfloat16().cuda()
    return x, ws, gy, offsets_from_sizes(sizes, "cuda")


def step(x, ws, gy, offs):
    for t in (x, *ws):
        t.grad = None
    y = mxfp8_swiglu_experts(x, *ws, offs)
    y.backward(gy)
    return [y.detach(), x.grad] + [w.grad for w in ws]


@pytest.mark.parametrize("hold", ["bf16-fwd", "fp8", "bf16"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_reuse_scope_serves_the_bits_of_quantizing_every_time(hold, w_dtype):
    x, ws, gy, offs = block_inputs([300, 0, 129, 64], 256, 192, w_dtype)
    want = step(x, ws, gy, offs)
    with reuse_quantized_weights(ws, hold=hold) as scope:
        first = step(x, ws, gy, offs)
        again = step(x, ws, gy, offs)
    # w1, w3, w2: fwd and dgrad operands (bf16-fwd: the fwd ones, the dgrad ones made at each backward), made once,
    # served once
    held = 3 if hold == "bf16-fwd" else 6
    assert scope.hits == held and scope.misses == held
    for got in (first, again):
        for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("compiled", [None, "aot_eager", "inductor"])
def test_block_keeps_a_b_and_x_colwise_fp8_for_backward(compiled):
    """What stays allocated from the forward to the backward besides the output, with x a copy only the block
    holds (as a MoE's routed tokens): a and b (bf16) and x's colwise form in fp8 with its scales and padded
    offsets; not x, not h. Compiled the same (the block's custom ops)."""
    sizes, d, h = [4096, 2048, 0, 2000], 512, 384
    x, ws, gy, offs = block_inputs(sizes, d, h)
    m, e = x.shape[0], len(sizes)

    def block(x, w1, w3, w2, offs):
        return mxfp8_swiglu_experts(x * 1, w1, w3, w2, offs)  # a copy only the block could keep

    if compiled:
        torch._dynamo.reset()
        block = torch.compile(block, fullgraph=True, backend=compiled)
    x.grad = None
    block(x, *ws, offs).backward(gy)  # warm-up: kernels loaded (compiled), allocator pools made
    torch.cuda.synchronize()
    # the bytes requested of the allocator: memory_allocated counts whole blocks, and a cached block the allocator
    # hands out unsplit (its rest too small to split) is larger than the tensor in it
    requested = "requested_bytes.all.current"
    before = torch.cuda.memory_stats()[requested]
    y = block(x, *ws, offs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_stats()[requested] - before - y.untyped_storage().nbytes()
    mp = layouts.k_groups_padded_len(m, e)
    want = 2 * (m * h * 2) + d * mp + d * mp // 32 + 2 * 4 * e
    assert kept == want, (kept, want)
    assert kept < m * d * 2 + 4 * (m * h * 2)  # the bf16 block's x, a, silu(a), b, h
    y.backward(gy)


def test_compiled_block_peak_at_most_bf16_compiled():
    """The compiled block's fwd+bwd peak above its inputs (``max_memory_allocated``, as ``benchmarks.bench_block``
    measures it: x routed, inductor) is at most the compiled bf16 block's, plus the rows by which the emulated
    GEMM's colwise operands are padded (32 per expert; issue 54).

    DeepSeek-V3 16B's experts (D 2048, H 1408, E 64) with 512 rows an expert. At the backward's end both blocks
    hold y, dx, the three weight gradients, x (bf16: its colwise operand here) and grad_b (its colwise form):
    ``M (6D + 2H) + 3 E D H 2`` bytes, 1.49 GiB, bf16's peak; the fused block's GEMMs before it stay below that
    at this size (its dx GEMMs: ``M (7D + D/32 + 4H + H/16) + 2 E D H 2``, 1.30 GiB, with grad_a's and grad_b's colwise
    forms in fp8, ``dswiglu_cols_fp8``; 1.39 GiB, ``6H`` for ``4H + H/16``, with them in bf16; at 1536 rows an expert the
    dx GEMMs are its peak, above bf16's). With one op for the whole backward, a, b and x's kept fp8 form (``M (4H + D + D/32)``, 0.24 GiB)
    lived until that op returned, past the weight gradients' GEMMs: 1.73 GiB."""
    from benchmarks.bench_block import bf16_block, compiled, make_inputs, step_fn
    from benchmarks.timing import peak_memory_bytes

    d, h, e, m = 2048, 1408, 64, 64 * 512
    args = make_inputs(m, d, h, e, "cuda")
    peaks = {}
    for name, fn in (("bf16", bf16_block), ("fused", mxfp8_swiglu_experts)):
        torch._dynamo.reset()
        step = step_fn(compiled(fn), *args, routed=True)
        step()
        step()  # warm-up: compiled, allocator pools made
        peaks[name] = peak_memory_bytes(step)
    padded_rows = layouts.k_groups_padded_len(m, e) - m
    slack = padded_rows * (2 * d + 2 * h) + (2 << 20)  # x's and grad_b's colwise operands' padding; rounding
    assert peaks["fused"] <= peaks["bf16"] + slack, {k: v / 2**30 for k, v in peaks.items()}


@pytest.mark.parametrize("variant", ["unfused", "fused", "fused-fp8cols"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_cpu_model_predicts_the_cuda_peak(variant, mode):
    """``benchmarks.block_peak`` (the CPU allocator's events, each quantization pass's temporaries left out) gives
    the CUDA fwd+bwd peak of the per-GEMM path and of the fused block, eager and compiled (inductor on both), at the
    same shape: the bytes requested of the CUDA allocator above the inputs, x routed, as
    ``benchmarks.bench_block`` steps it. What docs/limitations.md derives from that model (issue 54) holds on the
    GPU; the per-GEMM path's peak there is ``3X + 3Hh + 3W`` eager (w3's dgrad GEMM: x alive, held by w1's GEMM)."""
    from benchmarks import block_peak
    from benchmarks.bench_block import make_inputs, step_fn

    d, h, e, rows = 512, 384, 4, 512
    m = e * rows
    fn = block_peak.VARIANTS[variant]
    model = block_peak.step_peak(block_peak.compiled(fn, "inductor") if mode == "compiled" else fn, m, d, h, e)
    torch._dynamo.reset()
    step = step_fn(torch.compile(fn, fullgraph=True) if mode == "compiled" else fn, *make_inputs(m, d, h, e, "cuda"),
                   routed=True)
    step()
    step()  # warm-up: compiled, kernels loaded
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - before
    assert abs(peak - model.bytes) <= 0.02 * model.bytes + (256 << 10), (peak, model.bytes, model.stage)
