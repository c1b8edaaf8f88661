"""The trainer's speed against bf16 as the median of interleaved rounds, with its spread::

    python -m examples.titan.rounds --out out/rounds --rounds 3 --nproc 1 --layers 4 --modes compiled \\
        --variants bf16,converted --steps 24 --warmup 8 --tail 4 --no-profile
    python -m examples.titan.rounds --summarize out/a/bench.json out/b   # rounds run before, as one table

One job's time against bf16 moves by several % between runs on the same GPU (clocks, the allocator; on one
H200 bf16 itself moved 11% between two runs of one evening), as much as the differences to measure. So each round
is one :mod:`examples.titan.bench` run of every variant (``<out>/round<i>``), the variants in the order given in
even rounds and reversed in odd ones, and a variant's time against bf16 is taken within each round (bf16's
tokens/s over the variant's, both the median over their steps) and summarized over the rounds: the median and
the lowest and highest round. The peak allocated memory is the most over the rounds (it repeats to 0.01 GiB
between runs; the reserved peak does not). ``<out>/rounds.md`` and ``rounds.json`` hold the summary.

Every option but ``--out``, ``--rounds`` and ``--summarize`` goes to each round's bench run (``--budget``: the
seconds left are passed on; a round that would not finish in time leaves its jobs out). A round already in ``<out>``
is kept: the bench skips the jobs it finished (``--redo`` runs them again). ``--summarize`` reads stored records
(a ``bench.json`` or a folder holding one) of any rounds, of the same or of different layer counts, and runs
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from examples.titan import bench


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Every other option goes to each round's python -m examples.titan.bench (its --help "
                                       "lists them), and what follows -- to the trainer.")
    p.add_argument("--out", help="the rounds' folders (round0, round1, ...) and the summary")
    p.add_argument("--rounds", type=int, default=3, help="bench runs, the variants' order reversed every other one")
    p.add_argument("--summarize", nargs="+", metavar="RECORD", help="bench.json files or folders: summarize, run nothing")
    p.add_argument("--variants", default="bf16,converted", help="as the bench's; bf16 must be among them")
    p.add_argument("--budget", type=float, default=None, help="seconds for every round together")
    args, rest = p.parse_known_args(argv)
    args.bench_argv = rest
    if args.summarize is None:
        if not args.out:
            p.error("--out is required (or --summarize RECORD ...)")
        if args.rounds < 1:
            p.error(f"--rounds must be at least 1, got {args.rounds}")
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        if "bf16" not in variants:
            p.error(f"--variants must include bf16 (every ratio is to bf16 in the same round), got {args.variants!r}")
        args.variants = variants
    return args


def round_orders(variants: list[str], rounds: int) -> list[list[str]]:
    """The variants' order in each round: as given in even rounds, reversed in odd ones, so that no variant always
    runs first (the GPU cold) or last."""
    return [list(variants) if i % 2 == 0 else list(reversed(variants)) for i in range(rounds)]


def load(paths) -> list[dict]:
    """The bench records at ``paths`` (a ``bench.json`` or a folder holding one)."""
    records = []
    for p in map(Path, paths):
        f = p / "bench.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"no bench record at {p} (expected a bench.json or a folder holding one)")
        records.append(json.loads(f.read_text()))
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per (layers, mode, variant) over the records (rounds): each round's time against bf16 of the same
    record and mode, their median, lowest and highest, the most peak allocated GiB, bf16's median tokens/s per round.
    A record's job that failed, or a mode without a bf16 job, gives no ratio."""
    groups: dict = {}
    for rec in records:
        ok = [r for r in rec["results"] if r["rc"] == 0]
        base = {r["mode"]: r for r in ok if r["variant"] == "bf16"}
        for r in ok:
            ratio = bench.time_ratio(r, base.get(r["mode"]))
            if ratio is None:
                continue
            g = groups.setdefault((rec["layers"], r["mode"], r["variant"]), {"ratios": [], "allocated": [], "bf16": []})
            g["ratios"].append(ratio)
            g["bf16"].append(base[r["mode"]]["tokens_per_s_per_gpu"]["median"])
            allocated = bench.peak_allocated_gib(r)
            if allocated is not None:
                g["allocated"].append(allocated)
    rows = []
    for (layers, mode, variant), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "bf16",
                                                                            kv[0][2])):
        rows.append({"layers": layers, "mode": mode, "variant": variant, "rounds": len(g["ratios"]),
                     "ratio_median": statistics.median(g["ratios"]), "ratio_min": min(g["ratios"]),
                     "ratio_max": max(g["ratios"]), "ratios": g["ratios"],
                     "peak_allocated_gib": max(g["allocated"]) if g["allocated"] else None,
                     "bf16_tokens_per_s": g["bf16"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["time per step against bf16 in the same round (bf16's tokens/s over the variant's): median (lowest-highest "
             "round); plain_bf16 is the plain loop (examples.titan.plain_loop), below 1 where faster than the trainer's "
             "bf16", "",
             "| layers | mode | variant | rounds | time vs bf16, median (min-max) | each round | peak allocated GiB (max) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        alloc = "n/a" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.2f}"
        lines.append(f"| {r['layers']} | {r['mode']} | {r['variant']} | {r['rounds']} | {r['ratio_median']:.3f} "
                     f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {' '.join(f'{x:.3f}' for x in r['ratios'])} | "
                     f"{alloc} |")
    return "\n".join(lines) + "\n"


def report(records: list[dict], out: Path | None) -> int:
    rows = summarize(records)
    text = table(rows)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rounds.md").write_text(text)
        (out / "rounds.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        return report(load(args.summarize), Path(args.out) if args.out else None)
    out = Path(args.out)
    started, status = time.monotonic(), 0
    for i, order in enumerate(round_orders(args.variants, args.rounds)):
        argv = [*_before_dashes(args.bench_argv), "--out", str(out / f"round{i}"), "--variants", ",".join(order)]
        if args.budget is not None:
            left = args.budget - (time.monotonic() - started)
            if left <= 0:
                print(f"stopping before round {i}: --budget spent", flush=True)
                break
            argv += ["--budget", f"{left:.0f}"]
        print(f"round {i}: {', '.join(order)}", flush=True)
        status |= bench.main(argv + _after_dashes(args.bench_argv))
    done = [out / f"round{i}" for i in range(args.rounds) if (out / f"round{i}" / "bench.json").is_file()]
    return report(load(done), out) | status if done else 1


def _before_dashes(argv: list[str]) -> list[str]:
    return argv[:argv.index("--")] if "--" in argv else list(argv)


def _after_dashes(argv: list[str]) -> list[str]:
    return argv[argv.index("--"):] if "--" in argv else []


if __name__ == "__main__":
    sys.exit(main())
