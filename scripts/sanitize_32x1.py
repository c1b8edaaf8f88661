"""Cases for compute-sanitizer (memcheck / racecheck) over the colwise 32x1 kernel and the 3D paths;
each also checked byte for byte against the reference.

    compute-sanitizer --tool memcheck python scripts/sanitize_32x1.py [--quick] [--candidate NAME]

Ragged K-groups, offsets past M / negative / decreasing, G = 0, M = 0, G = 1000, R % 128 != 0,
fake outputs, fp32 input, 3D weights along N and K (N % 128 != 0). ``--candidate NAME`` (of
``quantize_32x1.config.CANDIDATES``) runs it in place of every bf16-input variant.
"""

import contextlib
import sys
from pathlib import Path

import torch

# Runnable as `python scripts/sanitize_32x1.py` from the repository root (root and tests/ on the path).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from mx_strategies import make_values, offsets_from_sizes  # noqa: E402

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import reference  # noqa: E402
from moe_quant.kernels import compile_cache, ops  # noqa: E402
from moe_quant.numerics import ScaleMode  # noqa: E402

compile_cache.POISON_OUTPUTS = True


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def k_groups_case(name, m, r, offs_list, dtype=torch.bfloat16, mode=ScaleMode.RCEIL):
    x_cpu = torch.zeros(m, r, dtype=dtype) if m * r == 0 else make_values((m, r), "wide", m + r, dtype)
    offs_cpu = torch.tensor(offs_list, dtype=torch.int32)
    x, offs = x_cpu.cuda(), offs_cpu.cuda()
    d, s, p = ops.quantize_32x1_k_groups(x, mode, offs)
    rd, rs, rp = reference.quantize_colwise_k_groups(x_cpu, offs_cpu, mode)
    ok = same(d, rd) and same(s, rs) and same(p, rp)
    for out in (torch.float32, torch.bfloat16):  # bf16: the round_bf16 candidates' code
        v, _ = ops.fake_quantize_32x1_k_groups(x, mode, offs, out)
        ok &= same(v, reference.fake_quantize_colwise_k_groups(x_cpu, offs_cpu, mode, out)[0])
    torch.cuda.synchronize()
    print(f"{name:44s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def w_case(name, e, n, k, dtype=torch.bfloat16, mode=ScaleMode.FLOOR):
    w_cpu = make_values((e, n, k), "nan_inf", e * n + k, dtype)
    w = w_cpu.cuda()
    ok = True
    for along, q in (("n", ops.quantize_3d_along_n), ("k", ops.quantize_3d_along_k)):
        d, s = q(w, mode)
        rd, rs = reference.quantize_3d(w_cpu, mode, along)
        ok &= same(d, rd) and same(s, rs)
    ok &= same(ops.fake_quantize_3d_along_n(w, mode), reference.fake_quantize_3d(w_cpu.transpose(-2, -1), mode, -1))
    torch.cuda.synchronize()
    print(f"{name:44s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def candidate_in_place(stack: contextlib.ExitStack, name: str) -> None:
    """Every bf16-input 32x1 variant launches candidate ``name`` instead (``ops_32x1.variant_in_place``)."""
    from moe_quant.kernels.quantize_32x1 import config, ops as ops_32x1

    if name not in config.CANDIDATES:
        raise SystemExit(f"--candidate must be one of {sorted(config.CANDIDATES)}, got {name!r}")
    dev = torch.device("cuda", torch.cuda.current_device())
    for v in config.all_variants():
        if v.in_dtype == "bfloat16":  # the candidate's fields that apply to v (config.with_candidate)
            stack.enter_context(ops_32x1.variant_in_place(config.with_candidate(v, config.CANDIDATES[name]), dev))
    print(f"candidate {name} in place of the bf16 variants", flush=True)


def main():
    require_cuda()
    quick = "--quick" in sys.argv
    with contextlib.ExitStack() as stack:
        if "--candidate" in sys.argv:
            candidate_in_place(stack, sys.argv[sys.argv.index("--candidate") + 1])
        run(quick)


def run(quick: bool):
    cases = [
        ("ragged groups", 1000, 224, offsets_from_sizes([0, 1, 31, 33, 127, 129, 300, 200]).tolist()),
        ("offs past M, decreasing, negative", 500, 96, [100, 700, 50, -5, 10**6, 499]),
        ("G=0", 300, 64, []),
        ("M=0 with groups", 0, 128, [0, 0, 0]),
        ("G=1000", 3100, 160, offsets_from_sizes([3] * 1000).tolist()),
        ("R=2144: column tiles past a CTA's group", 900, 2144, offsets_from_sizes([5, 0, 400, 129, 300]).tolist()),
    ]
    if quick:
        cases = [cases[1], cases[4]]
    ok = True
    for name, m, r, offs in cases:
        ok &= k_groups_case(name, m, r, offs)
    if not quick:
        ok &= k_groups_case("fp32 input, floor", 400, 544, [150, 151, 399], torch.float32, ScaleMode.FLOOR)
        ok &= w_case("3D E=3 N=160 K=96 (N % 128 != 0)", 3, 160, 96)
        ok &= w_case("3D fp32 E=2 N=256 K=64", 2, 256, 64, torch.float32, ScaleMode.RCEIL)
    print("ALL OK" if ok else "FAILURES", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
