"""What a torchtitan user gains or loses by converting the experts and by the MXFP8 wire, on the GPUs it finds::

    python -m examples.titan.bench --out out/titan_bench                          # every variant, eager and compiled
    python -m examples.titan.bench --out out/titan_bench --modes eager --steps 40 --layers 3

Each variant of :mod:`examples.titan.config_registry` (``bf16``, ``converted``, ``mxfp8``, ``mxfp8_sync_free``), in
each mode (``eager``; ``compiled``: torchtitan's ``--compile.enable``), is one job of torchtitan's trainer
(``torchrun --nproc_per_node <GPUs> -m examples.titan.launch``), FSDP and expert parallelism over every GPU. From
the job's per-rank metrics (:mod:`examples.titan.metrics`, torchtitan's own numbers):

* tokens/s per GPU: torchtitan's ``throughput(tps)`` of each rank, the median over the steps after ``--warmup``
  (the profiled last two steps left out) and over the ranks, with the spread (min, max over those steps and ranks);
* peak memory per GPU: the largest ``memory/max_reserved(GiB)`` (and ``max_active``) of each rank; on CUDA also
  the peak device memory, the largest over ranks and steps of ``max_reserved`` plus what the allocator does not
  hold (``moe_quant/outside_allocator(GiB)``: CUDA context, NCCL's buffers), what a GPU must have for the job
  (``-- --moe_quant.memory_gib G`` caps the allocator, so a job that needs more than a smaller GPU fails), and
  torchtitan's count of allocation retries (the allocator found no free memory, freed its cache and tried again:
  a job that fits only just pays for each);
* the loss curve (the global average loss of every step), and the final loss: the mean of the last ``--tail``
  (20) steps' losses (every variant sees the same batches, so the curves are paired step by step; see
  :data:`TAIL` for why 20);
* the all-to-all time per leg, from torchtitan's profiler (``--profiler.enable_profiling``, the last step): the
  NCCL all-to-all kernels of that step (``ncclDevKernel_SendRecv``: ``all_to_all_single`` is grouped
  send/recv), in their order: per MoE layer forward the counts, dispatch and combine exchanges, backward the
  combine and dispatch exchanges (in reverse layer order; :data:`KERNEL_LEGS`: torchtitan's dispatcher makes
  one kernel per leg, moe_quant's on the MXFP8 wire two for each MXFP8 leg, the data and the scales, summed);
  the median over the layers and ranks of each leg. A step whose kernel count does not match is reported
  unattributed (``n/a``), never guessed. The kernel times are kept in ``bench.json``, so ``--report-only``
  attributes them again;
* the host's waits for the device in the same profiled step (the most of the ranks): device-to-host copies and
  the synchronizing calls (a blocking copy's stream sync, a pinned copy's event sync; :data:`SYNC_CALLS`). Every
  variant makes the same ones outside the MoE layers (the loss logged every step, ...), so their difference is
  the token dispatchers' (one host read per MoE layer forward for the synced ones, none for the sync-free one).

``--variants plain_bf16`` (with ``--nproc 1``) adds a row that is no trainer job: :mod:`examples.titan.plain_loop`,
a plain bf16 training loop of the same model and batch on one GPU (bf16 parameters and AdamW states, no FSDP),
the speed the trainer's ``bf16`` variant should come near; the table says the bf16 variant's time per step as a
multiple of its, per mode, and the loss check leaves it out.

Every finished job adds its row at once to ``<out>/bench.json``, ``<out>/bench.md`` (the table) and
``<out>/losses.png`` (every variant's loss curve): a run killed at its time limit keeps what finished, and a
later run with the same ``--out`` skips what is there from a run of the same settings (``--redo`` runs it
again). After each job it prints its wall time and an estimate for the jobs left; ``--budget`` seconds: launch
no job the estimate says would not finish in time. At the end it checks every MXFP8 variant's final loss
within ``--loss-rtol`` (0.5%) of bf16's in the same mode (exit status 1 otherwise). Arguments after ``--`` go
to every job (torchtitan's command line).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from examples.titan import runs

RETRIES = "memory/num_alloc_retries"  # torchtitan's: the allocator freed its cache and retried (cumulative)
OUTSIDE = "moe_quant/outside_allocator(GiB)"  # examples.titan.metrics: device memory the allocator does not hold
# The final loss is the mean of the last TAIL steps. The curves are paired (the same batches), but runs are not
# deterministic: on 4 H200s at 10 layers (2026-11-29) each variant's per-step loss differed from bf16's by a
# standard deviation of 0.74-1.19% (steps 51-100), so a 10-step mean moves by about 0.3% and the 0.5% check would
# fail about one run in ten with no difference at all; 20 steps halve that variance.
TAIL = 20
A2A_KERNEL = re.compile(r"SendRecv|AllToAll|alltoall", re.IGNORECASE)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
LEGS_FORWARD = ("counts", "dispatch", "combine")
LEGS_BACKWARD = ("combine backward", "dispatch backward")
# The all-to-all kernels of one MoE layer, in launch order (forward, backward), per token dispatcher: torchtitan's
# (and moe_quant's on the bf16 wire) one per leg; moe_quant's on the MXFP8 wire (synced or sync-free) sends each
# MXFP8 leg as two exchanges, the data and the scales (moe_quant.ep.wire.all_to_all_mxfp8).
KERNEL_LEGS = {
    "one per leg": (LEGS_FORWARD, LEGS_BACKWARD),
    "mxfp8 wire": (("counts", "dispatch", "dispatch", "combine"),
                   ("combine backward", "combine backward", "dispatch backward")),
}


def kernel_legs_of(setup: dict | None) -> str:
    """The :data:`KERNEL_LEGS` key of a job, from what it built (``parallelize.describe``: rank 0's setup)."""
    settings = (setup or {}).get("dispatcher_settings") or [{}]
    return "mxfp8 wire" if settings[0].get("wire") == "mxfp8" else "one per leg"


PLAIN = "plain_bf16"  # examples.titan.plain_loop: a plain bf16 loop of the same model and batch (one GPU)


def parse_args(argv=None):
    p, argv, extra = runs.parser(__doc__, argv, layers=4, steps=100, modes="eager,compiled", timeout=1800.0)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput statistics")
    p.add_argument("--tail", type=int, default=None,
                   help=f"final loss: mean of the last N steps (default {TAIL}; with --report-only the record's own "
                        "unless given: then each final loss is taken again from its stored curve)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="torchtitan's profiler on the last step (all-to-all time per leg)")
    p.add_argument("--loss-rtol", type=float, default=0.005)
    p.add_argument("--budget", type=float, default=None, help="seconds: launch no job that would not finish in time")
    p.add_argument("--redo", action="store_true", help="run jobs whose results are already in --out again")
    p.add_argument("--report-only", action="store_true", help="rewrite bench.md, losses.png and the check only")
    args = p.parse_args(argv)
    args.extra = extra
    args.variants = runs.names(p, "--variants", args.variants, runs.VARIANTS + (PLAIN,))
    args.modes = runs.names(p, "--modes", args.modes, ("eager", "compiled"))
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    if PLAIN in args.variants and args.nproc != 1:
        p.error(f"--variants {PLAIN} (a one-GPU loop) needs --nproc 1")
    if not 0 <= args.warmup < args.steps - (2 if args.profile else 0):
        p.error("--warmup must leave at least one timed step (the profiled last two steps are not timed)")
    args.tail_given = args.tail is not None
    args.tail = TAIL if args.tail is None else args.tail
    if not 1 <= args.tail <= args.steps and not args.report_only:
        p.error("--tail must be in [1, --steps]")
    if args.tail < 1:
        p.error("--tail must be at least 1")
    return args


def job_args(args, mode: str) -> list[str]:
    a = ["--moe_quant.layers", str(args.layers), "--training.steps", str(args.steps), "--metrics.log_freq", "1"]
    if mode == "compiled":
        a.append("--compile.enable")
    if args.profile:  # torch.profiler schedule: wait steps - 2, warm up 1, record the last step
        a += ["--profiler.enable_profiling", "--profiler.profile_freq", str(args.steps),
              "--profiler.profiler_warmup", "1", "--profiler.profiler_active", "1"]
    return a + args.extra


def plain_command(args, mode: str, dump: str) -> list[str]:
    """The :data:`PLAIN` row's job: :mod:`examples.titan.plain_loop` on one GPU with the bench's flavour, layers and
    steps, its profiler on the last step where the trainer's is (the arguments after ``--`` are torchtitan's: not
    passed)."""
    a = ["--dump-folder", dump, "--flavor", args.flavor, "--layers", str(args.layers), "--steps", str(args.steps)]
    a += ["--profile"] if args.profile else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "examples.titan.plain_loop", *a] + (["--compile"] if mode == "compiled" else [])


def final_loss(curve: list, tail: int) -> float | None:
    """The mean of the last ``tail`` losses of a curve (None where it is shorter)."""
    return statistics.fmean(curve[-tail:]) if len(curve) >= tail else None


def _known(x):
    """None for torchtitan's -1: a memory statistic the device lacks (the CPU)."""
    return None if x is None or x < 0 else x


def _spread(values: list) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _trace_events(trace_path: str) -> list:
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt", encoding="utf-8") as f:
        return json.load(f).get("traceEvents", [])


def step_syncs(trace_path: str) -> dict:
    """The host's waits for the device in one rank's profiled step: ``d2h_copies`` (device-to-host memcpys) and
    ``host_syncs`` (:data:`SYNC_CALLS`: a blocking copy's stream sync, a pinned copy's event sync, ...)."""
    events = _trace_events(trace_path)
    return {"d2h_copies": sum(e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "") for e in events),
            "host_syncs": sum(e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS for e in events)}


def a2a_kernels(trace_path: str) -> dict:
    """The all-to-all kernels of one rank's profiled step: their names and their times (ms) in launch order."""
    events = _trace_events(trace_path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and A2A_KERNEL.search(e.get("name", ""))),
                     key=lambda e: e.get("ts", 0))
    return {"names": sorted({e["name"] for e in kernels}), "ms": [e.get("dur", 0) / 1e3 for e in kernels]}


def a2a_legs(trace_path: str, moe_layers: int, kernel_legs: str = "one per leg") -> dict:
    """The all-to-all kernels of one rank's profiled step, attributed to legs by their order (see the module doc)."""
    res = a2a_kernels(trace_path)
    return res | attribute_legs(res["ms"], moe_layers, kernel_legs)


def attribute_legs(ms: list, moe_layers: int, kernel_legs: str) -> dict:
    """Kernel times of a step, in launch order, to legs by the :data:`KERNEL_LEGS` pattern: per layer, the forward
    pattern (layers in order), then the backward pattern (layers in reverse); a leg of several kernels is their sum.
    ``{"attributed": False, ...}`` where the count does not match the pattern."""
    forward, backward = KERNEL_LEGS[kernel_legs]
    expected = moe_layers * (len(forward) + len(backward))
    if len(ms) != expected:
        return {"attributed": False, "kernels": len(ms), "expected": expected, "kernel_legs": kernel_legs}
    legs = {leg: [] for leg in LEGS_FORWARD + LEGS_BACKWARD}
    i = 0
    for pattern in [forward] * moe_layers + [backward] * moe_layers:
        layer = {}
        for leg in pattern:
            layer[leg] = layer.get(leg, 0.0) + ms[i]
            i += 1
        for leg, t in layer.items():
            legs[leg].append(t)
    return {"attributed": True, "kernels": len(ms), "kernel_legs": kernel_legs, "legs_ms": legs}


def _a2a_summary(res: dict, moe_layers: int) -> None:
    """``res["a2a_ms"]``: each leg's median over layers and ranks, from the kernel times in ``res["a2a_per_rank"]``."""
    kernel_legs = kernel_legs_of(res.get("setup"))
    legs = {}
    for rank, r in res["a2a_per_rank"].items():
        if "ms" in r:  # the kernel times (older records kept them only where unattributed): attribute them
            r = res["a2a_per_rank"][rank] = {"names": r.get("names"), "ms": r["ms"]} | attribute_legs(
                r["ms"], moe_layers, kernel_legs)
        for leg, ms in r.get("legs_ms", {}).items():
            legs.setdefault(leg, []).extend(ms)
    res["a2a_ms"] = {leg: statistics.median(v) for leg, v in legs.items()} if legs else None


def summarize(args, variant: str, mode: str, dump: str, job) -> dict:
    steps_timed = range(args.warmup + 1, args.steps - (1 if args.profile else -1))
    m = runs.metrics(dump)
    tps, step_s, peak, active, device = [], [], {}, {}, {}
    for r, rows in m.items():
        for row in rows:
            if row["step"] in steps_timed:
                tps.append(row["throughput(tps)"])
                step_s.append(row["time_metrics/end_to_end(s)"])
        peak[r] = _known(max((row["memory/max_reserved(GiB)"] for row in rows), default=None))
        active[r] = _known(max((row["memory/max_active(GiB)"] for row in rows), default=None))
        device[r] = max((row["memory/max_reserved(GiB)"] + row[OUTSIDE] for row in rows
                         if OUTSIDE in row and row["memory/max_reserved(GiB)"] >= 0), default=None)
    losses = runs.losses(dump).get(0, {})
    curve = [losses[s] for s in sorted(losses)]
    final = final_loss(curve, args.tail)
    res = {
        "variant": variant, "mode": mode, "rc": job.rc, "wall_s": job.seconds, "steps_logged": len(curve),
        "tokens_per_s_per_gpu": _spread(tps), "step_s": _spread(step_s), "peak_reserved_gib": peak,
        "peak_active_gib": active, "peak_device_gib": device, "losses": curve, "final_loss": final,
        "fallbacks": max((rows[-1].get("moe_quant/fallbacks", 0) for rows in m.values() if rows), default=None),
        "dropped_rows": max((rows[-1].get("moe_quant/dropped_rows", 0) for rows in m.values() if rows), default=None),
        "alloc_retries": max((rows[-1].get(RETRIES, -1) for rows in m.values() if rows), default=None),
        "setup": runs.setup(dump).get(0), "log": job.log,
    }
    if job.rc != 0:
        res["log_tail"] = runs.log_tail(job.log)
    traces = sorted(Path(dump).glob("profiling/traces/iteration_*/rank*_trace.json*"))
    if traces:
        res["a2a_per_rank"] = {t.name.split("_")[0]: a2a_kernels(str(t)) for t in traces}
        res["syncs_per_rank"] = {t.name.split("_")[0]: step_syncs(str(t)) for t in traces}
        _a2a_summary(res, args.layers - 1)
    return res


def time_ratio(result: dict, reference: dict | None) -> float | None:
    """``result``'s time per step against ``reference``'s (a job of the same run), as every ratio of the docs: the
    reference's median tokens/s over the result's; None where either is missing or zero."""
    t = result["tokens_per_s_per_gpu"]["median"]
    b = reference["tokens_per_s_per_gpu"]["median"] if reference else None
    return b / t if b and t else None


def peak_allocated_gib(result: dict) -> float | None:
    """The most peak allocated (torchtitan's ``max_active``) GiB over a job's ranks; None where the device has none."""
    active = [v for v in (result.get("peak_active_gib") or {}).values() if _known(v) is not None]
    return max(active) if active else None


def _fmt(x, spec=".0f"):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(record: dict) -> str:
    rows = record["results"]
    base = {r["mode"]: r for r in rows if r["variant"] == "bf16"}
    lines = [f"torchtitan trainer, DeepSeek-V3 {record['flavor']} x {record['layers']} layers, {record['nproc']} x "
             f"{record['device']}, torch {record['torch']}, {record['steps']} steps; tokens/s per GPU: median over "
             f"steps {record['warmup'] + 1}.. and ranks (min-max); final loss: mean of the last {record['tail']} steps",
             "", "| variant | mode | tokens/s/GPU (min-max) | time vs bf16 | peak allocated GiB (max) | peak reserved "
             "GiB/GPU | peak device GiB (max) | allocator retries | final loss | vs bf16 | a2a ms: dispatch / combine / "
             "combine bwd / dispatch bwd (counts) | D2H copies / host syncs, profiled step (max of ranks) | job s |",
             "|" + "---|" * 13]
    for r in rows:
        t, b = r["tokens_per_s_per_gpu"], base.get(r["mode"])
        time = time_ratio(r, b)
        dloss = (r["final_loss"] / b["final_loss"] - 1 if b and r["final_loss"] and b["final_loss"] else None)
        a2a = r.get("a2a_ms")
        legs = ("n/a" if not a2a else " / ".join(_fmt(a2a.get(k), ".2f") for k in
                                                 ("dispatch", "combine", "combine backward", "dispatch backward"))
                + f" ({_fmt(a2a.get('counts'), '.2f')})")
        peak = ", ".join(_fmt(v, ".1f") for _, v in sorted(r["peak_reserved_gib"].items()))
        device = [v for v in (r.get("peak_device_gib") or {}).values() if v is not None]
        lines.append(f"| {r['variant']} | {r['mode']} | {_fmt(t['median'])} ({_fmt(t['min'])}-{_fmt(t['max'])}) | "
                     f"{_fmt(time, '.3f')} | {_fmt(peak_allocated_gib(r), '.2f')} | {peak} | "
                     f"{_fmt(max(device) if device else None, '.1f')} | "
                     f"{_fmt(_known(r.get('alloc_retries')), 'd')} | "
                     f"{_fmt(r['final_loss'], '.4f')} | "
                     f"{'n/a' if dloss is None else f'{100 * dloss:+.2f}%'} | {legs} | {_syncs(r)} | "
                     f"{_fmt(r['wall_s'])} |"
                     + ("" if r["rc"] == 0 else f" failed (rc {r['rc']})"))
    plain = {r["mode"]: r for r in rows if r["variant"] == PLAIN}
    for mode, p in plain.items():  # the trainer's bf16 against the plain bf16 loop of the same model and batch
        ratio = time_ratio(base[mode], p) if mode in base else None
        if ratio is not None:
            lines.append(f"\nbf16 {mode}: {ratio:.3f}x the time per step of the plain "
                         f"bf16 loop ({PLAIN}, examples.titan.plain_loop; its tokens/s over bf16's)")
    return "\n".join(lines) + "\n"


def _syncs(r: dict) -> str:
    per_rank = list((r.get("syncs_per_rank") or {}).values())
    if not per_rank:
        return "n/a"
    return f"{max(x['d2h_copies'] for x in per_rank)} / {max(x['host_syncs'] for x in per_rank)}"


def plot(record: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in record["results"]:
        if r["losses"]:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['variant']} {r['mode']}",
                    linestyle="-" if r["mode"] == "eager" else "--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global average)")
    ax.set_title(f"DeepSeek-V3 {record['flavor']} x {record['layers']} layers, {record['nproc']} x {record['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def loss_check(record: dict, rtol: float) -> list[dict]:
    out = []
    base = {r["mode"]: r for r in record["results"] if r["variant"] == "bf16" and r["final_loss"] is not None}
    for r in record["results"]:
        if r["variant"] in ("bf16", PLAIN) or r["mode"] not in base:  # the plain loop: a speed reference
            continue
        b = base[r["mode"]]["final_loss"]
        rel = None if r["final_loss"] is None else abs(r["final_loss"] - b) / abs(b)
        out.append({"variant": r["variant"], "mode": r["mode"], "final_loss": r["final_loss"], "bf16": b,
                    "relative": rel, "passed": rel is not None and rel <= rtol})
    return out


def write(args, record: dict, out: Path) -> None:
    record["loss_check"] = loss_check(record, args.loss_rtol)
    (out / "bench.json").write_text(json.dumps(record, indent=1))
    (out / "bench.md").write_text(table(record))
    plot(record, out / "losses.png")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    record = json.loads(path.read_text()) if path.exists() else {"results": []}
    if args.report_only:  # the record's own settings and device stay; the kernel times are attributed again
        if not record["results"]:
            print(f"--report-only: no results in {path}", file=sys.stderr)
            return 2
        for r in record["results"]:
            if r.get("a2a_per_rank"):
                _a2a_summary(r, record["layers"] - 1)
            if args.tail_given:
                r["final_loss"] = final_loss(r["losses"], args.tail)
        if args.tail_given:
            record["tail"] = args.tail
        return report(args, record, out)
    runs.exit_on_sigterm()  # jobs run from here: a time limit's SIGTERM kills their process groups on the way out
    record.update({"torch": torch.__version__, "nproc": args.nproc, "flavor": args.flavor, "layers": args.layers,
                   "steps": args.steps, "warmup": args.warmup, "tail": args.tail, "extra": args.extra,
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "command": " ".join([sys.executable, "-m", "examples.titan.bench", *sys.argv[1:]]),
                   "alloc_conf": runs.alloc_conf(runs._env(None))})
    todo = [(m, v) for m in args.modes for v in args.variants]
    config = {k: record[k] for k in ("torch", "nproc", "flavor", "layers", "steps", "extra", "device", "alloc_conf")}
    done = {(r["mode"], r["variant"]) for r in record["results"] if r["rc"] == 0 and r.get("config") == config}
    if not args.redo:
        skipped = [t for t in todo if t in done]
        todo = [t for t in todo if t not in done]
        if skipped:
            print(f"already in {path} (--redo runs them again): {skipped}", flush=True)
    started, times = time.monotonic(), {}
    for i, (mode, variant) in enumerate(todo):
        estimate = statistics.fmean(times[mode]) if times.get(mode) else None
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        if estimate is not None and left is not None and estimate > left:
            print(f"stopping: {variant} {mode} needs about {estimate:.0f} s, {left:.0f} s of --budget left", flush=True)
            break
        dump = out / f"{variant}_{mode}"
        cmd = (plain_command(args, mode, str(dump)) if variant == PLAIN else
               runs.torchrun(args.nproc, runs.trainer_args(args.flavor, variant, str(dump), job_args(args, mode))))
        about = f" (about {estimate:.0f} s)" if estimate else ""
        print(f"[{i + 1}/{len(todo)}] {variant} {mode}{about}", flush=True)
        job = runs.run(cmd, str(out / f"{variant}_{mode}.log"), timeout=args.timeout)
        times.setdefault(mode, []).append(job.seconds)
        res = summarize(args, variant, mode, str(dump), job)
        res["config"] = config
        record["results"] = [r for r in record["results"] if (r["mode"], r["variant"]) != (mode, variant)] + [res]
        write(args, record, out)
        rest = [m for m, _ in todo[i + 1:]]
        eta = sum(statistics.fmean(times.get(m) or times[mode]) for m in rest)
        print(f"    rc {job.rc}, {job.seconds:.0f} s, tokens/s/GPU {_fmt(res['tokens_per_s_per_gpu']['median'])}, "
              f"final loss {_fmt(res['final_loss'], '.4f')}; {len(rest)} job(s) left, about {eta:.0f} s", flush=True)
    return report(args, record, out)


def report(args, record: dict, out: Path) -> int:
    """Write and print the table and the loss check; the exit status (1: a job failed or a loss is off)."""
    write(args, record, out)
    print(table(record))
    checks = record["loss_check"]
    for c in checks:
        rel = "n/a" if c["relative"] is None else f"{100 * c['relative']:.2f}%"
        print(f"{'PASS' if c['passed'] else 'FAIL'} final loss {c['variant']} {c['mode']}: "
              f"{_fmt(c['final_loss'], '.4f')} vs bf16 {_fmt(c['bf16'], '.4f')} ({rel}, "
              f"limit {100 * args.loss_rtol:.1f}%)")
    failed = [r for r in record["results"] if r["rc"] != 0]
    return 1 if failed or any(not c["passed"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
