"""The Python around mxfp8_grouped_mm's kernels, timed on a CPU: every CuTe-DSL kernel call and every
``torch._grouped_mm`` is replaced by nothing (an output allocation for the GEMM), so what remains is the host
work of the kernel path -- argument checks, dispatch, allocations, views, the autograd Function -- without a GPU.

    python scripts/host_glue_cpu.py [--calls 200] [--rounds 5] [--profile]
    python scripts/host_glue_cpu.py --ops [--against DIR] [--processes 6]

Prints µs per call of fwd+bwd, of the forward alone (grad mode on) and of the backward alone (graph
retained), the best batch of each round, per round. Only differences matter (the machine that launches the
kernels is slower or faster): it shows what a change to the Python saves, not what a GPU run costs, which
``python -m benchmarks.bench_host`` measures. ``--profile`` adds cProfile's top functions by own time.

``--ops``: one eager call of each quantize op instead, as ``bench_host``'s launch rows make it (256 x 256 bf16,
2 groups; the public ``quantize_1x32`` and ``quantize_32x1_k_groups``, the permute op, and ``run_quantize_1x32``,
the autograd functions' entry), on CPU tensors with compiling and launching stubbed: their checks, plans and
allocations (a CPU allocation, not a CUDA one). ``--tree DIR`` imports the ``moe_quant`` of folder ``DIR`` instead of
this checkout's; ``--against DIR`` times this checkout and ``DIR`` in ``--processes`` processes each, alternating,
and prints each op's best µs per process as median (min-max) on both sides and their ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else ROOT
sys.path.insert(0, os.path.abspath(_TREE))

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


def _ops_on_cpu():
    """``(name, call)`` of each quantize op's eager call on CPU tensors, compiling and launching stubbed (the launch
    reaches the stub's ``call``, as it would the TVM-FFI function)."""
    from moe_quant.kernels import compile_cache as cc
    from moe_quant.kernels.permute import ops as ops_permute
    from moe_quant.kernels.quantize_1x32 import ops as ops_1x32
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    cc.get_kernel = lambda variant, arch: _NoKernel()
    cc.arch = lambda device: "sm_90a"
    cc.launch = lambda kernel, x, *tensors: kernel.call(x, *tensors)  # no current-CUDA-device test
    if hasattr(cc, "CPU_STUBS"):
        cc.CPU_STUBS = True
    else:  # a tree before the ops' CUDA test read it: the same test, of a CPU tensor

        def check_device(x, fn):
            if x.device.type != "cpu":
                raise ValueError(f"{fn}: x must be on the CPU")

        ops_1x32._check_device = ops_32x1._check_device = check_device
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32)
    data = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(256, 8, dtype=torch.float8_e8m0fnu)
    counts = torch.tensor([[60, 40], [100, 56]], dtype=torch.int32)
    return [("quantize_1x32 (M-groups)", lambda: ops_1x32.quantize_1x32(x, "rceil", offs)),
            ("run_quantize_1x32 (autograd entry)", lambda: ops_1x32.run_quantize_1x32(x, "rceil", offs, "blocked")),
            ("quantize_32x1_k_groups", lambda: ops_32x1.quantize_32x1_k_groups(x, "rceil", offs)),
            ("permute_mxfp8 (blocked)", lambda: ops_permute.permute_mxfp8(data, scales, counts, "blocked"))]


def _time_ops(calls: int, rounds: int) -> dict:
    """Each op's best µs per call over ``rounds`` rounds (every op once a round)."""
    ops = _ops_on_cpu()
    best = {name: float("inf") for name, _ in ops}
    for _ in range(rounds):
        for name, fn in ops:
            best[name] = min(best[name], _best_us(fn, calls))
    return best


def _against(other: str, args) -> None:
    """This checkout and ``other`` in alternating processes (``--processes`` each; this one first in odd pairs)."""
    trees = {"this checkout": ROOT, other: other}
    got = {tree: [] for tree in trees}
    for i in range(args.processes):
        for tree in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--ops", "--json-line", "--tree", trees[tree],
                   "--calls", str(args.calls), "--rounds", str(args.rounds)]
            got[tree].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    mine, theirs = got.values()
    for name in mine[0]:
        a, b = ([r[name] for r in rs] for rs in (mine, theirs))
        print(f"{name}: this checkout {statistics.median(a):.2f} us ({min(a):.2f}-{max(a):.2f}), {other} "
              f"{statistics.median(b):.2f} us ({min(b):.2f}-{max(b):.2f}); ratio of medians "
              f"{statistics.median(a) / statistics.median(b):.3f}")


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
    p.add_argument("--ops", action="store_true", help="time each quantize op's eager call instead")
    p.add_argument("--tree", default=ROOT, help="a folder holding the moe_quant to time (default: this checkout)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="with --ops: time this checkout and DIR's moe_quant in alternating processes")
    p.add_argument("--processes", type=int, default=6, help="with --against: processes per side")
    p.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ops:
        if args.against:
            _against(args.against, args)
        elif args.json_line:
            print(json.dumps(_time_ops(args.calls, args.rounds)))
        else:
            import moe_quant

            print(f"moe_quant from {os.path.dirname(os.path.dirname(moe_quant.__file__))}")
            for name, us in _time_ops(args.calls, args.rounds).items():
                print(f"{name}: {us:.2f} us")
        return 0
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
