"""One warm call of each SwiGLU block op (and of its A/B candidates) inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include 'swiglu/' --nvtx-include 'swiglu_pre-round/' \\
        --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \\
        python scripts/ncu_block.py [--shape 98304x1408x64] [--out fake] [--candidates pre-round,round]

Ranges: ``copy`` (a bf16 memcpy of ``(M, R)``), ``dual``, ``swiglu``, ``dswiglu`` (the defaults, rceil, the
``benchmarks.bench_block_kernels`` calls: G ragged groups) and per ``--candidates`` name (``block.config.candidates``)
``OP_NAME`` for every op that has it, the candidate in the op's place. ncu's executed warp instructions times 32,
divided by the M R elements of the op's input, are its instructions per element (the static SASS counts of
kernels/block/NOTES.md, measured). Each call runs once outside its range first (compile, load). GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402
from scripts.ncu_kernels import profile  # noqa: E402  (one call outside its NVTX range, then one inside)


def candidate_names() -> list[str]:
    from moe_quant.kernels.block import config

    return sorted({name for op in config.OPS for name, kw in config.candidates_any_output(op).items() if kw})


def main(argv=None) -> int:
    from benchmarks.bench_block_kernels import N_INPUTS, OPS, fused, shapes_arg

    p = argparse.ArgumentParser(prog="python scripts/ncu_block.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=shapes_arg, default=[(98304, 1408, 64)], help="MxRxG (one)")
    p.add_argument("--out", choices=("fake", "mxfp8"), default="fake", help="bf16 values (fake) or fp8 + scales")
    p.add_argument("--candidates", type=cli.comma_choices(*candidate_names()), default=[])
    args = p.parse_args(argv)
    require_cuda(argv)
    from benchmarks.bench_quantize import group_offsets
    from moe_quant.kernels.block import config
    from moe_quant.kernels.block import ops as ops_block

    (m, r, g), fake = args.shape[0], args.out == "fake"
    out_dtype = "bfloat16" if fake else "float8_e4m3fn"
    offs = group_offsets(m, g, ragged=True)
    x = torch.randn(m, r, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    profile("copy", lambda: y.copy_(x))
    dev = torch.device("cuda", torch.cuda.current_device())
    for op in OPS:
        ins = tuple(torch.randn(m, r, device="cuda", dtype=torch.bfloat16) for _ in range(N_INPUTS[op]))
        call = fused(op, offs, fake)
        profile(op, lambda: call(ins))
        for cand in args.candidates:
            fields = config.candidates(op, out_dtype).get(cand)
            if not fields:
                continue
            with ops_block.variant_in_place(config.Variant(op, "bfloat16", "rceil", out_dtype, **fields), dev):
                profile(f"{op}_{cand}", lambda: call(ins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
