"""Byte-fingerprint bandwidth (the reuse scope's check, :mod:`moe_quant.fingerprint`) against a memcpy and a ``.sum()``
of the same bytes, and what it costs a ``reuse_quantized_weights`` scope.

    python -m benchmarks.bench_fingerprint [--w 8x2048x7168] [--weights 3] [--micro-batches 4]
                                           [--variants default,t256i8,t512i4] [--ctas-per-sm 8] [--json PATH]

Per bf16 weight shape ``(E, N, K)``, median of ``do_bench`` with inputs rotated past L2: us and TB/s of the
fingerprint kernel for each A/B candidate and grid (bytes read once); a ``.sum()`` of the same bytes viewed as
int64 (a read-only reduce, the practical read ceiling); a bf16 memcpy of the same tensor (TB/s counts read +
write, the repository's ceiling); the reference in torch ops on the GPU. ``%sum`` and ``%memcpy`` compare TB/s.
Then the scope: ``--weights`` such weights fingerprinted at first use and on exit, ms per scope and per micro-batch.
Every kernel row is checked equal to the reference first.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_quantize_32x1 import weight_shapes
from benchmarks.timing import Rotating, bench_us, device_name, memcpy_tbps, print_table, prog_name, tbps, write_json
from moe_quant import cli
from moe_quant import fingerprint as fp
from moe_quant.kernels.fingerprint.config import CANDIDATES, CTAS_PER_SM, Variant

VARIANTS = {"default": Variant(), **{name.split()[0]: Variant(**kw) for name, kw in CANDIDATES.items() if kw}}
DSV3 = (8, 2048, 7168)  # one DeepSeek-V3 expert weight of 8 local experts (w1, w3 and w2 hold as many bytes)


def bench_shape(shape, variants, grids, weights: int, micro_batches: int) -> tuple[list, list, list]:
    """Table rows, JSON records and the scope row of one weight shape."""
    from moe_quant.kernels.fingerprint import ops as ops_fingerprint

    nbytes = torch.Size(shape).numel() * 2
    rot = Rotating(lambda: (torch.randn(shape, device="cuda", dtype=torch.bfloat16),))
    want = [int(fp.reference_fingerprint(w)) for (w,) in rot.sets]
    sum_us = bench_us(lambda: rot.next()[0].view(-1).view(torch.int64).sum())
    cp_us, cp_tbps = memcpy_tbps(shape)
    sum_tbps = tbps(nbytes, sum_us)
    rows, records = [], []

    def row(what, us, extra=None, rate=None):
        rate = tbps(nbytes, us) if rate is None else rate
        rows.append(["x".join(map(str, shape)), what, us, rate, f"{100 * rate / sum_tbps:.0f}%",
                     f"{100 * rate / cp_tbps:.0f}%"])
        records.append(dict(shape=list(shape), what=what, us=us, tbps=rate, pct_sum=100 * rate / sum_tbps,
                            pct_memcpy=100 * rate / cp_tbps, **(extra or {})))

    best = None
    for name in variants:
        for ctas in grids:
            v = VARIANTS[name]
            got = [int(ops_fingerprint.fingerprint_bytes(fp.as_bytes(w), v, ctas)) for (w,) in rot.sets]
            if got != want:
                raise SystemExit(f"{prog_name()}: kernel {name} ({ctas} CTAs/SM) differs from the reference on {shape}")
            us = bench_us(lambda: ops_fingerprint.fingerprint_bytes(fp.as_bytes(rot.next()[0]), v, ctas))
            row(f"kernel {name}, {ctas} CTAs/SM", us, dict(variant=v.key, ctas_per_sm=ctas))
            best = us if best is None else min(best, us)
    row("int64 .sum() (read only)", sum_us)
    row("memcpy (TB/s: read + write)", cp_us, rate=cp_tbps)
    row("reference (torch ops)", bench_us(lambda: fp.reference_fingerprint(rot.next()[0]), warmup_ms=10, rep_ms=50))
    per_scope_ms = 2 * weights * best / 1e3
    records.append(dict(shape=list(shape), what="scope", weights=weights, ms_per_scope=per_scope_ms,
                        ms_per_micro_batch=per_scope_ms / micro_batches, micro_batches=micro_batches))
    return rows, records, [["x".join(map(str, shape)), weights, per_scope_ms, micro_batches, per_scope_ms / micro_batches]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--w", type=weight_shapes, default=[DSV3], help="bf16 weight shapes ExNxK (default 8x2048x7168)")
    p.add_argument("--weights", type=cli.positive_int, default=3, help="weights of that shape in one scope (w1, w3, w2)")
    p.add_argument("--micro-batches", type=cli.positive_int, default=4, help="micro-batches per scope")
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=list(VARIANTS))
    p.add_argument("--ctas-per-sm", type=cli.positive_int_list, default=[CTAS_PER_SM, 4, 16],
                   help=f"persistent grid sizes to time (default {CTAS_PER_SM},4,16)")
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    if device.type != "cuda":
        p.exit(cli.NO_CUDA_STATUS, f"{p.prog}: --device {args.device}: the fingerprint kernel runs on CUDA devices only\n")
    with torch.cuda.device(device):
        run(args)
    return 0


def run(args) -> None:
    rows, records, scope_rows = [], [], []
    for shape in args.w:
        r, rec, s = bench_shape(shape, args.variants, args.ctas_per_sm, args.weights, args.micro_batches)
        rows += r
        records += rec
        scope_rows += s
    print_table(f"byte fingerprint of bf16 weights ({device_name()}): TB/s of the bytes read",
                ["E x N x K", "what", "us", "TB/s", "%sum", "%memcpy"], rows)
    print_table("reuse scope: fingerprints at first use and on exit (fastest kernel row)",
                ["E x N x K", "weights", "ms per scope", "micro-batches", "ms per micro-batch"], scope_rows)
    write_json(args.json, dict(device=device_name(), torch=torch.__version__, rows=records))


if __name__ == "__main__":
    main()
