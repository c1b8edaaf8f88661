"""Where the time of the SwiGLU expert block's fwd+bwd goes: per variant (``bf16``, ``fused``, ``fused+reuse``,
``fused+reuse-fp8``, eager) the step's time by operand pass and its kernels by family, the step against the sum
of its kernels (the device's idle time), and each weight pass's bytes against a memcpy of as many.

    python -m benchmarks.bench_block_breakdown [--shapes dsv3] [--experts 64] [--m 16384,98304]
        [--variants bf16,fused,fused+reuse,fused+reuse-fp8] [--micro-batches 4] [--json PATH] [--device cpu --tiny]

By operand pass (one step, per micro-batch): the benchmark marks each call of the block's quantization entry points
(:data:`SPANS`: a weight's forward or dgrad operand, and inside it the reuse scope's fp8 form made or read back and
the byte fingerprint; x's rowwise, colwise-kept (or both in one pass) and read-back passes; ``dual(grad_y)``,
``swiglu`` (``swiglu_rowwise``), ``swiglu_colwise``, ``dswiglu``) with CUDA events on the stream (:class:`Spans`; the
host's clock on the CPU): each pass's time is the device time between its marks, less the passes nested in it;
``outside`` is the rest of the step (the GEMMs, torch's ops, idle time). They add up to the marked step. By kernel
family (torch.profiler, one step): the CuTe-DSL kernels by class (1x32, 32x1, block, the permute kernel's
dequantization, fingerprint), the grouped GEMMs, the rest by name (on the CPU: the aten ops' self time). (Not by
profiler ranges: torch 2.11's profiler linked no kernel to its launching op on the H200, 2026-12-02.) ``wall``:
``do_bench`` median;
``idle`` = marked step - kernel sum (one stream: time the device waited); ``host``: the Python time to enqueue a
step. The weight passes' table times each pass alone on the block's weights and gives its bytes (read + written)
against a memcpy of as many bytes in the same run: the floor of a pass that must move them.

``--device cpu --tiny`` is a smoke run of every path (the reference quantization; timings meaningless).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
import threading
import time

import torch

from benchmarks.bench_block import SHAPES, TINY_SHAPES, VARIANTS, hold_of, make_inputs, micro_batches_of, step_fn
from benchmarks.timing import (bench_ms, device_name, print_table, prog_name, patched_around, profile_device_ops,
                               write_json)
from moe_quant import block_quantize, cli, reuse
from moe_quant.autograd import grouped_mm, swiglu_block
from moe_quant.backends import GemmBackend
from moe_quant.numerics import BLOCK_SIZE, ScaleMode

DEFAULT_VARIANTS = ["bf16", "fused", "fused+reuse", "fused+reuse-fp8"]
# (module, function, label): the block's quantization entry points; a label with "{gemm}" names the weight
# operand's GEMM ("fwd": blocks along K, "dgrad": along N). Sub-spans (:data:`SUB`) name what part of a weight
# operand ran: the reuse scope's fp8 form made, read back, or its byte fingerprint.
SPANS = (
    (swiglu_block, "weight_operand", "weights {gemm}"),
    (grouped_mm, "weight_operand", "weights {gemm}"),
    (grouped_mm, "_kept_weight", "fp8 form made"),
    (grouped_mm, "_read_kept", "fp8 form read back"),
    (reuse, "fingerprint", "fingerprint"),
    (block_quantize, "rowwise_and_kept", "x rowwise and kept"),
    (block_quantize, "rowwise", "x rowwise"),
    (block_quantize, "colwise_kept", "x colwise kept"),
    (block_quantize, "colwise_operand", "x colwise read back"),
    (block_quantize, "dual", "grad_y dual"),
    (block_quantize, "swiglu", "swiglu"),
    (block_quantize, "swiglu_rowwise", "swiglu"),
    (block_quantize, "swiglu_colwise", "swiglu colwise"),
    (block_quantize, "dswiglu", "dswiglu"),
    (block_quantize, "dswiglu_stacked", "dswiglu"),
)
SUB = ("fp8 form made", "fp8 form read back", "fingerprint")
OUTSIDE = "outside (GEMMs, torch ops, idle)"
# CuTe-DSL kernels by the class their name carries (the block kernel's class subclasses the 32x1 kernel's: first)
KERNEL_FAMILIES = (("QuantizeBlock", "block"), ("Quantize1x32", "1x32"), ("Quantize32x1", "32x1"),
                   ("PermuteMxfp8", "dequant (permute)"), ("Fingerprint", "fingerprint"))
GEMM_MARKS = ("gemm", "cutlass::device_kernel", "nvjet", "xmma", "wgmma")  # lower-case name substrings
GEMM_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::mm")  # CPU: the grouped mm's aten::mm loop


def _label_of(label: str, args: tuple, kwargs: dict) -> str:
    """``label`` of a call with ``args`` and ``kwargs``, its ``{gemm}`` filled in."""
    if "{gemm}" in label:  # weight_operand(W_t, mode, backend, gemm, scopes)
        return label.format(gemm=kwargs.get("gemm", args[3] if len(args) > 3 else "?"))
    return label


class Spans:
    """Marks on the step's timeline around each call of :data:`SPANS`: CUDA events recorded on the current stream
    (the device's timeline: one stream, so a call's span holds exactly the work it enqueued, and the idle time
    inside it), or the host's clock on any other device. Nested calls (a weight operand's fp8 form inside it) are
    the children of the call they run in, on the thread they run on."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.calls: list = []  # [path of labels, outermost first; start mark; end mark; parent index or None]
        self._stack = threading.local()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)

    @contextlib.contextmanager
    def span(self, label: str):
        stack = self._stack.__dict__.setdefault("open", [])
        parent = stack[-1] if stack else None
        path = (self.calls[parent][0] if parent is not None else ()) + (label,)
        call = [path, self.mark(), None, parent]
        self.calls.append(call)
        stack.append(len(self.calls) - 1)
        try:
            yield
        finally:
            stack.pop()
            call[2] = self.mark()

    def around(self):
        """Within it, each function of :data:`SPANS` is marked."""
        return patched_around(((module, name, functools.partial(_label_of, label)) for module, name, label in SPANS),
                              self.span)

    def categories(self, start, end) -> list[dict]:
        """The time between the marks ``start`` and ``end`` by operand pass: each call's exclusive time (its span less
        its children's) under :func:`operand` of its path, the rest under :data:`OUTSIDE`; ms and calls, largest
        first. They add up to the span from ``start`` to ``end``."""
        incl = [self.ms(c[1], c[2]) for c in self.calls]
        excl = list(incl)
        for i, c in enumerate(self.calls):
            if c[3] is not None:
                excl[c[3]] -= incl[i]
        cats: dict = collections.defaultdict(lambda: [0.0, 0])
        for c, t in zip(self.calls, excl):
            cat = cats[operand(c[0])]
            cat[0] += t
            cat[1] += 1
        top = sum(t for c, t in zip(self.calls, incl) if c[3] is None)
        cats[OUTSIDE] = [self.ms(start, end) - top, 0]
        return sorted(({"operand": k, "ms": v[0], "calls": v[1]} for k, v in cats.items()), key=lambda r: -r["ms"])


def family(name: str, scopes: tuple = ()) -> str:
    """A kernel's family: a CuTe-DSL class (:data:`KERNEL_FAMILIES`), ``GEMM`` (by name or, where the profiler links
    it, the grouped-mm op that launched it), else ``torch <op>`` (on the CPU the op itself, on CUDA the op that
    launched it where the profiler links it) or ``torch copy`` / ``torch memset`` / ``torch kernel`` by its name."""
    for marker, fam in KERNEL_FAMILIES:
        if marker in name:
            return fam
    low = name.lower()
    if any(m in low for m in GEMM_MARKS) or any(s in GEMM_OPS for s in scopes) or name in GEMM_OPS:
        return "GEMM"
    op = next((s for s in scopes if s.startswith("aten::")), None)
    if op is not None:
        return f"torch {op}"
    return "torch copy" if "memcpy" in low or "copy" in low else "torch memset" if "memset" in low else "torch kernel"


def operand(path: tuple) -> str:
    """The operand pass of a call whose spans are ``path`` (outermost first): the outermost that is not a
    sub-span, with the innermost sub-span (:data:`SUB`) after a slash."""
    top = next((lab for lab in path if lab not in SUB), None)
    sub = next((lab for lab in reversed(path) if lab in SUB), None)
    return " / ".join(x for x in (top, sub) if x)


def families(ops: list[dict], micro_batches: int) -> list[dict]:
    """``ops`` (:func:`benchmarks.timing.profile_device_ops` of one step) by :func:`family`: ms and launches per
    micro-batch, largest first."""
    fams: dict = collections.defaultdict(lambda: [0.0, 0])
    for op in ops:
        f = fams[family(op["name"], op["scopes"])]
        f[0] += op["us"]
        f[1] += 1
    rows = [{"family": k, "ms": us / micro_batches / 1e3, "count": n / micro_batches} for k, (us, n) in fams.items()]
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


def breakdown(step, micro_batches: int, device) -> dict:
    """One variant's numbers per micro-batch: ``wall_ms`` (``do_bench``), ``host_ms`` (enqueue time; for a
    ``+reuse`` step it includes the scope's exit check, which waits for the device), ``operands`` (one marked step:
    :meth:`Spans.categories`; ``step_ms``, the marked step's span, what they add up to), ``families`` (one profiled
    step: :func:`families`; ``kernel_ms``, their sum) and ``idle_ms`` = ``step_ms`` - ``kernel_ms`` (CUDA: time the
    device waited, one stream)."""
    step()  # warm: kernels compiled, the allocator's blocks cached
    wall = bench_ms(step, device) / micro_batches
    host = host_ms(step, device)
    spans = Spans(device)
    with spans.around():
        if spans.cuda:
            torch.cuda.synchronize(device)
        start = spans.mark()
        step()
        end = spans.mark()
        if spans.cuda:
            torch.cuda.synchronize(device)
    step_ms = spans.ms(start, end) / micro_batches
    ops = [dict(c, ms=c["ms"] / micro_batches, calls=c["calls"] / micro_batches) for c in spans.categories(start, end)]
    fams = families(profile_device_ops(step, device, iters=1), micro_batches)
    kernel = sum(f["ms"] for f in fams)
    return dict(wall_ms=wall, step_ms=step_ms, kernel_ms=kernel, idle_ms=step_ms - kernel if spans.cuda else None,
                host_ms=None if host is None else host / micro_batches, operands=ops, families=fams)


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
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (smoke runs)")
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms_list = args.m or ([1024] if args.tiny else [16384, 98304])
    e = args.experts
    mode = ScaleMode.RCEIL
    where = device_name() if device.type == "cuda" else "cpu: the host's clock, aten ops' self time"
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
                               hold=hold_of(v))
                rec = dict(shape=shape, m=m, d=d, h=h, experts=e, variant=v, micro_batches=mbs,
                           **breakdown(step, mbs, device))
                results.append(rec)
                total = rec["step_ms"]
                rows = [[c["operand"], c["ms"], f"{c['calls']:g}", f"{100 * c['ms'] / total:.1f}" if total else "-"]
                        for c in rec["operands"]]
                rows.append(["step", total, f"{sum(c['calls'] for c in rec['operands']):g}",
                             f"{100 * sum(c['ms'] for c in rec['operands']) / total:.1f}" if total else "-"])
                print_table(f"\n{shape} M={m} E={e} {v}: the step by operand pass, ms per micro-batch ({where}, "
                            f"{mbs} micro-batch(es); a pass's nested passes counted apart)",
                            ["operand pass", "ms", "calls", "%"], rows)
                kernel = rec["kernel_ms"]
                rows = [[f["family"], f["ms"], f"{f['count']:g}", f"{100 * f['ms'] / kernel:.1f}" if kernel else "-"]
                        for f in rec["families"]]
                rows.append(["kernels", kernel, f"{sum(f['count'] for f in rec['families']):g}", "100.0"])
                print_table(f"\n{shape} M={m} E={e} {v}: kernels by family, ms per micro-batch ({where})",
                            ["family", "ms", "count", "%"], rows)
                summary.append(rec)
            base = next((r for r in summary if r["variant"] == "bf16"), None)
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print_table(f"\n{shape} M={m} E={e}: per micro-batch (ms; wall: do_bench; step: the marked step; idle = "
                        f"step - kernels; host: enqueue time)",
                        ["variant", "wall", "step", "kernels", "idle", "host", "wall vs bf16", "gap to bf16"],
                        [[r["variant"], fmt(r["wall_ms"]), fmt(r["step_ms"]), fmt(r["kernel_ms"]), fmt(r["idle_ms"]),
                          fmt(r["host_ms"]),
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
