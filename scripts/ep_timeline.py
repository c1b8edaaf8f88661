"""Where the device waited, row by row, from the kernel timelines of ``benchmarks.bench_ep --timeline``:

    python scripts/ep_timeline.py ep.json                      # one line per row
    python scripts/ep_timeline.py ep.json --rows bf16,titan --list conv_mxfp8   # and every kernel of one row
    python scripts/ep_timeline.py ep.json --peers p2p_c4_sm4    # every rank's communication kernels, waits

Per row (rank 0's profiled step): the kernels; the device's idle time inside the step split into short gaps
(at most ``--short`` us: the host launching the next kernel) and long ones (host syncs, waits); the start of
the first GEMM after the first communication kernel (the experts' first GEMM: the router's comes before the
counts exchange); and each communication kernel's start and time (a collective's time includes waiting for
its peers). ``--list ROW`` prints that row's kernels in order, each with the gap before it. This is how the host
ops before the dispatch exchange were found (docs/lab/ep_log.md, 2026-11-29). ``--peers ROW`` puts every
rank's communication kernels of that row side by side on the host's wall clock (:func:`peers`): how long each
rank's kernel waited for the last rank's, and how long the transfer had with every rank in it.
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


def peers(timelines: list[dict]) -> dict:
    """Every rank's communication kernels of one row side by side (``timelines``: ``bench_ep``'s per-rank
    ``{"start_us": wall-clock us of the rank's first kernel, "kernels": its timeline}``). A collective's kernel
    runs on every rank; until the last rank's starts, the others wait inside theirs. Per kernel i (the first
    ``n`` of each rank, ``n`` the fewest any rank has): each rank's start (ms from the earliest rank's first
    kernel) and time, its wait (the last rank's start minus its own), and ``after`` (the last end minus the
    last start: the time the transfer had with every rank in it). Totals per rank: kernel time and wait."""
    origin = min(t["start_us"] for t in timelines)
    comm = [[(t["start_us"] - origin + k["start_us"], k["us"]) for k in t["kernels"] if k["kind"] == "nccl"]
            for t in timelines]
    n = min(len(c) for c in comm)
    rows = []
    for i in range(n):
        starts = [c[i][0] for c in comm]
        last = max(starts)
        rows.append({"start_ms": [a / 1e3 for a in starts], "ms": [c[i][1] / 1e3 for c in comm],
                     "wait_ms": [(last - a) / 1e3 for a in starts],
                     "after_ms": (max(c[i][0] + c[i][1] for c in comm) - last) / 1e3})
    return {"kernels": n, "counts": [len(c) for c in comm], "rows": rows,
            "kernel_ms": [sum(r["ms"][k] for r in rows) for k in range(len(comm))],
            "wait_ms": [sum(r["wait_ms"][k] for r in rows) for k in range(len(comm))],
            "after_ms": sum(r["after_ms"] for r in rows)}


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
    p.add_argument("--peers", default=None, metavar="ROW",
                   help="every rank's communication kernels of this row side by side, with each rank's wait")
    a = p.parse_args(argv)
    try:
        record = json.loads(open(a.json).read())
    except (OSError, ValueError) as e:
        p.error(f"cannot read {a.json}: {e}")
    rows = {r["row"]: r for r in record.get("rows", []) if r.get("timeline")}
    if not rows:
        p.error(f"{a.json} has no kernel timelines: run benchmarks.bench_ep with --timeline")
    names = a.rows.split(",") if a.rows else list(rows)
    missing = [n for n in names + [r for r in (a.list, a.peers) if r] if n not in rows]
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
    if a.peers:
        timelines = rows[a.peers].get("timelines")
        if not timelines or any(t.get("start_us") is None or not t.get("kernels") for t in timelines):
            p.error(f"row {a.peers} has no per-rank timelines (bench_ep records them since 2026-11-29, with "
                    f"--timeline)")
        pr = peers(timelines)
        print(f"\n{a.peers}: communication kernels of every rank (ms from the earliest rank's first kernel; "
              f"wait: until the last rank's kernel started; after: with every rank in it)")
        print("   i  " + "  ".join(f"rank {r}: start (ms) wait" for r in range(len(timelines))) + "   after")
        for i, r in enumerate(pr["rows"]):
            cells = "  ".join(f"{r['start_ms'][k]:9.2f} ({r['ms'][k]:5.2f}) {r['wait_ms'][k]:5.2f}"
                              for k in range(len(timelines)))
            print(f"{i:4d}  {cells}   {r['after_ms']:5.2f}")
        print("total kernel ms per rank " + ", ".join(f"{v:.2f}" for v in pr["kernel_ms"]) + "; waiting "
              + ", ".join(f"{v:.2f}" for v in pr["wait_ms"]) + f"; with every rank in it {pr['after_ms']:.2f}"
              + ("" if len(set(pr["counts"])) == 1 else f"; kernel counts differ {pr['counts']}: the first "
                 f"{pr['kernels']} compared"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
