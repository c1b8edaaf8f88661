"""Where the time of the SwiGLU expert block's fwd+bwd goes: per variant (``bf16``, ``fused``, ``fused+reuse``,
eager) the device time of one step by category, the step's wall time against the sum of its kernels, and each
weight pass's bytes against a memcpy of as many.

    python -m benchmarks.bench_block_breakdown [--shapes dsv3] [--experts 64] [--m 16384,98304]
        [--variants bf16,fused,fused+reuse] [--micro-batches 4] [--json PATH] [--device cpu --tiny]

Categories (torch.profiler, one profiled step, per micro-batch): every kernel is attributed to the operand pass
that launched it by a profiler range this benchmark puts around the block's quantization entry points
(:data:`RANGES`: a weight's forward or dgrad operand, and inside it the reuse scope's fp8 form made or read back
and the byte fingerprint; x's rowwise, colwise-kept and read-back passes; ``dual(grad_y)``, ``swiglu``,
``swiglu_colwise``, ``dswiglu``), and to a family by its name (the CuTe-DSL kernels by class: 1x32, 32x1,
block, the permute kernel's dequantization, fingerprint; the grouped GEMMs, forward or backward; any other
kernel by the torch op that launched it, so copies and elementwise passes show by name). The categories add up
to the step's kernel sum. ``wall``: the step's time (``do_bench`` median); ``idle`` = wall - kernel sum: time the
GPU waited for the host (one stream, so kernels never overlap); ``host``: the Python time to enqueue a step.
The weight passes' table times each pass alone on the block's weights and gives its bytes (read + written)
against a memcpy of as many bytes in the same run: the floor of a pass that must move them.

``--device cpu --tiny`` is a smoke run of every path (the reference quantization: aten ops' self CPU time for
kernels, timings meaningless).
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time

import torch

from benchmarks.bench_block import SHAPES, TINY_SHAPES, VARIANTS, make_inputs, micro_batches_of, step_fn
from benchmarks.timing import (bench_ms, device_name, print_table, prog_name, profile_device_ops, profiler_ranges,
                               write_json)
from moe_quant import block_quantize, cli, reuse
from moe_quant.autograd import grouped_mm, swiglu_block
from moe_quant.backends import GemmBackend
from moe_quant.numerics import BLOCK_SIZE, ScaleMode

DEFAULT_VARIANTS = ["bf16", "fused", "fused+reuse"]
RANGE = "bd: "  # the prefix of this benchmark's profiler ranges
# (module, function, label): the block's quantization entry points; a label with "{gemm}" names the weight
# operand's GEMM ("fwd": blocks along K, "dgrad": along N). Sub-ranges (:data:`SUB`) name what part of a weight
# operand ran: the reuse scope's fp8 form made, read back, or its byte fingerprint.
RANGES = (
    (swiglu_block, "weight_operand", "weights {gemm}"),
    (grouped_mm, "weight_operand", "weights {gemm}"),
    (grouped_mm, "_kept_weight", "fp8 form made"),
    (grouped_mm, "_read_kept", "fp8 form read back"),
    (reuse, "fingerprint", "fingerprint"),
    (block_quantize, "rowwise", "x rowwise"),
    (block_quantize, "colwise_kept", "x colwise kept"),
    (block_quantize, "colwise_operand", "x colwise read back"),
    (block_quantize, "dual", "grad_y dual"),
    (block_quantize, "swiglu", "swiglu"),
    (block_quantize, "swiglu_colwise", "swiglu colwise"),
    (block_quantize, "dswiglu", "dswiglu"),
    (block_quantize, "dswiglu_stacked", "dswiglu"),
)
SUB = ("fp8 form made", "fp8 form read back", "fingerprint")
# CuTe-DSL kernels by the class their name carries (the block kernel's class subclasses the 32x1 kernel's: first)
KERNEL_FAMILIES = (("QuantizeBlock", "block"), ("Quantize1x32", "1x32"), ("Quantize32x1", "32x1"),
                   ("PermuteMxfp8", "dequant (permute)"), ("Fingerprint", "fingerprint"))
GEMM_MARKS = ("gemm", "cutlass::device_kernel", "nvjet", "xmma", "wgmma")  # lower-case name substrings
GEMM_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::mm")  # CPU: the grouped mm's aten::mm loop
UNLABELED = "-"


def _label_of(label: str, args: tuple, kwargs: dict) -> str:
    """``label`` of a call with ``args`` and ``kwargs``, its ``{gemm}`` filled in."""
    if "{gemm}" in label:  # weight_operand(W_t, mode, backend, gemm, scopes)
        return label.format(gemm=kwargs.get("gemm", args[3] if len(args) > 3 else "?"))
    return label


def operand_ranges():
    """Within it, each function of :data:`RANGES` runs inside a profiler range ``"bd: <label>"``."""
    return profiler_ranges((module, name, functools.partial(_label_of, RANGE + label))
                           for module, name, label in RANGES)


def family(name: str, scopes: tuple) -> str:
    """A kernel's family: a CuTe-DSL class (:data:`KERNEL_FAMILIES`), ``GEMM fwd`` / ``GEMM bwd`` (by name or the
    grouped-mm op that launched it; bwd where an autograd node runs it), else ``torch <op>`` (the aten op that
    launched it, or on the CPU the op itself; ``torch copy`` / ``torch memset`` / ``torch kernel`` where the
    profiler names none)."""
    for marker, fam in KERNEL_FAMILIES:
        if marker in name:
            return fam
    low = name.lower()
    if any(m in low for m in GEMM_MARKS) or any(s in GEMM_OPS for s in scopes) or name in GEMM_OPS:
        return "GEMM bwd" if any("Backward" in s for s in scopes) else "GEMM fwd"
    op = next((s for s in scopes if s.startswith("aten::")), None)
    if op is not None:
        return f"torch {op}"
    return "torch copy" if "memcpy" in low or "copy" in low else "torch memset" if "memset" in low else "torch kernel"


def operand(scopes: tuple) -> str:
    """The operand pass a kernel belongs to: the outermost of this benchmark's ranges around its launch, with the
    innermost sub-range (:data:`SUB`) after a slash; :data:`UNLABELED` outside them."""
    labels = [s[len(RANGE):] for s in scopes if s.startswith(RANGE)]  # innermost first
    if not labels:
        return UNLABELED
    top = next((lab for lab in reversed(labels) if lab not in SUB), None)
    sub = next((lab for lab in labels if lab in SUB), None)
    return " / ".join(x for x in (top, sub) if x)


def categorize(ops: list[dict], micro_batches: int, steps: int) -> list[dict]:
    """``ops`` (:func:`benchmarks.timing.profile_device_ops` of ``steps`` steps) by ``(operand, family)``: ms and
    launches per micro-batch, largest first. Every op is in exactly one category."""
    cats: dict = collections.defaultdict(lambda: [0.0, 0])
    for op in ops:
        c = cats[operand(op["scopes"]), family(op["name"], op["scopes"])]
        c[0] += op["us"]
        c[1] += 1
    per = micro_batches * steps
    rows = [{"operand": o, "family": f, "ms": us / per / 1e3, "count": n / per} for (o, f), (us, n) in cats.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def host_ms(step, device) -> float | None:
    """Host time to enqueue one ``step()`` on an idle GPU (None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    t = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return 1e3 * t


def breakdown(step, micro_batches: int, device, steps: int = 1) -> dict:
    """One variant's numbers per micro-batch: ``wall_ms``, ``kernel_ms`` (every profiled kernel's time: what the
    categories add up to), ``idle_ms``, ``host_ms`` (for a ``+reuse`` step it includes the scope's exit check, which
    waits for the device), ``categories`` (:func:`categorize`), ``unlinked_ms`` (kernels the profiler tied to no
    op)."""
    step()  # warm: kernels compiled, the allocator's blocks cached
    wall = bench_ms(step, device) / micro_batches
    host = host_ms(step, device)
    with operand_ranges():
        ops = profile_device_ops(step, device, iters=steps)
    per = micro_batches * steps
    kernel = sum(op["us"] for op in ops) / per / 1e3
    return dict(wall_ms=wall, kernel_ms=kernel, idle_ms=wall - kernel if device.type == "cuda" else None,
                host_ms=None if host is None else host / micro_batches,
                categories=categorize(ops, micro_batches, steps), unlinked_ms=sum(op["us"] for op in ops if not op["linked"]) / per / 1e3)


# ----------------------------------------------------------------------------- the weight passes alone


def weight_passes(w: torch.Tensor, mode: ScaleMode, device) -> list[dict]:
    """Each pass the block runs over an expert weight ``w (E, N, K)`` (bf16), alone: the emulated GEMM's forward
    and dgrad operands (bf16, blocks along K / N), the reuse scope's fp8 forms of both made and read back; per pass
    ``ms``, ``bytes`` (read + written once each) and ``memcpy_ms``, a device copy of as many bytes."""
    n = w.numel()
    fp8 = n + n // BLOCK_SIZE  # e4m3 data and e8m0 scales
    W_t = w.transpose(-2, -1)
    kept = {g: grouped_mm._kept_weight(W_t, mode, g) for g in ("fwd", "dgrad")}
    passes = []
    for gemm, along in (("fwd", "K"), ("dgrad", "N")):
        passes += [
            (f"bf16 operand along {along} ({gemm})", 4 * n,
             lambda g=gemm: grouped_mm.weight_operand(W_t, mode, GemmBackend.EMULATED, g, ())),
            (f"fp8 form along {along} made (reuse)", 2 * n + fp8, lambda g=gemm: grouped_mm._kept_weight(W_t, mode, g)),
            (f"fp8 form along {along} read back (reuse)", fp8 + 2 * n,
             lambda g=gemm: grouped_mm._read_kept(kept[g], g)),
        ]
    out = []
    for name, nbytes, fn in passes:
        ms = bench_ms(fn, device)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = bench_ms(lambda: dst.copy_(src), device)
        del src, dst
        out.append(dict(weight=tuple(w.shape), name=name, ms=ms, bytes=nbytes, memcpy_ms=copy_ms))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=cli.comma_choices(*SHAPES), default=["dsv3"])
    p.add_argument("--m", type=cli.positive_int_list, default=None, help="tokens per step (default 16384,98304)")
    p.add_argument("--experts", type=cli.positive_int, default=64)
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=DEFAULT_VARIANTS)
    p.add_argument("--micro-batches", type=cli.positive_int, default=4,
                   help="fwd+bwd passes per step of the +reuse variants (weights quantized once per step)")
    p.add_argument("--profile-steps", type=cli.positive_int, default=1, help="steps profiled per variant")
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (smoke runs)")
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms_list = args.m or ([1024] if args.tiny else [16384, 98304])
    e = args.experts
    mode = ScaleMode.RCEIL
    where = device_name() if device.type == "cuda" else "cpu (aten ops' self time, not kernels)"
    results = []
    for shape in args.shapes:
        d, h = shapes[shape]
        for m in ms_list:
            m = max(8 * e, m // (8 * e) * (8 * e))  # even groups, each a multiple of 8
            inputs = make_inputs(m, d, h, e, device)
            summary = []
            for v in args.variants:
                mbs = micro_batches_of(v, args.micro_batches)
                step = step_fn(VARIANTS[v], *inputs, micro_batches=mbs, concatenated="w13" in v, routed=True,
                               hold="bf16" if v.endswith("-bf16") else "fp8")
                rec = dict(shape=shape, m=m, d=d, h=h, experts=e, variant=v, micro_batches=mbs,
                           **breakdown(step, mbs, device, args.profile_steps))
                results.append(rec)
                total = rec["kernel_ms"]
                rows = [[c["operand"], c["family"], c["ms"], f"{c['count']:g}",
                         f"{100 * c['ms'] / total:.1f}" if total else "-"] for c in rec["categories"]]
                rows.append(["total", "kernels", total, f"{sum(c['count'] for c in rec['categories']):g}",
                             f"{100 * sum(c['ms'] for c in rec['categories']) / total:.1f}" if total else "-"])
                print_table(f"\n{shape} M={m} E={e} {v}: kernel time per micro-batch by operand pass and family "
                            f"({where}, {args.profile_steps} profiled step(s) of {mbs} micro-batch(es))",
                            ["operand", "family", "ms", "count", "%"], rows)
                if rec["unlinked_ms"]:
                    print(f"note: {rec['unlinked_ms']:.3g} ms per micro-batch of kernels the profiler tied to no "
                          "launching op or range (operand '-', family by kernel name)")
                summary.append(rec)
            base = next((r for r in summary if r["variant"] == "bf16"), None)
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print_table(f"\n{shape} M={m} E={e}: per micro-batch (ms; idle = wall - kernels; host: enqueue time)",
                        ["variant", "wall", "kernels", "idle", "host", "wall vs bf16", "gap to bf16"],
                        [[r["variant"], fmt(r["wall_ms"]), fmt(r["kernel_ms"]), fmt(r["idle_ms"]), fmt(r["host_ms"]),
                          "-" if base is None else f"{r['wall_ms'] / base['wall_ms']:.3f}x",
                          "-" if base is None else fmt(r["wall_ms"] - base["wall_ms"])] for r in summary])
            del inputs
        # the weight passes alone (they do not depend on M): w1 / w3 (E, H, D) and w2 (E, D, H)
        g = torch.Generator(device=device).manual_seed(0)
        passes = []
        for shape_w in ((e, h, d), (e, d, h)):
            w = (torch.randn(shape_w, device=device, generator=g) * 0.02).bfloat16()
            passes += weight_passes(w, mode, device)
            del w
        results.append(dict(shape=shape, experts=e, weight_passes=passes))
        print_table(f"\n{shape} E={e}: each weight pass alone ({where}; bytes read + written; memcpy: a device copy "
                    f"of as many bytes, same run)",
                    ["weight", "pass", "ms", "GB", "memcpy ms", "% of memcpy"],
                    [[str(r["weight"]), r["name"], f"{r['ms']:.3f}", f"{r['bytes'] / 1e9:.2f}", f"{r['memcpy_ms']:.3f}",
                      f"{100 * r['memcpy_ms'] / r['ms']:.1f}"] for r in passes])
    write_json(args.json, dict(device=device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                               results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
