"""Cases for compute-sanitizer (memcheck / racecheck) over the byte-fingerprint kernel; each also checked against
the reference.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python scripts/sanitize_fingerprint.py [--quick]

Every tensor ends where its allocation ends (with PyTorch's caching allocator off, a read past the last byte is
a read past the allocation): 0 to 47 bytes, every tail length after whole vectors, starts 16-byte aligned,
8-byte aligned (a staged head word) and neither (all staged), grids of 1 and 8 CTAs per SM, several launches.
"""

import sys
from pathlib import Path

import torch

# Runnable as `python scripts/sanitize_fingerprint.py` from the repository root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import fingerprint as fp  # noqa: E402
from moe_quant.kernels.fingerprint import ops as ops_fingerprint  # noqa: E402


def case(n: int, offset: int, ctas_per_sm: int = 8) -> bool:
    g = torch.Generator().manual_seed(n * 31 + offset)
    host = torch.randint(0, 256, (offset + n,), generator=g, dtype=torch.uint8)
    b = host.cuda()[offset:]  # the allocation ends with the tensor
    got = int(ops_fingerprint.fingerprint_bytes(b, ctas_per_sm=ctas_per_sm))
    return got == int(fp.reference_fingerprint(host[offset:]))


def main():
    require_cuda()
    quick = "--quick" in sys.argv
    cases = [(n, off) for n in range(48) for off in (0, 1, 8, 9)]
    cases += [(16 * v + r, off) for v in (1023, 1024, 1025) for r in (0, 1, 8, 9, 15) for off in (0, 3, 8)]
    if quick:
        cases = [(0, 0), (1, 0), (17, 8), (16 * 1024 + 9, 3), (16 * 1025 + 15, 0)]
    ok = True
    for n, off in cases:
        ok &= case(n, off)
    for n, off in ((3 << 20) + 5, 0), ((3 << 20) + 11, 8):  # tiles walked by a grid of 1 CTA per SM
        ok &= case(n, off, ctas_per_sm=1)
    ops_fingerprint.MAX_LAUNCH_BYTES, ops_fingerprint.STAGE_BYTES = 4096, 1040  # several launches per tensor
    for n, off in (4097, 0), (3 * 4096 + 7, 8), (5000, 5):
        ok &= case(n, off)
    torch.cuda.synchronize()
    print(f"{len(cases) + 5} cases: {'ALL OK' if ok else 'MISMATCH'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
