"""Cases for compute-sanitizer (memcheck / racecheck) over the received-rows permutation kernel; each
also checked byte for byte against the reference.

    compute-sanitizer --tool memcheck python scripts/sanitize_permute.py [--quick] [--candidate NAME ...]

Ragged blocks, a silent rank, empty experts, negative / overflowing counts, totals past M, M = 0, K = 0,
E = 0, 1024 blocks, raw fp8 / e8m0 bytes, every output kind; for the default variant and every A/B
candidate (``config_permute.CANDIDATES``: the gather, scatter and rows orders, register and cp.async staging,
several tiles per CTA, the dequant pair stores), or only the candidates named by ``--candidate`` (repeatable).
"""

import argparse
import sys
from pathlib import Path

import torch

# Runnable as `python scripts/sanitize_permute.py` from the repository root (root and tests/ on the path).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant.ep.permute import OUT_KINDS, reference_permute_received  # noqa: E402
from moe_quant.kernels import compile_cache  # noqa: E402
from moe_quant.kernels.permute import config as config_permute  # noqa: E402
from moe_quant.kernels.permute import ops as ops_permute  # noqa: E402

compile_cache.POISON_OUTPUTS = True


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def case(name, counts, m, k, seed=0) -> bool:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.randint(0, 256, (m, k // 32), generator=g, dtype=torch.uint8)
    c = torch.tensor(counts, dtype=torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32).reshape(len(counts), -1)
    ok = True
    for out in OUT_KINDS:
        for dt in ((torch.bfloat16, torch.float32) if out == "dequant" else (torch.bfloat16,)):
            got = ops_permute.permute_mxfp8(data.cuda(), scales.cuda(), c.cuda(), out, dt)
            want = reference_permute_received(data, scales, c, out=out, out_dtype=dt)
            ok &= all(same(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()
    print(f"{name:44s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description="compute-sanitizer cases of the permute kernel")
    ap.add_argument("--quick", action="store_true", help="two cases (ragged; 1024 blocks) instead of all")
    ap.add_argument("--candidate", action="append", choices=list(config_permute.CANDIDATES), metavar="NAME",
                    help="only this candidate of config_permute.CANDIDATES (repeatable; default: all)")
    args = ap.parse_args()
    require_cuda()
    quick = args.quick
    cases = [
        ("ragged, silent rank, empty expert", [[0, 0, 0, 0], [1, 31, 0, 129], [300, 33, 0, 127]], 700, 224),
        ("negative / overflowing counts, past M", [[-5, 2**31 - 1], [7, -(2**31)]], 400, 96),
        ("M=0", [[0, 0, 0]], 0, 128),
        ("K=0", [[3, 4]], 9, 0),
        ("E=0", [[]], 50, 64),
        ("1024 blocks", [[3] * 32 for _ in range(32)], 3100, 160),
        ("rows past the total", [[10, 20]], 300, 7168),
        ("K=1056: 66 chunks per row", [[13, 0, 40], [7, 2, 1]], 90, 1056),
    ]
    if quick:
        cases = [cases[0], cases[5]]
    ok = True
    dev = torch.device("cuda", torch.cuda.current_device())
    for cand in args.candidate or list(config_permute.CANDIDATES):
        fields = config_permute.CANDIDATES[cand]
        print(f"-- {cand}", flush=True)
        with ops_permute.variants_in_place(dev, **fields):
            for name, counts, m, k in cases:
                ok &= case(name, counts, m, k)
    print("ALL OK" if ok else "FAILURES", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
