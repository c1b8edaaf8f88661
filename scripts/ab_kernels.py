"""A/B of the 32x1, permute and block kernel candidates (``CANDIDATES`` in ``quantize_32x1.config`` /
``permute.config`` / ``block.config``), one process.

    python scripts/ab_kernels.py [--family q32x1,q32x1-3d,q32x1-bf16,q32x1-3d-bf16,perm,perm-dequant,block-dual,
        block-dual-fp8,block-swiglu,block-dswiglu,block-swiglu-fp8,block-dswiglu-fp8] [--rounds 5]
        [--candidates NAME,...] [--json PATH]

For each candidate: first byte-exact against the reference (every output byte, padding included: outputs
are filled with 0xFF before the launch) on ragged, empty and garbage-offset cases; then timed through the
same torch op the benchmarks time (the candidate's compiled kernel put in the op's place), against a bf16
memcpy of the same input, in interleaved rounds (every candidate and the memcpy once per round). Prints
% of memcpy per shape (median, min-max over rounds), the targets (32x1 at (8192, 2048) >= 85%, permute
blocked at M = 32768 >= 85%) and which candidate to make the default: the best mean over the family's
shapes among those that are byte-exact and no slower than the default on any shape by more than the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from pathlib import Path

import torch

# Runnable as `python scripts/ab_kernels.py` from the repository root: the root (moe_quant, benchmarks) and
# tests/ (the shared strategies) on the path.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.timing import (  # noqa: E402
    Rotating, bench_us, device_name, memcpy_call, print_table, require_cuda, tbps, write_json)
from moe_quant import cli  # noqa: E402

TARGET_PCT = 85.0
Q32_SHAPES = [(8192, 2048), (32768, 2048), (32768, 7168), (131072, 2048)]  # (M, R), G = 8 ragged
Q32_TARGET = (8192, 2048)
Q32_3D_SHAPES = [(8, 2048, 7168), (16, 2048, 7168), (8, 8192, 5120)]  # (E, N, K), quantized along N
PERM_SHAPES = [(8192, 2048), (32768, 2048), (32768, 7168), (131072, 7168)]  # (M, K), 8 ranks x 8 experts
PERM_TARGETS = [(32768, 2048), (32768, 7168)]


@contextlib.contextmanager
def poisoned():
    from moe_quant.kernels import compile_cache as cc

    cc.POISON_OUTPUTS = True
    try:
        yield
    finally:
        cc.POISON_OUTPUTS = False


def same_bytes(got, want) -> bool:
    from mx_strategies import to_bytes

    return (tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype
            and torch.equal(to_bytes(got.cpu()), to_bytes(want.cpu())))


# ----------------------------------------------------------------------------- 32x1


def q32_family(out: str = "float8_e4m3fn"):
    """Per group kind: the candidates' variants (name -> Variant) writing ``out`` and the ops' way to put one in
    place."""
    from moe_quant.kernels.quantize_32x1 import config as config_32x1
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    def variants(groups):  # a candidate's fields that do not apply to the output kind left out (round with e4m3)
        return {name: config_32x1.with_candidate(config_32x1.Variant("bfloat16", "rceil", groups, out), kw)
                for name, kw in config_32x1.CANDIDATES.items()}

    return {groups: (variants(groups), ops_32x1.variant_in_place) for groups in ("kgroups", "uniform")}


def q32_check(out: str = "float8_e4m3fn") -> bool:
    """kgroups: ragged, empty groups, rows past the last group, many groups, garbage offsets, R % 128 = 64;
    uniform (3D along N): N % 128 != 0, K % 128 = 64. ``out``: MXFP8, or the dequantized bf16 values."""
    from mx_strategies import make_values

    from moe_quant import reference
    from moe_quant.kernels import ops
    from moe_quant.numerics import ScaleMode

    rc, fake = ScaleMode.RCEIL, out != "float8_e4m3fn"
    ok = True
    for m, r, offs in [(1000, 224, [0, 1, 32, 65, 192, 321, 621, 821]), (700, 192, list(range(2, 602, 2))),
                       (333, 96, [150, 150, 333]), (8192, 320, [1000, 1001, 4000, 8100]),
                       (500, 64, [-5, 2**31 - 1, 40, 7]), (64, 128, [])]:
        x = make_values((r, m), "wide", m + r, torch.bfloat16).t().contiguous()
        o = torch.tensor(offs, dtype=torch.int32)
        if fake:
            got = ops.fake_quantize_32x1_k_groups(x.cuda(), rc, o.cuda(), torch.bfloat16)
            want = reference.fake_quantize_colwise_k_groups(x, o, rc, torch.bfloat16)
        else:
            got = ops.quantize_32x1_k_groups(x.cuda(), rc, o.cuda())
            want = reference.quantize_colwise_k_groups(x, o, rc)
        ok &= all(same_bytes(g, w) for g, w in zip(got, want))
    for e, n, k in [(3, 96, 192), (2, 160, 64), (4, 256, 320), (1, 32, 32)]:
        w = make_values((e, n, k), "normal", e * n + k, torch.bfloat16)
        if fake:
            got = (ops.fake_quantize_3d_along_n(w.cuda(), rc, torch.bfloat16),)
            want = (reference.fake_quantize_3d(w.transpose(-2, -1), rc, -1, torch.bfloat16),)
        else:
            got = ops.quantize_3d_along_n(w.cuda(), rc)
            want = reference.quantize_3d(w, rc, "n")
        ok &= all(same_bytes(g, w_) for g, w_ in zip(got, want))
    return ok


def q32_cases(out: str = "float8_e4m3fn"):
    """(label, bytes, make inputs, call) per timed shape."""
    from benchmarks.bench_quantize import group_offsets
    from benchmarks.bench_quantize_32x1 import k_groups_bytes
    from moe_quant.kernels import ops

    fake = out != "float8_e4m3fn"
    for m, r in Q32_SHAPES:
        offs = group_offsets(m, 8, ragged=True)
        yield ((m, r), k_groups_bytes(m, r, 8, "fake" if fake else "mxfp8"),
               lambda m=m, r=r: (torch.randn(m, r, device="cuda", dtype=torch.bfloat16),),
               (lambda x, offs=offs: ops.fake_quantize_32x1_k_groups(x, "rceil", offs, torch.bfloat16)) if fake
               else (lambda x, offs=offs: ops.quantize_32x1_k_groups(x, "rceil", offs)))


def q32_3d_cases(out: str = "float8_e4m3fn"):
    """The same candidates on expert weights along N (the ``uniform`` groups): (label, bytes, make, call)."""
    from benchmarks.bench_quantize_32x1 import w_bytes
    from moe_quant.kernels import ops

    fake = out != "float8_e4m3fn"
    for e, n, k in Q32_3D_SHAPES:
        yield ((e, n, k), w_bytes(e, n, k, "n", "fake" if fake else "mxfp8"),
               lambda e=e, n=n, k=k: (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16),),
               (lambda w: ops.fake_quantize_3d_along_n(w, "rceil", torch.bfloat16)) if fake
               else (lambda w: ops.quantize_3d_along_n(w, "rceil")))


# ----------------------------------------------------------------------------- permute


def perm_family(out: str = "blocked"):
    from moe_quant.kernels.permute import config as config_permute
    from moe_quant.kernels.permute import ops as ops_permute

    dtype = "bfloat16" if out == "dequant" else "float8_e4m3fn"
    variants = {name: config_permute.Variant(out, dtype, **kw) for name, kw in config_permute.CANDIDATES.items()}
    return {out: (variants, ops_permute.variant_in_place)}


def perm_check(out: str = "blocked") -> bool:
    from mx_strategies import make_values

    from moe_quant import to_mxfp8
    from moe_quant.ep.permute import reference_permute_received
    from moe_quant.kernels.permute import ops as ops_permute

    ok = True
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 2 * 20000 // 256, (8, 32), generator=g)
    big[0], big[:, -1] = 0, 0  # a rank that sends nothing, an empty expert
    for counts, m, k in [([[-5, 2**31 - 1], [3, 3]], 100, 64), (big.tolist(), 20000, 2048),
                         (torch.randint(0, 600, (64, 16), generator=g).tolist(), 5000, 224),
                         ([[30, 0, 200], [0, 0, 17], [64, 1, 128]], 700, 7168), ([[]], 50, 64),
                         ([[1000] * 8] * 8, 40000, 96)]:
        data, scales = to_mxfp8(make_values((m, k), "normal", m + k))
        c = torch.tensor(counts, dtype=torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32)
        c = c.reshape(len(counts), -1)
        got = ops_permute.permute_mxfp8(data.cuda(), scales.cuda(), c.cuda(), out)
        want = reference_permute_received(data, scales, c, out=out)
        ok &= len(got) == len(want) and all(same_bytes(a, b) for a, b in zip(got, want))
    return ok


def perm_cases(out: str = "blocked"):
    from benchmarks.bench_permute import permute_bytes, ragged_counts, received_rows
    from moe_quant.kernels.permute import ops as ops_permute

    for m, k in PERM_SHAPES:
        counts = ragged_counts(m, k, 8, 8)
        yield ((m, k), permute_bytes(m, k, 8, out), lambda m=m, k=k: received_rows(m, k),
               lambda d, s, counts=counts: ops_permute.permute_mxfp8(d, s, counts, out))


# ----------------------------------------------------------------------------- block (swiglu, dswiglu)


def block_family(ops: tuple, outs: tuple | None = None):
    """Per (op, output) of ``ops`` (default: both outputs): the candidates' variants (rceil, ``config.candidates``)
    and the ops' way to put one in place."""
    from moe_quant.kernels.block import config as config_block
    from moe_quant.kernels.block import ops as ops_block

    outs = outs or config_block.OUT_DTYPES

    def kind(op: str, o: str) -> dict:
        # every kind names the candidates of all the family's output kinds: a candidate of one kind only (round:
        # bf16; flat: fp8) is the default in the other, so one name puts it in place in every kind at once
        own = config_block.candidates(op, o)
        return {name: config_block.Variant(op, "bfloat16", "rceil", o, **own.get(name, {}))
                for name in config_block.candidates_any_output(op, outs)}

    return {(op, o): (kind(op, o), ops_block.variant_in_place) for op in ops for o in outs}


def block_check() -> bool:
    """dual, swiglu and dswiglu, both outputs, every byte against the reference (PyTorch's SwiGLU, the CPU
    quantizers): ragged groups with a tail, ``a`` inside the fast-division range (normal), across it (wide) and
    NaN / Inf."""
    from mx_strategies import make_values, offsets_from_sizes

    from moe_quant import block_quantize as bq
    from moe_quant import layouts, reference
    from moe_quant.kernels.block import ops as ops_block
    from moe_quant.numerics import ScaleMode

    rc = ScaleMode.RCEIL
    ok = True
    sizes, tail, r = [0, 1, 127, 129, 300], 13, 288
    offs = offsets_from_sizes(sizes)
    m = sum(sizes) + tail
    clean = layouts.sanitize_offsets(offs, m).to(torch.int32)
    for dist in ("normal", "wide", "nan_inf"):
        g, a, b = (make_values((m, r), dist, 11 + i).cuda() for i in range(3))
        for fake in (False, True):
            want = [bq._separate_forms(g.cpu(), rc, clean, fake)]
            got = [bq._kernel_forms(ops_block.block_dual(g, "rceil", offs.cuda(), fake), fake)[0]]
            want += [bq._separate_forms(reference.swiglu(a, b).cpu(), rc, clean, fake)]
            got += [bq._kernel_forms(ops_block.block_swiglu(a, b, "rceil", offs.cuda(), fake), fake)[0]]
            want += [bq._separate_forms(t.cpu(), rc, clean, fake) for t in reference.dswiglu(g, a, b)]
            got += list(bq._kernel_forms(ops_block.block_dswiglu(g, a, b, "rceil", offs.cuda(), fake), fake))
            for gf, wf in zip(got, want):
                for g_part, w_part in zip(gf, wf):
                    ok &= all(same_bytes(x, y) for x, y in zip(g_part, w_part))
    return ok


def block_cases(op: str, out: str = "bfloat16"):
    """``benchmarks.bench_block_kernels``' shapes, labelled (M, R) (G = 64 at M = 98304, 8 at 16384)."""
    from benchmarks.bench_block_kernels import DEFAULT_SHAPES, N_INPUTS, fused, op_bytes
    from benchmarks.bench_quantize import group_offsets

    fake = out != "float8_e4m3fn"
    for m, r, g in DEFAULT_SHAPES:
        n = N_INPUTS[op]
        yield ((m, r), op_bytes(op, m, r, g, fake),
               lambda m=m, r=r, n=n: tuple(torch.randn(m, r, device="cuda", dtype=torch.bfloat16) for _ in range(n)),
               lambda *t, f=fused(op, group_offsets(m, g, ragged=True), fake): f(t))


FAMILIES = {
    "q32x1": (q32_family, q32_check, q32_cases, "kgroups", [Q32_TARGET]),
    "q32x1-3d": (q32_family, q32_check, q32_3d_cases, "uniform", []),
    # the same candidates writing the dequantized bf16 values (Hopper's emulated GEMM operand)
    "q32x1-bf16": (functools.partial(q32_family, "bfloat16"), functools.partial(q32_check, "bfloat16"),
                   functools.partial(q32_cases, "bfloat16"), "kgroups", []),
    "q32x1-3d-bf16": (functools.partial(q32_family, "bfloat16"), functools.partial(q32_check, "bfloat16"),
                      functools.partial(q32_3d_cases, "bfloat16"), "uniform", []),
    "perm": (perm_family, perm_check, perm_cases, "blocked", PERM_TARGETS),
    # the same candidates writing the dequantized bf16 rows (Hopper's operand)
    "perm-dequant": (functools.partial(perm_family, "dequant"), functools.partial(perm_check, "dequant"),
                     functools.partial(perm_cases, "dequant"), "dequant", PERM_TARGETS),
    # the SwiGLU block's ops: bf16 outputs (Hopper's emulated GEMM operands), fp8 + scales (Blackwell's)
    "block-dual": (functools.partial(block_family, ("dual",), ("bfloat16",)), block_check,
                   functools.partial(block_cases, "dual"), ("dual", "bfloat16"), []),
    "block-dual-fp8": (functools.partial(block_family, ("dual",), ("float8_e4m3fn",)), block_check,
                       functools.partial(block_cases, "dual", "float8_e4m3fn"), ("dual", "float8_e4m3fn"), []),
    # each SwiGLU op's candidates in place for both its outputs (dswiglu has candidates of its own: lean-unfused)
    "block-swiglu": (functools.partial(block_family, ("swiglu",)), block_check,
                     functools.partial(block_cases, "swiglu"), ("swiglu", "bfloat16"), []),
    "block-dswiglu": (functools.partial(block_family, ("dswiglu",)), block_check,
                      functools.partial(block_cases, "dswiglu"), ("dswiglu", "bfloat16"), []),
    "block-swiglu-fp8": (functools.partial(block_family, ("swiglu",)), block_check,
                         functools.partial(block_cases, "swiglu", "float8_e4m3fn"), ("swiglu", "float8_e4m3fn"), []),
    "block-dswiglu-fp8": (functools.partial(block_family, ("dswiglu",)), block_check,
                          functools.partial(block_cases, "dswiglu", "float8_e4m3fn"), ("dswiglu", "float8_e4m3fn"),
                          []),
}


# ----------------------------------------------------------------------------- driver


def run_family(name: str, rounds: int, only: list[str] | None = None) -> dict:
    make_family, check, cases, timed_kind, targets = FAMILIES[name]
    dev = torch.device("cuda", torch.cuda.current_device())
    kinds = make_family()
    names = [c for i, c in enumerate(kinds[timed_kind][0]) if not only or i == 0 or c in only]  # 0: the default
    exact = {}
    for cand in names:
        with contextlib.ExitStack() as stack:
            for variants, in_place in kinds.values():
                stack.enter_context(in_place(variants[cand], dev))
            with poisoned():
                exact[cand] = check()
        print(f"{name} {cand}: byte-exact vs reference (every byte, padding included): {exact[cand]}", flush=True)
    variants, in_place = kinds[timed_kind]
    # a candidate that is the timed kind's default itself (round in the fp8 kinds) is not timed again
    timed = {c: variants[c] for i, c in enumerate(names) if exact[c] and (i == 0 or variants[c] != variants[names[0]])}
    shapes = {}
    for shape, nbytes, make, call in cases():
        rot = Rotating(make)
        copy, copy_bytes = memcpy_call(shape)
        pct = {c: [] for c in timed}
        for _ in range(rounds):
            copy_tbps = tbps(copy_bytes, bench_us(copy))
            for c, variant in timed.items():
                with in_place(variant, dev):
                    call(*rot.next())  # warm
                    us = bench_us(lambda: call(*rot.next()))
                pct[c].append(100 * tbps(nbytes, us) / copy_tbps)
        shapes[shape] = pct
        del rot
        torch.cuda.empty_cache()
    return {"exact": exact, "shapes": shapes, "targets": targets}


def recommend(res: dict) -> str | None:
    """Best mean median % over the shapes among byte-exact candidates not slower than the default (the first
    candidate) on any shape by more than that shape's spread (max - min over rounds of either)."""
    shapes = res["shapes"]
    if not shapes:
        return None
    names = list(next(iter(shapes.values())))
    default = names[0]

    def med(c, s):
        return statistics.median(shapes[s][c])

    def spread(c, s):
        return max(shapes[s][c]) - min(shapes[s][c])

    ok = [c for c in names if all(med(c, s) >= med(default, s) - max(spread(c, s), spread(default, s)) for s in shapes)]
    return max(ok, key=lambda c: sum(med(c, s) for s in shapes)) if ok else default


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", type=cli.comma_choices(*FAMILIES), default=list(FAMILIES))
    p.add_argument("--rounds", type=cli.positive_int, default=5, help="interleaved timing rounds")
    p.add_argument("--json", type=cli.writable_file, default=None)
    p.add_argument("--candidates", type=lambda t: [c for c in t.split(",") if c], default=None,
                   help="comma list: only these candidates (and the default) are checked and timed")
    args = p.parse_args(argv)
    if args.candidates:  # a misspelt name would be dropped by every family: say so before any GPU work
        known = {name for fam in args.family for variants, _ in FAMILIES[fam][0]().values() for name in variants}
        unknown = [c for c in args.candidates if c not in known]
        if unknown:
            p.error(f"--candidates: {', '.join(map(repr, unknown))} is no candidate of --family "
                    f"{','.join(args.family)}; theirs: {', '.join(sorted(known))}")
    require_cuda(argv)
    out = {"device": device_name(), "torch": torch.__version__}
    for fam in args.family:
        res = run_family(fam, args.rounds, args.candidates)
        names = list(next(iter(res["shapes"].values()))) if res["shapes"] else []
        rows = []
        for shape, pct in res["shapes"].items():
            target = shape in [tuple(t) for t in res["targets"]]
            rows.append(["x".join(map(str, shape)) + (" *" if target else "")]
                        + [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                           + ("" if not target else (" PASS" if statistics.median(v) >= TARGET_PCT else " FAIL"))
                           for v in pct.values()])
        print_table(f"{fam}: % of memcpy, median (min-max) over {args.rounds} interleaved rounds "
                    f"(* target >= {TARGET_PCT}%) ({device_name()})", ["shape"] + names, rows)
        best = recommend(res)
        print(f"{fam}: make default -> {best}", flush=True)
        out[fam] = {"exact": res["exact"], "recommend": best,
                    "shapes": {"x".join(map(str, s)): v for s, v in res["shapes"].items()},
                    "targets": [f"{t[0]}x{t[1]}" for t in res["targets"]], "target_pct": TARGET_PCT}
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
