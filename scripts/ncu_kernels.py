"""One warm call of each short-input kernel inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include 'q32_kgroups/' --nvtx-include 'q32_uniform/' --nvtx-include 'copy/' \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \\
        python scripts/ncu_kernels.py [--m 8192] [--r 2048] [--candidates NAME,...]

Ranges: ``copy`` (a bf16 memcpy of ``(M, R)``), ``q1x32`` (the 1x32 kernel, M-groups scales, G = 8 ragged),
``q32_kgroups`` (the 32x1 kernel's K-groups form, G = 8 ragged), ``q32_uniform`` (its 3D form along N, E = 8),
``perm_dequant`` / ``perm_blocked`` (the EP permute of ``(M, R)`` received fp8 rows, 8 ranks x 8 experts ragged as
``benchmarks.bench_permute`` times it, bf16 rows / fp8 rows + blocked scales out), and per ``--candidates`` name (``quantize_32x1.config.CANDIDATES``) ``q32_kgroups_NAME``: the K-groups call with
that candidate in the op's place.
Each kernel runs once outside its range first (compile, load), then once inside it. GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ncu_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=cli.positive_int, default=8192)
    p.add_argument("--r", type=cli.positive_int, default=2048)
    p.add_argument("--candidates", type=cli.comma_choices(*candidate_names()), default=[],
                   help="32x1 candidates to profile beside the default, K-groups form")
    args = p.parse_args(argv)
    require_cuda(argv)
    from benchmarks.bench_quantize import group_offsets
    from moe_quant.kernels import ops
    from moe_quant.kernels.quantize_32x1 import config as config_32x1
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    m, r = args.m, args.r
    x = torch.randn(m, r, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    offs = group_offsets(m, 8, ragged=True)
    calls = {"copy": lambda: y.copy_(x), "q1x32": lambda: ops.quantize_1x32(x, "rceil", offs),
             "q32_kgroups": lambda: ops.quantize_32x1_k_groups(x, "rceil", offs),
             "q32_uniform": lambda: ops.quantize_3d_along_n(x.view(8, m // 8, r), "rceil")}
    from benchmarks.bench_permute import ragged_counts, received_rows
    from moe_quant.kernels.permute import ops as ops_permute

    counts = ragged_counts(m, r, 8, 8)
    rows, row_scales = received_rows(m, r)
    for out in ("dequant", "blocked"):
        calls[f"perm_{out}"] = lambda out=out: ops_permute.permute_mxfp8(rows, row_scales, counts, out, torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    for name, call in calls.items():
        profile(name, call)
    for cand in args.candidates:
        default = config_32x1.Variant("bfloat16", "rceil", "kgroups")
        v = config_32x1.with_candidate(default, config_32x1.CANDIDATES[cand])
        with ops_32x1.variant_in_place(v, dev):
            profile(f"q32_kgroups_{cand}", calls["q32_kgroups"])
    return 0


def candidate_names() -> list[str]:
    from moe_quant.kernels.quantize_32x1.config import CANDIDATES

    return [c for c, kw in CANDIDATES.items() if kw]


def profile(name: str, call) -> None:
    """One call outside the range (compile, load), then one inside it."""
    call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
