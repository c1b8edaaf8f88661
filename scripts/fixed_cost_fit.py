"""Fixed per-call GPU time and streaming rate of the short-input kernels, against a memcpy's.

    python scripts/fixed_cost_fit.py [--rounds 3] [--r 2048]

GPU only (one line and exit status 2 elsewhere). Times each kernel through its op at several token counts M
(``do_bench`` with the L2 flushed, inputs rotated past the L2, median of ``--rounds``) and fits
``t = t0 + bytes / BW`` by least squares: ``t0`` is what a call costs whatever its size (launch, ramp-up,
the group table, the last wave), ``BW`` the rate once it streams. Kernels: a bf16 memcpy of ``(M, R)``, the
32x1 kernel's ``kgroups`` (wgrad operand, e4m3 out, G = 1, 8, 64 ragged) and ``uniform`` (3D weight along N,
E = 8, no group table) forms, an fp8 memcpy of ``(M, R)``, and the EP permute kernel (8 ranks x 8 experts,
blocked and dequantized outputs). Where a target is a percentage of memcpy at a small M (the 32x1 kernel at
(8192, 2048), the permute at (32768, 2048)), ``t0`` against the memcpy's says how much of the gap no
streaming improvement can close (``moe_quant/kernels/quantize_32x1/NOTES.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import Rotating, bench_us, device_name, memcpy_call, print_table, require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402

E = 8  # experts of the 3D weight form; the permute runs 8 ranks x 8 experts
Q32_M = (2048, 4096, 8192, 16384, 32768)
PERM_M = (4096, 8192, 16384, 32768, 65536, 131072)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(t0 µs, BW TB/s)`` of ``t = t0 + bytes / BW`` over ``(bytes, µs)`` points."""
    xs, ys = [b for b, _ in points], [t for _, t in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1 / slope / 1e6


def q32_cases(m: int, r: int):
    """(name, bytes, call) of the memcpy and the 32x1 forms at ``(m, r)``."""
    from benchmarks.bench_quantize import group_offsets, nbytes
    from benchmarks.bench_quantize_32x1 import k_groups_bytes, w_bytes
    from moe_quant.kernels import ops

    rot = Rotating(lambda: (torch.randn(m, r, device="cuda", dtype=torch.bfloat16),))
    copy, copy_bytes = memcpy_call((m, r), torch.bfloat16)
    yield "memcpy bf16 (M, R)", copy_bytes, copy
    for g in (1, 8, 64):
        offs = group_offsets(m, g, ragged=g > 1)
        yield (f"32x1 kgroups G={g}", k_groups_bytes(m, r, g, "mxfp8"),
               lambda offs=offs: ops.quantize_32x1_k_groups(rot.next()[0], "rceil", offs))
    yield (f"32x1 uniform E={E}", w_bytes(E, m // E, r, "n", "mxfp8"),
           lambda: ops.quantize_3d_along_n(rot.next()[0].view(E, m // E, r), "rceil"))
    offs8 = group_offsets(m, 8, ragged=True)
    yield ("1x32 mgroups G=8", nbytes(m, r, 8, "mxfp8"),
           lambda: ops.quantize_1x32(rot.next()[0], "rceil", offs8))


def perm_cases(m: int, k: int):
    """(name, bytes, call) of an fp8 memcpy and the permute kernel's outputs at ``(m, k)``."""
    from benchmarks.bench_permute import permute_bytes, ragged_counts, received_rows
    from moe_quant.kernels.permute import ops as ops_permute

    counts = ragged_counts(m, k, E, E)
    rot = Rotating(lambda: received_rows(m, k))
    copy, copy_bytes = memcpy_call((m, k), torch.uint8)
    yield "memcpy fp8 (M, K)", copy_bytes, copy
    for out in ("blocked", "dequant"):
        def run(out=out):
            data, scales = rot.next()
            ops_permute.permute_mxfp8(data, scales, counts, out, torch.bfloat16)

        yield f"permute {out}", permute_bytes(m, k, E, out), run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/fixed_cost_fit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=cli.positive_int, default=3)
    p.add_argument("--r", type=cli.positive_int, default=2048, help="columns (R of the 32x1 kernel, K of the permute)")
    args = p.parse_args(argv)
    require_cuda(argv)
    series: dict[str, dict[int, list]] = {}
    for make, ms in ((q32_cases, Q32_M), (perm_cases, PERM_M)):
        for m in ms:
            cases = list(make(m, args.r))
            for _ in range(args.rounds):  # interleaved: every kernel once per round
                for name, nbytes, call in cases:
                    call()
                    series.setdefault(name, {}).setdefault(m, []).append((nbytes, bench_us(call)))
            del cases
            torch.cuda.empty_cache()
    rows = []
    for name, per_m in series.items():
        points = [(per_m[m][0][0], statistics.median(t for _, t in per_m[m])) for m in sorted(per_m)]
        t0, bw = fit(points)
        at = "  ".join(f"{m}: {t:.1f} us {b / t / 1e6:.2f} TB/s" for m, (b, t) in zip(sorted(per_m), points))
        rows.append([name, f"{t0:.1f}", f"{bw:.2f}", at])
    print_table(f"t = t0 + bytes / BW, R = {args.r}, median of {args.rounds} rounds ({device_name()})",
                ["kernel", "t0 us", "BW TB/s", "per M: time, rate"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
