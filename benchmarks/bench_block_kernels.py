"""Bandwidth of the SwiGLU expert block's fused quantization passes (``dual``, ``swiglu``, ``dswiglu``) against a
memcpy and against the unfused passes they replace, measured in the same run.

    python -m benchmarks.bench_block_kernels [--shapes 98304x1408x64,16384x7168x8] [--out fake,mxfp8,fp8cols]
        [--json PATH]

Each shape is ``MxRxG``: M tokens in G ragged groups (``bench_quantize.group_offsets``), R columns (R = D for ``dual``'s x or grad_y, R = H for
``swiglu``'s and ``dswiglu``'s tensors; every op runs at every shape). The defaults are torchtitan's DeepSeek-V3
16B experts at 16384 tokens x top-6 (M = 98304, H = 1408, D = 2048, 64 experts) and the DeepSeek-V3 block of
``bench_block`` (M = 16384, H = 2048, D = 7168, 8 experts). Per op: µs (median, CUDA events, L2 flushed before
each call, inputs rotated), TB/s over the bytes it must move (inputs read once; every output written once:
rowwise values or fp8 data + M-groups scales, colwise values or data + K-groups scales, padding included, and
the padded offsets), % of a bf16 memcpy of an (M, R) tensor in the same run, and the unfused equivalent: the
1x32 and 32x1 kernels of each output tensor (for ``swiglu`` / ``dswiglu`` after PyTorch's SwiGLU ops), the
same bytes at the end. ``swiglu rows`` / ``swiglu cols``: the one-form swiglu variants (the block's forward writes h's
rowwise form alone, its backward the colwise one), against PyTorch's SwiGLU and that form's kernel. ``--out
fp8cols``: ``dual`` and ``dswiglu`` alone, their ``cols_fp8`` variants (dswiglu's the block's backward on the emulated
GEMM since 2026-12-03, dual's its forward since that night: rowwise bf16 values, colwise fp8 data + plain K-groups
scales ``(R, Mp/32)``), against the 1x32 kernel and the 32x1 kernel's plain form
(``quantize.colwise_k_groups_plain``: its blocked scales unblocked by torch ops).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_quantize import group_offsets
from benchmarks.timing import Rotating, bench_us, device_name, memcpy_tbps, print_table, prog_name, require_cuda
from benchmarks.timing import tbps, write_json
from moe_quant import block_quantize as bq
from moe_quant import cli, layouts, reference
from moe_quant import quantize as q
from moe_quant.numerics import BLOCK_SIZE, ScaleMode

MODE = ScaleMode.RCEIL
DEFAULT_SHAPES = [(98304, 1408, 64), (98304, 2048, 64), (16384, 2048, 8), (16384, 7168, 8)]
# "swiglu rows" / "swiglu cols": the one-form swiglu variants (block_quantize.swiglu_rowwise, the block's forward,
# and swiglu_colwise, its backward)
OPS = ("dual", "swiglu", "swiglu rows", "swiglu cols", "dswiglu")
N_INPUTS = {"dual": 1, "swiglu": 2, "swiglu rows": 2, "swiglu cols": 2, "dswiglu": 3}
N_OUTPUTS = {"dual": 1, "swiglu": 1, "swiglu rows": 1, "swiglu cols": 1, "dswiglu": 2}
FORMS = {"swiglu rows": "rows", "swiglu cols": "cols"}  # the forms an op writes ("both" where not named)
FP8COLS_OPS = ("dual", "dswiglu")  # the ops with a cols_fp8 variant (--out fp8cols)
FUSED = {"swiglu rows": "swiglu_rowwise", "swiglu cols": "swiglu_colwise"}  # block_quantize's function of an op


def shapes_arg(text: str) -> list[tuple[int, int, int]]:
    """``type=`` for --shapes: ``MxRxG`` triples, comma separated, R a multiple of 32."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) % BLOCK_SIZE:
            raise argparse.ArgumentTypeError(f"expected MxRxG shapes (R a multiple of 32) such as 98304x1408x64, "
                                             f"got {text!r}")
        out.append(tuple(int(p) for p in parts))
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one MxRxG shape, got {text!r}")
    return out


def form_bytes(m: int, r: int, g: int, fake: bool, cols_fp8: bool = False, forms: str = "both") -> int:
    """Bytes one output tensor's forms occupy: rowwise (M, R) and colwise (R, Mp), scales with padding (``forms``
    "rows" / "cols": that one alone); ``cols_fp8`` (with ``fake``): the colwise form fp8 data and plain K-groups
    scales."""
    mp = layouts.k_groups_padded_len(m, g)
    rs, cs = layouts.m_groups_blocked_shape(m, r // BLOCK_SIZE, g), layouts.k_groups_blocked_shape(r, m, g)
    if fake:
        ps = layouts.k_groups_plain_shape(r, m, g)
        row, col = 2 * m * r, (r * mp + ps[0] * ps[1] if cols_fp8 else 2 * r * mp)
    else:
        row, col = m * r + rs[0] * rs[1], r * mp + cs[0] * cs[1]
    return (row if forms != "cols" else 0) + (col if forms != "rows" else 0)


def op_bytes(op: str, m: int, r: int, g: int, fake: bool, cols_fp8: bool = False) -> int:
    forms = FORMS.get(op, "both")
    return 2 * m * r * N_INPUTS[op] + N_OUTPUTS[op] * form_bytes(m, r, g, fake, cols_fp8, forms) + 4 * g


def fused(op: str, offs, fake: bool, cols_fp8: bool = False):
    if cols_fp8:  # the kernel's op (block_quantize takes its outputs as they are)
        from moe_quant.kernels.block import ops as ops_block

        return lambda t: getattr(ops_block, f"block_{op}")(*t, MODE, offs, True, cols_fp8=True)
    fn = getattr(bq, FUSED.get(op, op))
    return lambda t: fn(*t, MODE, offs, fake)


def unfused(op: str, offs, fake: bool, cols_fp8: bool = False):
    """The same forms by PyTorch's SwiGLU ops and the per-GEMM quantizers (the 1x32 and the 32x1 kernel, one read
    each), as the per-GEMM path makes them: what the fused op replaces."""
    def forms(x, mode, offs, fake):
        if fake:
            col = q.colwise_k_groups_plain(x, offs, mode) if cols_fp8 else q.fake_colwise_k_groups(x, offs, mode,
                                                                                                  torch.bfloat16)
            return q.fake_rowwise(x, mode, torch.bfloat16), col
        return q.rowwise(x, mode, offs), q.colwise_k_groups(x, offs, mode)

    if op == "dual":
        return lambda t: forms(t[0], MODE, offs, fake)
    if op == "swiglu":
        return lambda t: forms(reference.swiglu(t[0], t[1]), MODE, offs, fake)
    if op in FORMS:  # the one form's quantizer alone after PyTorch's SwiGLU
        one = {"rows": lambda h: bq.rowwise(h, MODE, offs, fake), "cols": lambda h: bq.colwise(h, MODE, offs, fake)}
        return lambda t: one[FORMS[op]](reference.swiglu(t[0], t[1]))
    return lambda t: [forms(x, MODE, offs, fake) for x in reference.dswiglu(*t)]


def time_shape(m: int, r: int, g: int, outs, with_unfused: bool = True) -> list[dict]:
    """Every op of every output kind in ``outs`` (``"fake"``: bf16 values, else MXFP8) at one shape (G ragged
    groups, inputs rotated past the L2), with a bf16 memcpy of an (M, R) tensor timed with them: one record per
    (out, op), ``unfused_us`` None without ``with_unfused``."""
    offs = group_offsets(m, g, ragged=True)
    _, cp = memcpy_tbps((m, r))
    rot = Rotating(lambda: tuple(torch.randn(m, r, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
    record = []
    for out in outs:
        fake, cols_fp8 = out in ("fake", "fp8cols"), out == "fp8cols"
        for op in OPS:
            if cols_fp8 and op not in FP8COLS_OPS:
                continue
            n = N_INPUTS[op]
            f = fused(op, offs, fake, cols_fp8)
            u = unfused(op, offs, fake, cols_fp8) if with_unfused else None
            f(rot.next()[:n])
            if u is not None:
                u(rot.next()[:n])
            us = bench_us(lambda: f(rot.next()[:n]))
            uus = bench_us(lambda: u(rot.next()[:n])) if u is not None else None
            nb = op_bytes(op, m, r, g, fake, cols_fp8)
            record.append({"op": op, "m": m, "r": r, "g": g, "out": out, "us": us, "tbps": tbps(nb, us),
                           "pct_memcpy": 100 * tbps(nb, us) / cp, "unfused_us": uus, "memcpy_tbps": cp})
    del rot
    torch.cuda.empty_cache()
    return record


def run(shapes, outs) -> dict:
    rows, record = [], []
    for m, r, g in shapes:
        for x in time_shape(m, r, g, outs):
            rows.append([x["op"], m, r, g, x["out"], x["us"], x["tbps"], x["pct_memcpy"], x["unfused_us"],
                         x["unfused_us"] / x["us"], x["memcpy_tbps"]])
            record.append(x)
    print_table(f"SwiGLU block fused passes, {MODE.value} ({device_name()}, torch {torch.__version__})",
                ["op", "M", "R", "G", "out", "us", "TB/s", "%memcpy", "unfused us", "unfused / fused", "memcpy TB/s"],
                rows)
    return {"device": device_name(), "torch": torch.__version__, "rows": record}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=shapes_arg, default=list(DEFAULT_SHAPES))
    p.add_argument("--out", type=cli.comma_choices("fake", "mxfp8", "fp8cols"), default=["fake"],
                   help="fake: the dequantized bf16 values (Hopper's emulated GEMM); mxfp8: fp8 data + scales; "
                        "fp8cols: dual's and dswiglu's cols_fp8 variants (bf16 rowwise, fp8 colwise forms)")
    p.add_argument("--json", type=cli.writable_file, default=None)
    args = p.parse_args(argv)
    require_cuda(argv)
    write_json(args.json, run(args.shapes, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
