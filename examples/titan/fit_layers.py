"""The most layers of DeepSeek-V3 that fit a GPU of ``--memory-gib`` for every variant, found by running them::

    python -m examples.titan.fit_layers --out out/fit --memory-gib 76 --start 10 \\
        --variants mxfp8_sync_free,bf16 -- --moe_quant.capacity_factor 2

Each probe is a short job of torchtitan's trainer (``--steps``, default 6; the optimizer's state exists from step
1, so a step's peak is reached by then) with the caching allocator capped at ``--memory-gib`` per rank
(``--moe_quant.memory_gib``): a job that needs more than that fails with CUDA's out-of-memory error, as it would on
the smaller GPU. The search, for layer counts ``L`` (block 0 dense, the others MoE):

* the first of ``--variants`` (list the variant that needs the most memory first) from ``--start`` upwards while
  it fits, or downwards until it fits;
* every other variant at that ``L``, one layer less wherever one does not fit (the other variants again at the
  lower count; the first fits there, as fewer layers need less memory).

A job that fails without an out-of-memory error stops the search (exit status 2): only memory decides. The result,
``<out>/fit.json``: the layer count (``layers``; None where not even ``--min`` fits) and every probe (variant,
mode, layers, fits, peak reserved and peak device GiB per rank, the log). What does not fit at the chosen count is
not run there; the benchmark (:mod:`examples.titan.bench`) with the same cap confirms it over the full run.
Arguments after ``--`` go to every job (e.g. ``--moe_quant.capacity_factor 2``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from examples.titan import bench, runs
from moe_quant import cli

OOM_WORDS = ("CUDA out of memory", "OutOfMemoryError")


def parse_args(argv=None):
    p, argv, extra = runs.parser(__doc__, argv, layers=None, steps=6, modes="eager", timeout=300.0)
    p.add_argument("--memory-gib", type=cli.positive_float, required=True, help="the allocator's cap per rank (GiB)")
    p.add_argument("--start", type=int, required=True, help="the first layer count probed")
    p.add_argument("--min", type=int, default=2, help="the fewest layers tried")
    p.add_argument("--max", type=int, default=27, help="the most layers tried (DeepSeek-V3 16B has 27)")
    args = p.parse_args(argv)
    args.extra = extra
    args.variants = runs.names(p, "--variants", args.variants, runs.VARIANTS)
    args.modes = runs.names(p, "--modes", args.modes, ("eager", "compiled"))
    if not 1 <= args.min <= args.start <= args.max:
        p.error("--min <= --start <= --max is needed, each at least 1")
    if args.steps < 2:
        p.error("--steps must be at least 2 (the optimizer's state exists from step 1)")
    return args


class JobFailed(RuntimeError):
    """A probe failed for another reason than memory."""


def probe(args, variant: str, mode: str, layers: int, out: Path) -> dict:
    """One short job at ``layers`` under the cap: ``fits`` (it finished), its peaks and log."""
    name = f"{variant}_{mode}_{layers}"
    dump = out / name
    targs = runs.trainer_args(args.flavor, variant, str(dump), [
        "--moe_quant.layers", str(layers), "--training.steps", str(args.steps), "--metrics.log_freq", "1",
        "--moe_quant.memory_gib", str(args.memory_gib), *(["--compile.enable"] if mode == "compiled" else []),
        *args.extra])
    print(f"probe {variant} {mode} x {layers} layers", flush=True)
    job = runs.run(runs.torchrun(args.nproc, targs), str(out / f"{name}.log"), timeout=args.timeout)
    log = Path(job.log).read_text(errors="replace")
    oom = any(w in log for w in OOM_WORDS)
    if job.rc != 0 and not oom:
        raise JobFailed(f"{name}: rc {job.rc} without an out-of-memory error, see {job.log}:\n"
                        f"{runs.log_tail(job.log)}")
    s = bench.summarize(SimpleNamespace(warmup=0, steps=args.steps, profile=False, tail=1, layers=layers),
                        variant, mode, str(dump), job)
    res = {"variant": variant, "mode": mode, "layers": layers, "fits": job.rc == 0, "seconds": job.seconds,
           "peak_reserved_gib": s["peak_reserved_gib"], "peak_device_gib": s["peak_device_gib"], "log": job.log}
    print(f"    {'fits' if res['fits'] else 'out of memory'} ({job.seconds:.0f} s); peak reserved "
          f"{_peak(res['peak_reserved_gib'])} GiB, device {_peak(res['peak_device_gib'])} GiB", flush=True)
    return res


def _peak(per_rank: dict) -> str:
    values = [v for v in per_rank.values() if v is not None]
    return f"{max(values):.1f}" if values else "n/a"


def search(args, fits) -> int | None:
    """The layer count (see the module doc); ``fits(variant, mode, layers) -> bool`` runs (or looks up) a probe."""
    (first, *others), modes = args.variants, args.modes
    ok = lambda v, n: all(fits(v, m, n) for m in modes)  # noqa: E731
    n = args.start
    if ok(first, n):
        while n < args.max and ok(first, n + 1):
            n += 1
    else:
        n -= 1
        while n >= args.min and not ok(first, n):
            n -= 1
    while n >= args.min and not all(ok(v, n) for v in others):  # the first fits at n: fewer layers need less
        n -= 1
    return n if n >= args.min else None


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs.exit_on_sigterm()
    probes: dict[tuple, dict] = {}
    record = {"memory_gib": args.memory_gib, "nproc": args.nproc, "flavor": args.flavor, "steps": args.steps,
              "extra": args.extra, "variants": args.variants, "modes": args.modes, "layers": None, "probes": []}

    def fits(variant, mode, layers):
        key = (variant, mode, layers)
        if key not in probes:
            probes[key] = probe(args, variant, mode, layers, out)
            record["probes"] = list(probes.values())
            (out / "fit.json").write_text(json.dumps(record, indent=1))
        return probes[key]["fits"]

    try:
        record["layers"] = search(args, fits)
    except JobFailed as e:
        print(f"stopped: {e}", file=sys.stderr)
        (out / "fit.json").write_text(json.dumps(record | {"error": str(e)}, indent=1))
        return 2
    (out / "fit.json").write_text(json.dumps(record, indent=1))
    print(f"layers: {record['layers']} (every variant of {args.variants}, {args.modes}, under {args.memory_gib} GiB "
          f"per rank)")
    return 0 if record["layers"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
