"""The SwiGLU expert block's fwd+bwd live-bytes peak on the CPU, as a GPU with the quantization kernels would see it,
and what is alive at the peak, by stage: bf16, the per-GEMM MXFP8 path (``unfused``) and the fused block, eager and
compiled.

    python -m benchmarks.block_peak [--d 512] [--h 352] [--experts 4] [--rows 384] [--variants bf16,unfused,fused]
        [--modes eager,compiled] [--backend inductor|aot_eager] [--top 12]

One step as ``benchmarks.bench_block`` runs it (``--x routed``: the block gets a fresh copy of x, which only it holds;
y held by the caller through the backward; ``peak``: the most bytes allocated above what existed before the step),
under ``torch.profiler(profile_memory=True)``, which sees every allocation of the CPU allocator, those of inductor's
generated code included. The CPU runs PyTorch's reference quantizers where a GPU runs one kernel per pass, and
those write temporaries (fp32 copies, masks) a kernel does not; so every function that is one kernel on the GPU
(:data:`KERNELS`, and ``torch._grouped_mm``) runs inside a profiler range, and an allocation made in such a range
and freed before it ends is that pass's temporary, not counted: the model's live bytes are the kernels' inputs and
outputs, as on the GPU. The empty-expert zeroing pass the CPU GEMM needs and Hopper's does not is left out (uniform
groups: it changes no value).

Scaling: with uniform groups of ``--rows`` (a multiple of 32: no padding) the peak is a sum of ``(M, D)``, ``(M, H)``
and ``(E, D, H)`` tensors, so a shape with the same ``H / D`` and ``rows / D`` scales by one factor: the default
(D 512, H 352, 4 experts of 384 rows) is DeepSeek-V3 16B's experts (D 2048, H 1408) at 1536 rows an expert
(E 64, M 98304) divided by 256 in every term; ``--scale-to 2048,1408,64,98304`` prints the GiB that arithmetic
predicts there. Each result also names the stage at the peak (the innermost profiler ranges around it: a kernel,
an autograd node, a custom op) and the largest allocations alive then, with the stage that made each.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import warnings
from unittest import mock

import torch

from benchmarks import bench_block
from benchmarks.timing import patched_around, prog_name
from moe_quant import cli
from moe_quant import block_quantize as bq
from moe_quant import quantize as q
from moe_quant.autograd import grouped_mm as gm

KERNELS = [(q, name, "kernel:" + name) for name in (
    "fake_rowwise", "rowwise", "fake_colwise_k_groups", "colwise_k_groups", "colwise_k_groups_plain",
    "dequantize_rows", "fake_3d", "scaled_3d")] + [(bq, name, "kernel:" + name) for name in (
        "dual", "swiglu", "swiglu_rowwise", "swiglu_colwise", "rowwise_and_kept", "dswiglu", "dswiglu_stacked")]
GEMMS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm")
VARIANTS = {"bf16": bench_block.bf16_block,
            **{v: bench_block.VARIANTS[v] for v in ("unfused", "fused", "fused-fp8cols")}}


@contextlib.contextmanager
def as_on_gpu():
    """Within it, each pass of :data:`KERNELS` runs in a ``kernel:`` profiler range, and the weight gradients skip the
    empty-expert zeroing (Hopper's GEMM writes the zeros itself)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched_around(KERNELS, torch.profiler.record_function))
        # (the weight-gradient GEMMs of both paths: grouped_mm's)
        stack.enter_context(mock.patch.object(gm, "grouped_mm_zero_fills_empty_groups", lambda device: True))
        yield


@dataclasses.dataclass
class Peak:
    """One step's peak: ``bytes`` above what existed before it, ``stage`` the profiler ranges around the allocation
    that reached it (outermost first), ``alive`` the allocations made in the step and alive then,
    ``[(bytes, stage)]`` largest first, ``temporaries`` the bytes of the kernel ranges' temporaries left out,
    ``stages`` ``[(name, bytes, stage)]``: the most bytes alive while each autograd node / op (by kernel) ran."""

    bytes: int
    stage: list
    alive: list
    temporaries: int
    stages: list = dataclasses.field(default_factory=list)


def _named(event) -> bool:
    name = event.name
    return (name.startswith(("kernel:", "autograd::engine::evaluate_function", "moe_quant::", *GEMMS,
                             "CompiledFunction", "## Call CompiledFxGraph"))
            or "Backward" in name)


def _a_stage(event) -> bool:
    """An autograd node's backward or one of moe_quant's ops: the steps :attr:`Peak.stages` reports."""
    return event.name.startswith(("autograd::engine::evaluate_function", "moe_quant::"))


def _short(name: str) -> str:
    return name.removeprefix("autograd::engine::evaluate_function: ").removeprefix("moe_quant::")


def _ancestors(event) -> list:
    chain = []
    e = event.parent
    while e is not None:
        chain.append(e)
        e = e.parent
    return chain[::-1]  # outermost first


def peak_of(prof, weigh=None) -> Peak:
    """:class:`Peak` from a ``torch.profiler.profile(profile_memory=True)`` run of one step; ``weigh(size, stage)``,
    where given, the bytes an allocation of ``size`` made in the profiler ranges ``stage`` (outermost first) counts
    as (e.g. its size at another shape: ``scripts/probes/fp8_dswiglu_forms_probe.py``)."""
    events = []

    def walk(e):
        if e.tag == torch._C._profiler._EventType.Allocation:
            events.append(e)
        for c in e.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort(key=lambda e: e.start_time_ns)
    allocs, timeline, temporaries = {}, [], 0
    for e in events:
        size, ptr = e.typed[1].alloc_size, e.typed[1].ptr
        chain = _ancestors(e)
        if size > 0:
            kernel = next((a for a in chain if a.name.startswith("kernel:") or a.name in GEMMS), None)
            step = next((a for a in chain[::-1] if _a_stage(a)), None)
            allocs[ptr] = dict(size=size, t=e.start_time_ns, kernel=kernel, step=step,
                               stage=[a.name for a in chain if _named(a)] or ["(step)"])
            if weigh is not None:
                allocs[ptr]["size"] = weigh(size, allocs[ptr]["stage"])
            timeline.append(("alloc", ptr, allocs[ptr]))
        else:
            a = allocs.pop(ptr, None)
            if a is not None and a["kernel"] is not None and e.start_time_ns <= a["kernel"].end_time_ns:
                a["temporary"] = True  # made and freed inside one kernel's range: not on the GPU
                temporaries += a["size"]
            pre = -size if weigh is None else weigh(-size, [])
            timeline.append(("free", ptr, a if a is not None else dict(size=pre, pre=True)))
    live, best, best_i, alive = 0, -1, 0, {}
    snapshot, stages, names, counts = {}, {}, {}, {}  # stages: the most bytes alive while each node's / op's
    # kernels ran
    for i, (kind, ptr, a) in enumerate(timeline):
        if a.get("temporary"):
            continue
        if kind == "alloc":
            live += a["size"]
            alive[id(a)] = a
            if live > best:
                best, best_i, snapshot = live, i, dict(alive)
            step, kernel = a["step"], a["kernel"]
            if id(step) not in names:  # (None: outside every node and op)
                name = _short(step.name) if step is not None else "(step)"
                counts[name] = counts.get(name, 0) + 1
                names[id(step)] = f"{name}#{counts[name]}"
            if kernel is not None and id(kernel) not in names:
                name = f"{names[id(step)]} {kernel.name.removeprefix('kernel:')}"
                counts[name] = counts.get(name, 0) + 1
                names[id(kernel)] = f"{name} {counts[name]}"
            label = names[id(step)] if kernel is None else names[id(kernel)]
            if live > stages.get(label, (-1,))[0]:
                stages[label] = (live, a["stage"][-1])
        else:
            live -= a["size"]
            alive.pop(id(a), None)
    stage = timeline[best_i][2]["stage"] if timeline else []
    rows = sorted(((a["size"], " > ".join(a["stage"][-2:])) for a in snapshot.values()), reverse=True)
    return Peak(max(best, 0), stage, rows, temporaries, [(k, b, at) for k, (b, at) in stages.items()])


def step_peak(fn, m: int, d: int, h: int, e: int, warmup: int = 1, weigh=None) -> Peak:
    """The :class:`Peak` of one ``benchmarks.bench_block`` step of ``fn`` (x routed), after ``warmup`` steps
    (``weigh``: :func:`peak_of`'s)."""
    x, w1, w3, w2, offs, gy, w13 = bench_block.make_inputs(m, d, h, e, "cpu")
    step = bench_block.step_fn(fn, x, w1, w3, w2, offs, gy, w13, routed=True)
    with as_on_gpu():
        for _ in range(warmup):
            step()
        with warnings.catch_warnings():  # torch 2.11: "Profiler clears events at the end of each cycle" (one here)
            warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
    return peak_of(prof, weigh)


def compiled(fn, backend: str):
    return torch.compile(fn, fullgraph=True, backend=backend)


def sizes(m: int, d: int, h: int, e: int) -> dict:
    """The bytes of the tensors the peak arithmetic counts: ``X`` an (M, D) bf16 tensor, ``Hh`` an (M, H) one,
    ``W`` one expert weight (E, D, H) in bf16."""
    return dict(X=2 * m * d, Hh=2 * m * h, W=2 * e * d * h)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=cli.positive_int, default=512, help="D, a multiple of 32")
    p.add_argument("--h", type=cli.positive_int, default=352, help="H, a multiple of 32")
    p.add_argument("--experts", type=cli.positive_int, default=4)
    p.add_argument("--rows", type=cli.positive_int, default=384, help="rows an expert (a multiple of 32: no padding)")
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=list(VARIANTS))
    p.add_argument("--modes", type=cli.comma_choices("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"], help="the compiled mode's")
    p.add_argument("--scale-to", type=cli.positive_int_list, default=[2048, 1408, 64, 98304],
                   help="D,H,E,M the GiB column predicts")
    p.add_argument("--stages", action="store_true",
                   help="the most bytes alive in each autograd node / custom op, by kernel (its outputs made)")
    p.add_argument("--top", type=cli.non_negative_int, default=0,
                   help="list this many of the largest allocations alive at the peak")
    args = p.parse_args(argv)
    if args.d % 32 or args.h % 32:
        p.error("argument --d / --h: expected multiples of 32")
    if len(args.scale_to) != 4:
        p.error("argument --scale-to: expected D,H,E,M")
    d, h, e = args.d, args.h, args.experts
    m = e * args.rows
    sd, sh, se, sm = args.scale_to
    ours, theirs = sizes(m, d, h, e), sizes(sm, sd, sh, se)
    factor = theirs["X"] / ours["X"]
    if not all(math.isclose(theirs[k] / ours[k], factor) for k in ours):
        print(f"--scale-to {sd},{sh},{se},{sm} is not this shape scaled (X, Hh, W ratios differ): no GiB column")
        factor = None
    print(f"D {d}, H {h}, E {e}, M {m}: X (M, D) {ours['X']} B, Hh (M, H) {ours['Hh']} B, W (E, D, H) {ours['W']} B"
          + (f"; x{factor:g} = D {sd}, H {sh}, E {se}, M {sm}" if factor else ""))
    for mode in args.modes:
        for v in args.variants:
            fn = VARIANTS[v] if mode == "eager" else compiled(VARIANTS[v], args.backend)
            torch._dynamo.reset()
            pk = step_peak(fn, m, d, h, e)
            gib = f" = {pk.bytes * factor / 2**30:.2f} GiB scaled" if factor else ""
            print(f"{v:8} {mode:8} peak {pk.bytes:>10} B{gib}  at: {' > '.join(pk.stage[-3:])}")
            if args.stages:
                for name, b, at in pk.stages:
                    print(f"    {name:50} max {b:>10} B" + (f" = {b * factor / 2**30:.2f} GiB" if factor else "")
                          + f"  at {at}")
            for size, where in pk.alive[:args.top]:
                print(f"    {size:>10} B  ({size / ours['X']:.2f} X, {size / ours['Hh']:.2f} Hh, "
                      f"{size / ours['W']:.2f} W)  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
