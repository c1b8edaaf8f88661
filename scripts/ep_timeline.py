"""Where the device waited, row by row, from the kernel timelines of ``benchmarks.bench_ep --timeline``:

    python scripts/ep_timeline.py ep.json                      # one line per row
    python scripts/ep_timeline.py ep.json --rows bf16,titan --list conv_mxfp8   # and every kernel of one row

Per row (rank 0's profiled step): the kernels; the device's idle time inside the step split into short gaps
(at most ``--short`` us: the host launching the next kernel) and long ones (host syncs, waits); the start of
the first GEMM after the first communication kernel (the experts' first GEMM: the router's comes before the
counts exchange); and each communication kernel's start and time (a collective's time includes waiting for
its peers). ``--list ROW`` prints that row's kernels in order, each with the gap before it. This is how the host
ops before the dispatch exchange were found (docs/ep_performance.md, 2026-11-29).
"""

from __future__ import annotations

import argparse
import json
import sys


def summary(timeline: list[dict], short_us: float = 100.0) -> dict:
    """Kernels, short and long gaps (ms), the experts' first GEMM start (ms) and the communication kernels
    ``[(start ms, ms)]`` of one row's timeline (start order)."""
    end, short, long_, n_short = 0.0, 0.0, 0.0, 0
    for i, k in enumerate(timeline):
        gap = k["start_us"] - end
        if i and gap > 0:
            if gap <= short_us:
                short, n_short = short + gap, n_short + 1
            else:
                long_ += gap
        end = max(end, k["start_us"] + k["us"])
    comm = [k for k in timeline if k["kind"] == "nccl"]
    first_comm = comm[0]["start_us"] if comm else None
    gemm = next((k["start_us"] for k in timeline if k["kind"] == "gemm" and first_comm is not None
                 and k["start_us"] > first_comm), None)
    return {"kernels": len(timeline), "span_ms": end / 1e3, "short_gaps_ms": short / 1e3, "short_gaps": n_short,
            "long_gaps_ms": long_ / 1e3, "first_expert_gemm_ms": None if gemm is None else gemm / 1e3,
            "comm": [(k["start_us"] / 1e3, k["us"] / 1e3) for k in comm]}


def listing(timeline: list[dict]) -> list[str]:
    """One line per kernel: index, start and gap before it (us), time (us), kind, name."""
    out, end = [], 0.0
    for i, k in enumerate(timeline):
        out.append(f"{i:4d} t={k['start_us']:9.1f} gap {k['start_us'] - end:8.1f} dur {k['us']:8.1f} "
                   f"{k['kind']:9s} {k['name']}")
        end = max(end, k["start_us"] + k["us"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="bench_ep --json output of a run with --timeline")
    p.add_argument("--rows", default=None, help="comma list of rows (default: every row with a timeline)")
    p.add_argument("--list", default=None, metavar="ROW", help="also print every kernel of this row")
    p.add_argument("--short", type=float, default=100.0, help="the longest gap (us) counted as a short one")
    a = p.parse_args(argv)
    try:
        record = json.loads(open(a.json).read())
    except (OSError, ValueError) as e:
        p.error(f"cannot read {a.json}: {e}")
    rows = {r["row"]: r for r in record.get("rows", []) if r.get("timeline")}
    if not rows:
        p.error(f"{a.json} has no kernel timelines: run benchmarks.bench_ep with --timeline")
    names = a.rows.split(",") if a.rows else list(rows)
    missing = [n for n in names + ([a.list] if a.list else []) if n not in rows]
    if missing:
        p.error(f"no timeline for row(s) {missing}; rows with one: {list(rows)}")
    print(f"{record.get('device')}, world {record.get('world')}, torch {record.get('torch')}: rank 0's profiled step")
    print(f"{'row':14s} {'kernels':>7s} {'span ms':>8s} {'short gaps ms (n)':>18s} {'long gaps ms':>12s} "
          f"{'experts start ms':>16s}  communication kernels: start ms (ms)")
    for n in names:
        s = summary(rows[n]["timeline"], a.short)
        start = "" if s["first_expert_gemm_ms"] is None else f"{s['first_expert_gemm_ms']:.2f}"
        comm = ", ".join(f"{t:.2f} ({d:.2f})" for t, d in s["comm"])
        print(f"{n:14s} {s['kernels']:7d} {s['span_ms']:8.2f} {s['short_gaps_ms']:12.2f} ({s['short_gaps']:3d}) "
              f"{s['long_gaps_ms']:12.2f} {start:>16s}  {comm}")
    if a.list:
        print(f"\nevery kernel of {a.list} (start and gap in us from its first kernel):")
        print("\n".join(listing(rows[a.list]["timeline"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
