"""Row placement kernels of the EP legs, timed on one GPU: ``index_copy_`` along rows of bf16 / fp8 / scale rows,
as the element type and viewed as whole 8-byte words, against the gather (``rows[index]``) of the same bytes.

    python scripts/probes/row_copy_probe.py [--rows 32768] [--dim 7168]

GPU only (one line and exit status 2 elsewhere). Prints µs per call (``do_bench``, median) and the rate over the
bytes read and written. Used for the EP legs' row placement (``moe_quant.ep.wire.row_words``, docs/lab/ep_log.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.timing import bench_us, device_name, print_table, require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/probes/row_copy_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=cli.positive_int, default=32768)
    p.add_argument("--dim", type=cli.positive_int, default=7168)
    args = p.parse_args(argv)
    require_cuda(argv)
    from moe_quant.ep.wire import row_words as words

    n, d = args.rows, args.dim
    perm = torch.randperm(n, device="cuda")
    rows = []
    for name, t in (("bf16", torch.randn(n, d, device="cuda", dtype=torch.bfloat16)),
                    ("fp8", torch.randint(0, 255, (n, d), device="cuda", dtype=torch.uint8)),
                    ("scales", torch.randint(0, 255, (n, d // 32), device="cuda", dtype=torch.uint8))):
        nbytes = 2 * t.numel() * t.element_size()
        w = words(t)
        calls = {"index_copy_": lambda t=t: torch.empty_like(t).index_copy_(0, perm, t),
                 "index_copy_ words": lambda w=w: torch.empty_like(w).index_copy_(0, perm, w),
                 "gather": lambda t=t: t[perm], "gather words": lambda w=w: w[perm]}
        same = torch.equal(calls["index_copy_ words"]().view(t.dtype), calls["index_copy_"]())
        for c, f in calls.items():
            us = bench_us(f)
            rows.append([name, str(tuple(t.shape)), str(w.dtype).replace("torch.", ""), c, f"{us:.1f}",
                         f"{nbytes / us / 1e6:.2f}", same])
    print_table(f"row placement, {device_name()}", ["rows", "shape", "word", "op", "us", "TB/s", "words == plain"],
                rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
