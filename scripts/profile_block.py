"""Where the GPU time of the SwiGLU expert block goes: a torch.profiler kernel table of one bf16 step, one
fused MXFP8 step and one ``reuse_quantized_weights`` step of several micro-batches (per micro-batch).

    python scripts/profile_block.py [--shape dsv3|llama4] [--m 16384] [--micro-batches 4] [--top 25]

GPU only (one line and exit status 2 elsewhere). Prints, per variant, the CUDA time of every kernel
(summed over the step, divided by its micro-batches) and of each kernel family (moe_quant's quantization
kernels by class, the GEMMs, the rest), the step's wall time between CUDA events, and the host (CPU) time
the step's Python takes to enqueue its work (a GPU that idles while the host is behind shows as wall time
above the kernels' sum). With ``--experts 64`` at M = 16384 (DeepSeek-V3's expert count, 256 rows per expert)
each weight is eight times x, so the 1x32 and 32x1 rows are mostly the weights' passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from the repository root as documented
from benchmarks.bench_block import SHAPES, VARIANTS, make_inputs, step_fn  # noqa: E402
from moe_quant import cli  # noqa: E402


# moe_quant's kernel families by the class each CuTe-DSL kernel is named after (at M = 16384 with 64 experts the
# weights' passes are the bulk of the 1x32 and 32x1 rows: each weight is as large as x)
FAMILIES = (("quantize 1x32 (x rowwise; weights along K)", "Quantize1x32"),
            ("quantize 32x1 (x colwise; weights along N)", "Quantize32x1"),
            ("block passes (dual, swiglu, dswiglu)", "QuantizeBlock"), ("byte fingerprint (reuse)", "Fingerprint"))


def kernel_family(name: str) -> str:
    """The family a CUDA kernel's name belongs to (:data:`FAMILIES`; the GEMMs by the layer breakdown's marks,
    ``bench_grouped_mm.GEMM_MARKS``; else "other": elementwise, copies)."""
    from benchmarks.bench_grouped_mm import GEMM_MARKS

    for fam, marker in FAMILIES:
        if marker in name:
            return fam
    return "GEMMs" if any(m in name.lower() for m in GEMM_MARKS) else "other"


def profile(fn, micro_batches: int, top: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3 / micro_batches  # CPU time to enqueue the step
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / micro_batches
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    families = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            for table, key in ((kernels, ev.name[:90]), (families, kernel_family(ev.name))):
                us, n = table.get(key, (0.0, 0))
                table[key] = (us + ev.device_time / micro_batches, n + 1)
    total = sum(us for us, _ in kernels.values())
    lines = [f"  wall {wall:.3f} ms per micro-batch, kernels {total / 1e3:.3f} ms (idle {wall - total / 1e3:.3f} ms), "
             f"host {host:.3f} ms"]
    lines.append("  by family: " + ", ".join(f"{fam} {us / 1e3:.3f} ms ({n / micro_batches:.0f}x)"
                                            for fam, (us, n) in sorted(families.items(), key=lambda kv: -kv[1][0])))
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  {n / micro_batches:5.1f}x  {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="profile_block.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="dsv3")
    p.add_argument("--m", type=cli.positive_int, default=16384)
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument("--micro-batches", type=cli.positive_int, default=4)
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=["bf16", "fused", "fused+reuse"])
    p.add_argument("--top", type=cli.positive_int, default=25)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    d, h = SHAPES[args.shape]
    inputs = make_inputs(args.m, d, h, args.experts, device)
    for v in args.variants:
        mb = args.micro_batches if v.endswith("+reuse") else 1
        print(f"{v} ({args.shape}, M={args.m}, micro-batches {mb})", flush=True)
        print(profile(step_fn(VARIANTS[v], *inputs, micro_batches=mb), mb, args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
