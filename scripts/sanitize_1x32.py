"""Cases for compute-sanitizer (memcheck / racecheck) over the 1x32 kernel; each also checked byte for byte.

    compute-sanitizer --tool memcheck python scripts/sanitize_1x32.py [--quick]

Ragged groups, offsets past M / negative / decreasing, G = 0, M = 0, G > one table pass,
no-group blocked and plain layouts, fake-quant; bf16 and fp32 inputs.
"""

import sys
from pathlib import Path

import torch

# Runnable as `python scripts/sanitize_1x32.py` from the repository root: put the root (moe_quant,
# benchmarks) and tests/ (the shared hypothesis strategies) on the path.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from mx_strategies import make_values, offsets_from_sizes  # noqa: E402

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import layouts, reference  # noqa: E402
from moe_quant.kernels import compile_cache, ops  # noqa: E402
from moe_quant.numerics import ScaleMode  # noqa: E402

compile_cache.POISON_OUTPUTS = True


def run_case(name, m, k, offs_list, layout="blocked", dtype=torch.bfloat16, mode=ScaleMode.RCEIL, fake=False):
    if m * k == 0:
        x_cpu = torch.zeros(m, k, dtype=dtype)
    else:
        x_cpu = make_values((m, k), "nan_inf" if m % 3 == 0 else "wide", m * 7 + k, dtype)
    x = x_cpu.cuda()
    if fake:
        got = ops.fake_quantize_1x32(x, mode)
        want = reference.fake_quantize_rowwise(x_cpu, mode)
        ok = torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    else:
        offs_cpu = None if offs_list is None else torch.tensor(offs_list, dtype=torch.int32)
        d, s = ops.quantize_1x32(x, mode, None if offs_cpu is None else offs_cpu.cuda(), scale_layout=layout)
        rd, rs = reference.quantize_rowwise(x_cpu, mode, offs_cpu)
        if offs_cpu is None and layout == "blocked":
            rs = layouts.to_blocked(rs)
        ok = torch.equal(d.cpu().view(torch.uint8), rd.view(torch.uint8)) and torch.equal(
            s.cpu().view(torch.uint8), rs.view(torch.uint8)
        )
    torch.cuda.synchronize()
    print(f"{name:40s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def main():
    require_cuda()
    quick = "--quick" in sys.argv
    cases = [
        ("ragged groups", 1000, 224, offsets_from_sizes([0, 1, 31, 33, 127, 129, 300, 200]).tolist()),
        ("offs past M, decreasing, negative", 500, 96, [100, 700, 50, -5, 10**6, 499]),
        ("G=0", 300, 64, []),
        ("M=0 with groups", 0, 128, [0, 0, 0]),
        ("G=300 (two table passes)", 700, 160, offsets_from_sizes([2] * 300).tolist()),
    ]
    if quick:
        cases = [cases[1], cases[4]]
    ok = True
    for name, m, k, offs in cases:
        ok &= run_case(name, m, k, offs)
    if not quick:
        ok &= run_case("no groups blocked M%128!=0", 333, 96, None, "blocked")
        ok &= run_case("plain fp32 floor", 257, 160, None, "plain", torch.float32, ScaleMode.FLOOR)
        ok &= run_case("ragged fp32", 400, 544, [150, 151, 399], "blocked", torch.float32)
        ok &= run_case("fake bf16", 129, 96, None, fake=True)
        ok &= run_case("fake fp32 in", 65, 2048, None, dtype=torch.float32, fake=True)
    print("ALL OK" if ok else "FAILURES", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
