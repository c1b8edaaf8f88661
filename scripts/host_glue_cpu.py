"""The Python around mxfp8_grouped_mm's kernels, timed on a CPU: every CuTe-DSL kernel call and every
``torch._grouped_mm`` is replaced by nothing (an output allocation for the GEMM), so what remains is the host
work of the kernel path -- argument checks, dispatch, allocations, views, the autograd Function -- without a GPU.

    python scripts/host_glue_cpu.py [--calls 200] [--rounds 5] [--profile]

Prints µs per call of fwd+bwd, of the forward alone (grad mode on) and of the backward alone (graph
retained), the best batch of each round, per round. Only differences matter (the machine that launches the
kernels is slower or faster): it shows what a change to the Python saves, not what a GPU run costs, which
``python -m benchmarks.bench_host`` measures. ``--profile`` adds cProfile's top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


class _NoKernel:
    """A compiled kernel that launches nothing (the TVM-FFI calling convention: the tensors, in order)."""

    tvm = True

    def __call__(self, *tensors):
        pass

    call = __call__


def _kernel_path_without_kernels():
    """Route mxfp8_grouped_mm's CPU calls through the kernel path (as on an H100: emulated GEMM, kernels
    quantize) with no-op kernels and allocation-only GEMMs."""
    import moe_quant.autograd.grouped_mm as gm
    from moe_quant import backends
    from moe_quant.kernels import compile_cache as cc
    from moe_quant.kernels.quantize_1x32 import ops as ops_1x32
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    backends.use_quant_kernels = lambda x: True
    gm.grouped_mm_zero_fills_empty_groups = lambda device: True  # as on Hopper
    cc.get_kernel = lambda variant, arch: _NoKernel()
    cc.arch = lambda device: "sm_90a"
    cc.launch = lambda kernel, x, *tensors: kernel(x, *tensors)  # no current-CUDA-device test
    for mod in (ops_1x32, ops_32x1):  # the public 3D checks want CUDA tensors; the GEMM path skips them
        mod._check_w = lambda w, fn, dims=None: None

    def grouped_mm(a, b, offs=None):
        if b.dim() == 3:  # (M, K) x (E, K, N): forward and dgrad
            return torch.empty((a.shape[0], b.shape[-1]), dtype=torch.bfloat16)
        return torch.empty((offs.shape[0], a.shape[0], b.shape[-1]), dtype=torch.bfloat16)  # wgrad (E, N, K)

    torch._grouped_mm = grouped_mm


def _best_us(fn, calls: int, batches: int = 7) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = p.parse_args(argv)
    _kernel_path_without_kernels()
    from moe_quant import mxfp8_grouped_mm

    m, k, n, e = 256, 256, 256, 8
    A = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(e, n, k, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, e + 1, dtype=torch.int32) * (m // e)
    grad = torch.randn(m, n, dtype=torch.bfloat16)

    def fwd():
        return mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, validate_offsets=False)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (A, W), grad)

    out = fwd()

    def bwd():
        torch.autograd.grad(out, (A, W), grad, retain_graph=True)

    for r in range(args.rounds):
        print(f"round {r}: fwd+bwd {_best_us(fwd_bwd, args.calls):.1f} us, fwd {_best_us(fwd, args.calls):.1f} us, "
              f"bwd {_best_us(bwd, args.calls):.1f} us", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fwd_bwd()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
