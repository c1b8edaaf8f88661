"""Cases for compute-sanitizer (memcheck / racecheck) over the SwiGLU block's fused kernels (``dual``,
``swiglu``, ``dswiglu``; fp8 and bf16 outputs; the stacked dSwiGLU outputs of a concatenated gate-up weight);
each also checked byte for byte against the reference.

    compute-sanitizer --tool memcheck python scripts/sanitize_block.py [--quick] [--candidate NAME] [--cols-fp8]

Ragged groups, offsets past M / negative / decreasing, G = 0, M = 0, G = 1000, R % 128 != 0, rows past the
last group. Without ``--candidate`` every op runs its default variants (since 2026-12-02: swiglu and dswiglu lean,
dswiglu's two outputs in one CTA; since 2026-12-03 their signed residual, bf16 outputs rounded on the packed words,
fp8 outputs' flat scale stores), and dswiglu its ``cols_fp8`` variants (bf16 rowwise, fp8 colwise forms: the block's
backward on the emulated GEMM since 2026-12-03), stacked and not, swiglu its one-form variants (``forms`` rows and
cols: the block's forward and backward since 2026-12-03 (late)) and dual its ``cols_fp8`` variants (the block's forward on the
emulated GEMM); ``--candidate`` leaves those as they are. ``--candidate NAME`` (of ``block.config.candidates``, e.g. ``pre-round``, the
SwiGLU ops' former default with bf16 outputs): every block variant that has that A/B candidate launches it instead
(``ops.candidate_in_place``). ``--cols-fp8``: the ``cols_fp8`` variants alone (their plain K-groups scales since
issue 54's follow-up).
"""

import contextlib
import sys
from pathlib import Path

import torch

# Runnable as `python scripts/sanitize_block.py` from the repository root (root and tests/ on the path).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from mx_strategies import make_values, offsets_from_sizes  # noqa: E402

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import block_quantize as bq  # noqa: E402
from moe_quant import layouts, reference  # noqa: E402
from moe_quant.kernels import compile_cache  # noqa: E402
from moe_quant.kernels.block import ops as ops_block  # noqa: E402
from moe_quant.numerics import ScaleMode  # noqa: E402

compile_cache.POISON_OUTPUTS = True


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_forms(got, want) -> bool:
    return len(got) == len(want) and all(len(g) == len(w) and all(same(a, b) for a, b in zip(g, w))
                                         for g, w in zip(got, want))


def cols_fp8_case(g, a, b, mode, offs, clean) -> bool:
    """dswiglu's cols_fp8 variants (the block's backward on the emulated GEMM), unstacked and stacked: bf16 rowwise
    values, fp8 colwise data and plain K-groups scales (colwise_kept's form), against the reference's."""
    (ra, fa), (rb, fb) = (bq._separate_forms(t.cpu(), mode, clean, True, cols_fp8=True)
                          for t in reference.dswiglu(g, a, b))
    outs = ops_block.block_dswiglu(g, a, b, mode, offs, True, cols_fp8=True)
    ok = len(outs) == 7 and same_forms([outs[0:1], outs[1:3], outs[3:4], outs[4:6], outs[6:]],
                                       [ra, fa[:2], rb, fb[:2], fa[2:]])
    row, col, scales, poffs = ops_block.block_dswiglu(g, a, b, mode, offs, True, stacked=True, cols_fp8=True)
    ok &= same(row, torch.cat([ra[0], rb[0]], dim=1)) and same(col, torch.cat([fa[0], fb[0]]))
    return ok and same(scales, torch.cat([fa[1], fb[1]])) and same(poffs, fa[2])


def case(name, m, r, offs_list, mode=ScaleMode.RCEIL):
    offs_cpu = torch.tensor(offs_list, dtype=torch.int32)
    offs = offs_cpu.cuda()
    clean = layouts.sanitize_offsets(offs_cpu, m).to(torch.int32)
    g, a, b = ((torch.zeros(m, r) if m * r == 0 else make_values((m, r), "wide", m + r + i)).bfloat16().cuda()
               for i in range(3))
    ok = cols_fp8_case(g, a, b, mode, offs, clean)
    for fake in (() if "--cols-fp8" in sys.argv else (False, True)):
        got = bq._kernel_forms(ops_block.block_dual(g, mode, offs, fake), fake)[0]
        ok &= same_forms(got, bq._separate_forms(g.cpu(), mode, clean, fake))
        got = bq._kernel_forms(ops_block.block_swiglu(a, b, mode, offs, fake), fake)[0]
        w_row, w_col = bq._separate_forms(reference.swiglu(a, b).cpu(), mode, clean, fake)
        ok &= same_forms(got, (w_row, w_col))
        # one form alone (the block's forward: rowwise, its backward: colwise), then poffs
        ok &= same_forms([ops_block.block_swiglu(a, b, mode, offs, fake, forms="rows")], [(*w_row, w_col[-1])])
        ok &= same_forms([ops_block.block_swiglu(a, b, mode, offs, fake, forms="cols")], [w_col])
        if fake:  # dual's cols_fp8: x's rowwise values and its kept colwise form (fp8, plain scales) in one read
            x_row, x_kept = bq._separate_forms(g.cpu(), mode, clean, True, cols_fp8=True)
            ok &= same_forms([ops_block.block_dual(g, mode, offs, True, cols_fp8=True)], [(*x_row, *x_kept)])
        got_a, got_b = bq._kernel_forms(ops_block.block_dswiglu(g, a, b, mode, offs, fake), fake)
        grad_a, grad_b = reference.dswiglu(g, a, b)
        (ra, ca), (rb, cb) = (bq._separate_forms(t.cpu(), mode, clean, fake) for t in (grad_a, grad_b))
        ok &= same_forms(got_a, (ra, ca)) and same_forms(got_b, (rb, cb))
        if fake:  # [grad_a | grad_b] in one (M, 2R) rowwise buffer (row pitch 2R) and one (2R, Mp) colwise buffer
            row, col, poffs = ops_block.block_dswiglu(g, a, b, mode, offs, True, stacked=True)
            ok &= same(row, torch.cat([ra[0], rb[0]], dim=1)) and same(col, torch.cat([ca[0], cb[0]]))
            ok &= same(poffs, ca[1])
    torch.cuda.synchronize()
    print(f"{name:44s} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def main():
    require_cuda()
    with contextlib.ExitStack() as stack:
        if "--candidate" in sys.argv:
            name = sys.argv[sys.argv.index("--candidate") + 1]
            served = ops_block.candidate_in_place(stack, name, torch.device("cuda", torch.cuda.current_device()))
            if not served:
                raise SystemExit(f"--candidate: no block op has a candidate {name!r}")
            print(f"candidate {name} in place of {', '.join(served)}", flush=True)
        run_cases()


def run_cases():
    quick = "--quick" in sys.argv
    cases = [
        ("ragged groups, rows past the end", 1010, 224, offsets_from_sizes([0, 1, 31, 33, 127, 129, 300, 200]).tolist()),
        ("offs past M, decreasing, negative", 500, 96, [100, 700, 50, -5, 10**6, 499]),
        ("G=0", 300, 64, []),
        ("M=0 with groups", 0, 128, [0, 0, 0]),
        ("G=1000", 3100, 160, offsets_from_sizes([3] * 1000).tolist()),
    ]
    if quick:
        cases = [cases[1], cases[4]]
    ok = True
    for name, m, r, offs in cases:
        ok &= case(name, m, r, offs)
    if not quick:
        ok &= case("floor, R % 128 != 0", 400, 544, [150, 151, 399], ScaleMode.FLOOR)
    print("ALL OK" if ok else "FAILURES", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
