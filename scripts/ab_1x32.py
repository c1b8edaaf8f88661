"""A/B of 1x32 M-groups kernel configurations in one process (same GPU, interleaved repeats).

    python scripts/ab_1x32.py [--out best.txt] [configs...]   # configs like 256x4  256x4:pf

Each config is first checked byte for byte against the reference on ragged shapes, then timed
(do_bench median, inputs rotated past L2) on a few shapes; prints % of memcpy per shape and the mean,
and writes the best config's string to --out.
"""

import argparse
import sys
from pathlib import Path

import torch

# Runnable as `python scripts/ab_1x32.py` from the repository root: put the root (moe_quant,
# benchmarks) and tests/ (the shared hypothesis strategies) on the path.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from mx_strategies import make_values, offsets_from_sizes  # noqa: E402

from benchmarks.bench_quantize import group_offsets, nbytes  # noqa: E402
from benchmarks.timing import Rotating, bench_us, memcpy_tbps, print_table, require_cuda, tbps  # noqa: E402
from moe_quant import cli, layouts, reference  # noqa: E402
from moe_quant.kernels import compile_cache, ops  # noqa: E402
from moe_quant.kernels.quantize_1x32.config import TileConfig, Variant  # noqa: E402
from moe_quant.numerics import ScaleMode  # noqa: E402

SHAPES = [(8192, 2048), (32768, 2048), (32768, 7168), (131072, 7168)]


def check(kern, m, k, sizes):
    x = make_values((m, k), "wide", m + k, torch.bfloat16)
    offs = offsets_from_sizes(sizes)
    d = torch.full((m, k), 0xFF, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full(layouts.m_groups_blocked_shape(m, k // 32, len(sizes)), 0xFF, dtype=torch.uint8, device="cuda")
    s = s.view(torch.float8_e8m0fnu)
    kern(x.cuda(), d, s, offs.cuda())
    rd, rs = reference.quantize_rowwise(x, ScaleMode.RCEIL, offs)
    return torch.equal(d.cpu().view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=cli.writable_file, default=None, help="file for the best config's string")
    p.add_argument("--reps", type=cli.positive_int, default=2)
    p.add_argument("configs", nargs="*", default=["256x4:pf", "256x4", "256x8", "512x4"])
    a = p.parse_args()
    require_cuda()
    arch = compile_cache.arch(torch.device("cuda"))
    kerns = {}
    for c in a.configs:
        kern = ops.get_kernel(Variant("bfloat16", "rceil", "mgroups", tile=TileConfig.parse(c)), arch)
        ok = all(check(kern, m, k, sz) for m, k, sz in [(1000, 224, [0, 1, 31, 33, 127, 129, 300, 200]),
                                                        (700, 160, [2] * 300), (333, 96, [150, 0, 183])])
        print(f"{c}: byte-exact vs reference: {ok}", flush=True)
        if ok:
            kerns[c] = kern
    res = {c: [] for c in kerns}
    rows = []
    for m, k in SHAPES:
        _, cp = memcpy_tbps((m, k))
        rot = Rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),))
        offs = group_offsets(m, 8, ragged=True)
        rws, cls = layouts.m_groups_blocked_shape(m, k // 32, 8)
        d = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(rws, cls, device="cuda", dtype=torch.float8_e8m0fnu)
        per = {c: [] for c in kerns}
        for _ in range(a.reps):
            for c, kern in kerns.items():
                us = bench_us(lambda: kern(rot.next()[0], d, s, offs))
                per[c].append(100 * tbps(nbytes(m, k, 8, "mxfp8"), us) / cp)
        for c in kerns:
            res[c].append(max(per[c]))
        rows.append([m, k] + [max(per[c]) for c in kerns])
        del rot
        torch.cuda.empty_cache()
    rows.append(["mean", ""] + [sum(v) / len(v) for v in res.values()])
    print_table("M-groups mxfp8 kernel, ragged G=8: % of memcpy (best of reps)", ["M", "K"] + list(kerns), rows)
    best = max(res, key=lambda c: sum(res[c]))
    print("best:", best)
    if a.out:
        open(a.out, "w").write(best)


if __name__ == "__main__":
    main()
