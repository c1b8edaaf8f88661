"""What a short kernel's time owes to the kernel before it: each quantize kernel timed alone after an L2 flush,
with a different kernel run between the flush and the timed call.

    python scripts/probes/before_kernel_probe.py [--m 2048,8192] [--r 2048] [--reps 40]

GPU only (one line and exit status 2 elsewhere). ``benchmarks.timing.bench_us`` (``do_bench``) times a call right
after its L2-flushing memset, so every timed call follows a kernel with no shared memory. Here each timed call
(CUDA events around it alone) follows, after the flush: nothing (``flush``, as ``do_bench``); another call of the
same kernel on other inputs of the same shape (``same``); a bf16 memcpy of the same bytes (``copy``, no shared
memory); a bf16 GEMM (``gemm``: what precedes a quantize kernel in training, shared memory at its maximum). A
``torch.cuda._sleep`` before the flush keeps the host ahead, so no call waits to be queued. Inputs rotate past the
L2. Kernels: a bf16 memcpy of ``(M, R)``, the 1x32 kernel (M-groups scales, G = 8 ragged), the 32x1 kernel's
K-groups form (G = 8 ragged; its default and its 64-column candidate) and its 3D form along N (E = 8). Prints
the median over ``--reps`` interleaved repetitions, µs. Used for issue 35's fixed per-call cost on the H200
(``moe_quant/kernels/quantize_32x1/NOTES.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.timing import Rotating, device_name, memcpy_call, print_table, require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402

E = 8
BEFORE = ("flush", "same", "copy", "gemm")


def kernels(m: int, r: int):
    """(name, call, context) of each timed kernel at ``(m, r)``; ``call()`` runs it on the next rotated input."""
    from benchmarks.bench_quantize import group_offsets
    from moe_quant.kernels import ops
    from moe_quant.kernels.quantize_32x1 import config as config_32x1
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    rot = Rotating(lambda: (torch.randn(m, r, device="cuda", dtype=torch.bfloat16),))
    offs = group_offsets(m, 8, ragged=True)
    copy, _ = memcpy_call((m, r), torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    c64 = config_32x1.Variant("bfloat16", "rceil", "kgroups", tile_cols=64)
    none = contextlib.nullcontext
    yield "memcpy bf16", copy, none
    yield "1x32 mgroups G=8", lambda: ops.quantize_1x32(rot.next()[0], "rceil", offs), none
    yield "32x1 kgroups G=8", lambda: ops.quantize_32x1_k_groups(rot.next()[0], "rceil", offs), none
    yield ("32x1 kgroups G=8 c64", lambda: ops.quantize_32x1_k_groups(rot.next()[0], "rceil", offs),
           lambda: ops_32x1.variant_in_place(c64, dev))
    yield "32x1 3D along N E=8", lambda: ops.quantize_3d_along_n(rot.next()[0].view(E, m // E, r), "rceil"), none


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/probes/before_kernel_probe.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=cli.positive_int_list, default=[2048, 8192])
    p.add_argument("--r", type=cli.positive_int, default=2048)
    p.add_argument("--reps", type=cli.positive_int, default=40)
    args = p.parse_args(argv)
    require_cuda(argv)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    rows = []
    for m in args.m:
        copy_other, _ = memcpy_call((m, args.r), torch.bfloat16)
        gemm = lambda: a @ a  # noqa: E731
        for name, call, ctx in kernels(m, args.r):
            before = {"flush": lambda: None, "same": call, "copy": copy_other, "gemm": gemm}
            times = {b: [] for b in BEFORE}
            with ctx():
                call()
                torch.cuda.synchronize()
                for _ in range(args.reps):
                    for b in BEFORE:
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda._sleep(100_000)
                        flush.zero_()
                        before[b]()
                        e0.record()
                        call()
                        e1.record()
                        e1.synchronize()
                        times[b].append(1e3 * e0.elapsed_time(e1))
            rows.append([m, name] + [f"{statistics.median(times[b]):.1f}" for b in BEFORE])
        torch.cuda.empty_cache()
    print_table(f"one call, µs after: the flush alone / the same kernel / a memcpy / a GEMM; R = {args.r}, median of "
                f"{args.reps} ({device_name()})", ["M", "kernel"] + list(BEFORE), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
