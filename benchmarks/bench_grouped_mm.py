"""One expert layer, fwd + bwd: emulated MXFP8 (moe_quant) vs bf16 torch._grouped_mm vs torchao's
emulated MXFP8 path, on the DeepSeek-V3 and Llama4 expert shapes and a small-M shape (docs/design.md
section 6).

    python -m benchmarks.bench_grouped_mm [--shapes dsv3,llama4,dsv3_small] [--m 16384,32768,...]
        [--breakdown] [--json PATH] [--compile] [--no-torchao] [--device cpu --tiny]

Prints a table (ms per fwd+bwd, ratio to bf16, speedup over torchao emulated, peak memory above
the inputs, SQNR of the output), the layer targets with met / not met, and with ``--breakdown``
the GPU time of the moe_quant layer by kernel category plus its top 10 kernels.

One fwd+bwd is ``out = f(A, W^T, offs)`` then ``torch.autograd.grad(out, (A, W), grad_out)``:
the gradients are returned, not accumulated into ``.grad``, so no ``A.grad += ...`` kernel is
timed. ``--m`` replaces M in each selected shape family (``dsv3_small`` is the dsv3 family), for
``scripts/plot_layer_time.py``. ``--device cpu --tiny`` is a smoke run of every code path with
shrunken shapes: its timings and targets mean nothing and no memory is measured.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import math
import platform
import statistics
import sys
import time
import traceback
from unittest import mock

import torch

from benchmarks.timing import (
    bench_ms,
    device_name,
    peak_memory_bytes,
    print_table,
    profile_device_ops,
    profiler_ranges,
    prog_name,
    write_json,
)
from moe_quant import backends, cli, mxfp8_grouped_mm, reuse

FAMILIES = {  # name: (K in, N out, G experts)
    "dsv3": (7168, 2048, 8),
    "llama4": (5120, 8192, 8),
}
TINY_FAMILIES = {"dsv3": (256, 64, 8), "llama4": (160, 256, 8)}
SHAPES = {  # name: (family, M tokens)
    "dsv3": ("dsv3", 131072),
    "llama4": ("llama4", 131072),
    "dsv3_small": ("dsv3", 16384),  # small M: the weight quantization weighs most
}
TINY_M = {"dsv3": 1024, "llama4": 1024, "dsv3_small": 256}
ALIGN = 32  # token-group alignment of the ragged offsets (bf16 backward needs multiples of 8)

# layer targets (docs/design.md section 6)
MAX_X_BF16, AIM_X_BF16, MIN_SPEEDUP_VS_TORCHAO = 1.25, 1.15, 4.0
GIB = 1 << 30

IMPL_LABELS = {
    "bf16": "bf16 torch._grouped_mm",
    "moe_quant": "moe_quant emulated",
    "moe_quant_ref": "moe_quant emulated, reference quant",
    "moe_quant_reused": "moe_quant emulated, reuse_quantized_weights (micro-batch 2+)",
    "moe_quant_compile": "moe_quant emulated, torch.compile",
    "torchao": "torchao emulated (to_mx)",
}


def ragged_offsets(m: int, g: int, seed: int = 0, align: int = ALIGN, device="cuda") -> torch.Tensor:
    """Uneven group sizes (router-like imbalance) summing to m, each a multiple of ``align``.

    PyTorch's bf16 grouped GEMM backward needs 16-byte-aligned token groups (a device assert
    otherwise), so the baseline gets aligned groups, as torchtitan pads them; moe_quant itself
    takes any sizes. ``m`` must be a multiple of ``align``.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(g, generator=gen) + 0.5
    sizes = (w / w.sum() * m / align).floor().long() * align
    sizes[-1] += m - sizes.sum()
    return sizes.cumsum(0).to(torch.int32).to(device)


def sqnr(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


def torchao_emulated():
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    def f(A, W_t, offs):
        return _to_mxfp8_then_scaled_grouped_mm(A, W_t, offs, kernel_preference=KernelPreference.EMULATED)

    return f


def moe_quant_emulated(A, W_t, offs):
    return mxfp8_grouped_mm(A, W_t, offs, backend="emulated")


_REUSE_SCOPES: dict = {}


def moe_quant_reused(A, W_t, offs):
    """Micro-batches 2+ of gradient accumulation inside ``reuse_quantized_weights``: W is unchanged between
    the timed steps, so its quantized fwd/dgrad operands are made by the first call and reused after. The
    scope (one per weight) is active for the step's forward and backward (see ``run``'s ``step``)."""
    return mxfp8_grouped_mm(A, W_t, offs, backend="emulated")


def reuse_scope(impl: str, W):
    """The reuse scope a step of ``impl`` runs in (``moe_quant_reused`` only), kept across its steps."""
    if impl != "moe_quant_reused":
        return contextlib.nullcontext()
    scope = _REUSE_SCOPES.get(id(W))
    if scope is None or scope.roots.get(id(W)) is not W:
        _REUSE_SCOPES.clear()  # one weight at a time: the previous shape's operands are freed
        scope = _REUSE_SCOPES[id(W)] = reuse.Scope([W])
    return scope.activate()


def reference_quant(A, W_t, offs):
    with mock.patch.object(backends, "use_quant_kernels", lambda x: False):
        return mxfp8_grouped_mm(A, W_t, offs, backend="emulated")


def make_impls(args) -> dict:
    impls = {
        "bf16": lambda A, W_t, offs: torch._grouped_mm(A, W_t, offs=offs),
        "moe_quant": moe_quant_emulated,
        "moe_quant_reused": moe_quant_reused,
        "moe_quant_ref": reference_quant,
    }
    if args.compile:
        # static shapes: a fresh compile per shape (inductor's dynamic-shape path is not wanted here)
        torch._dynamo.reset()
        impls["moe_quant_compile"] = torch.compile(moe_quant_emulated, dynamic=False)
    if not args.no_torchao:
        try:
            impls["torchao"] = torchao_emulated()
        except Exception as e:  # noqa: BLE001 -- report and go on without the peer
            print(f"torchao emulated path unavailable: {e!r}")
    return impls


def one_line(e: BaseException, limit: int = 120) -> str:
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- kernel breakdown

QUANT_RANGE = "moe_quant.quantize."
CAT_CUTE = "quantization: CuTe-DSL kernels"
CAT_REF = "quantization: reference (eager elementwise/reduction)"
CAT_GEMM = "GEMM (grouped mm)"
CAT_OTHER = "other"
CATEGORIES = (CAT_CUTE, CAT_REF, CAT_GEMM, CAT_OTHER)
SHORT = {CAT_CUTE: "quant CuTe", CAT_REF: "quant ref", CAT_GEMM: "GEMM", CAT_OTHER: "other"}
GEMM_MARKS = ("gemm", "grouped", "cutlass", "nvjet", "sm90")
GEMM_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm")  # e.g. the CPU grouped mm's aten::mm calls
ELEMENTWISE_MARKS = ("elementwise", "reduce", "scatter", "gather", "index", "catarray", "fill", "copy", "scan", "sort")


def quantize_ranges():
    """Wrap every public function of ``moe_quant.quantize`` (what the autograd function calls to
    quantize its operands) in a profiler range ``moe_quant.quantize.<name>``, so that the
    reference quantization's kernels can be told from the layer's other elementwise kernels."""
    import moe_quant.quantize as q

    return profiler_ranges((q, name, QUANT_RANGE + name) for name, obj in list(vars(q).items())
                           if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == q.__name__)


def categorize(name: str, scopes: tuple, scopes_known: bool) -> str:
    low = name.lower()
    # The CuTe-DSL kernels: by name (cute names a kernel after its class, Quantize1x32Kernel), by
    # the moe_quant:: custom op that launched it (compiled graphs), or launched straight from a
    # quantize range with no aten op around it (eager: the op wrappers call TVM-FFI directly).
    if ("quantize" in low or "moe_quant" in low or any(s.startswith("moe_quant::") for s in scopes)
            or (scopes and scopes[0].startswith(QUANT_RANGE))):
        return CAT_CUTE
    if any(m in low for m in GEMM_MARKS) or any(s in GEMM_OPS for s in scopes):
        return CAT_GEMM
    if scopes_known:
        return CAT_REF if any(s.startswith(QUANT_RANGE) for s in scopes) else CAT_OTHER
    # the profiler linked no kernel to its launching op: fall back to kernel names
    return CAT_REF if any(m in low for m in ELEMENTWISE_MARKS) else CAT_OTHER


def breakdown(fn, device, iters: int) -> dict:
    """Device time per iteration of ``fn`` by category, and its kernels by total time."""
    with quantize_ranges():
        ops = profile_device_ops(fn, device, iters)
    scopes_known = any(op["linked"] for op in ops)
    cats = collections.Counter({c: 0.0 for c in CATEGORIES})
    kernels = {}
    for op in ops:
        cat = categorize(op["name"], op["scopes"], scopes_known)
        cats[cat] += op["us"]
        # by name and category: one kernel (a copy, say) can run inside and outside the quantization
        k = kernels.setdefault((op["name"], cat), {"name": op["name"], "category": cat, "us": 0.0, "calls": 0})
        k["us"] += op["us"]
        k["calls"] += 1
    top = sorted(kernels.values(), key=lambda k: -k["us"])
    return {
        "iters": iters,
        "scopes_known": scopes_known,
        "unlinked_ms_per_iter": sum(op["us"] for op in ops if not op["linked"]) / iters / 1e3,
        "categories_ms_per_iter": {c: cats[c] / iters / 1e3 for c in CATEGORIES},
        "kernels": [
            {"name": k["name"], "category": k["category"], "ms_per_iter": k["us"] / iters / 1e3,
             "calls_per_iter": k["calls"] / iters}
            for k in top
        ],
    }


def print_breakdown(shape_label, device, mq: dict, bf16: dict | None, wall_ms: float | None):
    total = sum(mq["categories_ms_per_iter"].values())
    bf16_cats = bf16["categories_ms_per_iter"] if bf16 else {}
    rows = []
    for c in CATEGORIES:
        v = mq["categories_ms_per_iter"][c]
        rows.append([c, v, 100 * v / total if total else float("nan"), bf16_cats.get(c, float("nan"))])
    rows.append(["total", total, 100.0 if total else float("nan"), sum(bf16_cats.values()) if bf16 else float("nan")])
    unit = "GPU" if torch.device(device).type == "cuda" else "CPU self"
    print_table(
        f"\n{shape_label}: {unit} time per fwd+bwd by category (torch.profiler, {mq['iters']} iterations)",
        ["category", "moe_quant ms", "% of moe_quant", "bf16 ms"],
        rows,
    )
    if wall_ms is not None:
        print(f"(moe_quant timed median: {wall_ms:.3g} ms per fwd+bwd; the difference to the total above is time "
              "the device sat idle, or on CPU the time outside aten ops)")
    if not mq["scopes_known"]:
        print("note: the profiler linked no kernel to its launching op; the reference-quantization row is "
              "by kernel name (elementwise/reduction kernels anywhere in the layer)")
    elif mq["unlinked_ms_per_iter"] > 0:
        print(f"note: {mq['unlinked_ms_per_iter']:.3g} ms per iteration of kernels had no launching op "
              "(counted as 'other' unless their names say quantization or GEMM)")
    top = [[k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "...", SHORT[k["category"]],
            k["ms_per_iter"], k["calls_per_iter"]] for k in mq["kernels"][:10]]
    print_table(f"{shape_label}: top 10 moe_quant kernels by time", ["kernel", "category", "ms/iter", "calls/iter"], top)


# ----------------------------------------------------------------------------- main


def shapes_to_run(args) -> list[tuple[str, str, int]]:
    """(label, family, M) for each shape to run; ``ValueError`` for an M the bf16 baseline cannot run."""
    names = args.shapes
    if args.m:
        ms = args.m
        families = list(dict.fromkeys(SHAPES[s][0] for s in names))
        out = [(f"{f} M={m}", f, m) for f in families for m in ms]
    else:
        out = [(s, SHAPES[s][0], TINY_M[s] if args.tiny else SHAPES[s][1]) for s in names]
    for label, _, m in out:
        if m <= 0 or m % ALIGN:
            raise ValueError(f"M must be a positive multiple of {ALIGN} (bf16 backward needs aligned groups), got {m}")
    return out


def finite_or_none(v):
    return v if v is not None and math.isfinite(v) else None


def fmt_gib(b) -> float:
    return b / GIB if b is not None else float("nan")


def main():
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=cli.comma_choices(*SHAPES), default=["dsv3", "llama4", "dsv3_small"],
                   help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--m", type=cli.positive_int_list, default=None,
                   help="comma list of M values: sweep M for each selected shape family")
    p.add_argument("--compile", action="store_true", help="add a torch.compile(mxfp8_grouped_mm) row")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="profile the moe_quant layer: GPU time by kernel category")
    p.add_argument("--breakdown-iters", type=cli.positive_int, default=3)
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="interleaved timing rounds (median reported)")
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="shrunken shapes (smoke runs, e.g. with --device cpu)")
    args = p.parse_args()
    cli.exit_unless_device_runs(p, args.device)  # one line and exit status 2 (no GPU: CPU smoke runs pass --device cpu)
    try:
        shapes_to_run(args)  # M values it cannot run end it here, before any work
    except ValueError as err:
        p.error(f"argument --m: {err}")
    run(args)


def run(args):
    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    families = TINY_FAMILIES if args.tiny else FAMILIES
    torch.manual_seed(0)
    shapes = shapes_to_run(args)
    record = {
        "benchmark": "bench_grouped_mm",
        "device": device_name() if is_cuda else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tiny": args.tiny,
        "rows": [],
        "targets": [],
        "breakdown": [],
    }
    if not is_cuda:
        print(f"NOTE: device {device}: timings are wall clock (not the GPU targets), no memory is measured")
    rows, target_rows = [], []
    for label, family, m in shapes:
        k, n, g = families[family]
        impls = make_impls(args)
        A = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        W = (torch.randn(g, n, k, device=device, dtype=torch.bfloat16) / math.sqrt(k)).requires_grad_()
        offs = ragged_offsets(m, g, device=device)
        go = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        ref_out = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs).detach()
        shape_label = f"{label} ({m}, {k}->{n}, G={g})"
        results = {}
        steps = {}
        for impl, f in impls.items():

            def step(f=f, impl=impl):
                with reuse_scope(impl, W):
                    out = f(A, W.transpose(-2, -1), offs)
                    torch.autograd.grad(out, (A, W), go)

            res = {"ms": None, "peak_bytes": None, "sqnr_db": None, "error": None, "ms_rounds": []}
            try:
                step()  # first call: kernel compilation, torch.compile
                res["peak_bytes"] = peak_memory_bytes(step, device)
                # with grad enabled, as timed (a no_grad call would make torch.compile recompile)
                res["sqnr_db"] = sqnr(f(A, W.transpose(-2, -1), offs).detach(), ref_out)
            except Exception as e:  # noqa: BLE001 -- OOM or a failing peer: report, go on
                res["error"] = one_line(e)
                print(f"{shape_label} {IMPL_LABELS[impl]}: {res['error']}")
                if not isinstance(e, torch.OutOfMemoryError):
                    traceback.print_exc()
                if is_cuda:
                    torch.cuda.empty_cache()
            else:
                steps[impl] = step
            results[impl] = res
        # Timed in interleaved rounds (every implementation once per round), median over rounds: the
        # GPU's clock drifts with its power and temperature over a run (an H100's bf16 GEMM here moved
        # by 10 % between rounds), and interleaving spreads that drift over all implementations.
        for _ in range(args.rounds):
            for impl, step in steps.items():
                results[impl]["ms_rounds"].append(bench_ms(step, device, warmup_ms=50, rep_ms=300))
        for impl in steps:
            results[impl]["ms"] = statistics.median(results[impl]["ms_rounds"])

        base = results.get("bf16", {}).get("ms")
        ao = results.get("torchao", {}).get("ms")
        for impl, res in results.items():
            ms = res["ms"]
            x_bf16 = ms / base if ms and base else None
            vs_ao = ao / ms if ms and ao else None
            rows.append([shape_label, IMPL_LABELS[impl], ms if ms else "-", x_bf16 or float("nan"),
                         vs_ao or float("nan"), fmt_gib(res["peak_bytes"]),
                         res["sqnr_db"] if res["sqnr_db"] is not None else float("nan"), res["error"] or ""])
            record["rows"].append({"shape": label, "family": family, "m": m, "k": k, "n": n, "g": g, "impl": impl,
                                   "label": IMPL_LABELS[impl], "ms": ms, "ms_rounds": res["ms_rounds"], "x_bf16": x_bf16,
                                   "speedup_vs_torchao": vs_ao,
                                   "peak_gib": res["peak_bytes"] / GIB if res["peak_bytes"] is not None else None,
                                   "sqnr_db": finite_or_none(res["sqnr_db"]), "error": res["error"]})

        # targets, for the moe_quant row
        mq = results.get("moe_quant", {})
        a_bytes = A.numel() * A.element_size()
        go_bytes = go.numel() * go.element_size()
        targets = []
        if mq.get("ms") and base:
            r = mq["ms"] / base
            targets.append(("time vs bf16", f"{r:.2f}x", f"<= {MAX_X_BF16}x (aim {AIM_X_BF16}x)", r <= MAX_X_BF16))
        if mq.get("ms") and ao:
            s = ao / mq["ms"]
            targets.append(("speedup vs torchao emulated", f"{s:.2f}x", f">= {MIN_SPEEDUP_VS_TORCHAO}x", s >= MIN_SPEEDUP_VS_TORCHAO))
        bf16_peak = results.get("bf16", {}).get("peak_bytes")
        if mq.get("peak_bytes") is not None and bf16_peak is not None:
            limit = bf16_peak + a_bytes + go_bytes
            targets.append((
                "peak memory over inputs",
                f"{mq['peak_bytes'] / GIB:.2f} GiB",
                f"<= {limit / GIB:.2f} GiB (bf16 {bf16_peak / GIB:.2f} + A {a_bytes / GIB:.2f} + grad_out {go_bytes / GIB:.2f})",
                mq["peak_bytes"] <= limit,
            ))
        elif not is_cuda:
            targets.append(("peak memory over inputs", "n/a (not CUDA)", "<= bf16 peak + bytes(A) + bytes(grad_out)", None))
        for name, measured, limit, met in targets:
            met_s = "n/a" if met is None else ("yes" if met else "NO")
            if not is_cuda and met is not None:
                met_s += " (CPU smoke: meaningless)"
            target_rows.append([shape_label, name, measured, limit, met_s])
            record["targets"].append({"shape": label, "family": family, "m": m, "target": name, "measured": measured,
                                      "limit": limit, "met": met})

        if args.breakdown:
            def mq_step():
                out = moe_quant_emulated(A, W.transpose(-2, -1), offs)
                torch.autograd.grad(out, (A, W), go)

            def bf16_step():
                out = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs)
                torch.autograd.grad(out, (A, W), go)

            try:
                bd_mq = breakdown(mq_step, device, args.breakdown_iters)
                bd_bf16 = breakdown(bf16_step, device, args.breakdown_iters)
                print_breakdown(shape_label, device, bd_mq, bd_bf16, mq.get("ms"))
                record["breakdown"].append({"shape": label, "family": family, "m": m, "moe_quant": bd_mq, "bf16": bd_bf16})
            except Exception as e:  # noqa: BLE001 -- the timings above stay valid
                print(f"{shape_label}: breakdown failed: {one_line(e)}")
                traceback.print_exc()

        del A, W, go, ref_out, impls
        if is_cuda:
            torch.cuda.empty_cache()
        if len(shapes) > 1:  # progress: this shape's rows now, in case a later shape does not finish
            print_table(f"\n{shape_label} done", MAIN_HEADER, [r for r in rows if r[0] == shape_label])
        write_json(args.json, record)

    print_table(
        f"\nexpert layer fwd+bwd on {record['device']} ({'do_bench median' if is_cuda else 'wall-clock median, smoke run'})",
        MAIN_HEADER,
        rows,
    )
    print_table(
        "\nlayer targets (docs/design.md section 6; for 'moe_quant emulated')",
        ["shape", "target", "measured", "limit", "met"],
        target_rows,
    )
    if args.json:
        print(f"wrote {args.json}")


MAIN_HEADER = ["shape", "implementation", "ms", "x bf16", "speedup vs torchao emu", "peak GiB over inputs",
               "out SQNR dB", "note"]


if __name__ == "__main__":
    main()
