"""Which code ``dual``'s ``cols_fp8`` variant (the block's forward on the emulated GEMM: x's rowwise bf16 values and
its kept colwise form, fp8 and plain K-groups scales, in one read) should be compiled as: its default (dual's: no lean
scale formula, no packed amax, 80 registers) against the fields that sped up the SwiGLU ops, each byte-checked against
the default (itself byte-exact against the reference in the GPU suite) and timed in interleaved rounds against a bf16
memcpy (GPU).

    python scripts/probes/dual_cols_fp8_probe.py [--rounds 3]    # --rounds 0: the byte checks alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_block_kernels import op_bytes  # noqa: E402
from benchmarks.bench_quantize import group_offsets  # noqa: E402
from benchmarks.timing import (Rotating, bench_us, device_name, memcpy_call, print_table, require_cuda,  # noqa: E402
                               tbps)
from moe_quant.kernels import compile_cache as cc  # noqa: E402
from moe_quant.kernels.block import ops as ops_block  # noqa: E402
from moe_quant.kernels.block.config import Variant  # noqa: E402

BASE = Variant("dual", "bfloat16", "rceil", "bfloat16", cols_fp8=True)
CANDIDATES = {"default": {}, "lean": dict(lean=True), "pamax": dict(packed_amax=True),
              "pamax-lean": dict(lean=True, packed_amax=True), "lean-c3": dict(lean=True, ctas_per_sm=3),
              "dstage-lean": dict(lean=True, staged=True, stage_order="swizzled")}
SHAPES = [(98304, 2048, 64), (98304, 1408, 64), (16384, 7168, 8)]
CASES = [(1010, 224, [0, 1, 32, 65, 192, 321, 621, 821]), (500, 96, [100, 700, 50, -5, 10**6, 499]), (300, 64, []),
         (0, 128, [0, 0, 0]), (3100, 160, list(range(3, 3001, 3))), (700, 544, [129]), (260, 32, [257, 256])]


def run(x, offs):
    return ops_block.block_dual(x, "rceil", offs, True, cols_fp8=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    require_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    cc.POISON_OUTPUTS = True  # bytes no one writes show up
    exact = {}
    for name, kw in CANDIDATES.items():
        ok = True
        for m, r, offs_list in CASES:
            x = torch.randn(m, r, device="cuda", dtype=torch.bfloat16) * 3
            offs = torch.tensor(offs_list, dtype=torch.int32, device="cuda")
            want = run(x, offs)
            with ops_block.variant_in_place(BASE.replace(**kw), dev):
                got = run(x, offs)
            ok &= all(a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                      for a, b in zip(got, want))
        exact[name] = ok
    cc.POISON_OUTPUTS = False
    print("byte-exact against the default: " + ", ".join(f"{n} {ok}" for n, ok in exact.items()), flush=True)
    if args.rounds == 0:  # the byte checks alone (e.g. under compute-sanitizer)
        return 0 if all(exact.values()) else 1
    rows = []
    for m, r, g in SHAPES:
        offs = group_offsets(m, g, ragged=True).cuda()
        rot = Rotating(lambda: (torch.randn(m, r, device="cuda", dtype=torch.bfloat16),))
        cp, cp_bytes = memcpy_call((m, r))
        nb = op_bytes("dual", m, r, g, True, cols_fp8=True)
        pct = {name: [] for name in CANDIDATES}
        for _ in range(args.rounds):
            cp_tbps = tbps(cp_bytes, bench_us(cp))
            for name, kw in CANDIDATES.items():
                with ops_block.variant_in_place(BASE.replace(**kw), dev):
                    us = bench_us(lambda: run(rot.next()[0], offs))
                pct[name].append(100 * tbps(nb, us) / cp_tbps)
        for name in CANDIDATES:
            v = pct[name]
            rows.append([f"{m}x{r}x{g}", name, exact[name], f"{statistics.median(v):.1f}",
                         f"{min(v):.1f}-{max(v):.1f}"])
        del rot
        torch.cuda.empty_cache()
    print_table(f"dual cols_fp8 candidates, % of a bf16 memcpy, {args.rounds} interleaved rounds ({device_name()}, "
                f"torch {torch.__version__})", ["shape MxRxG", "candidate", "byte-exact", "median", "min-max"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
