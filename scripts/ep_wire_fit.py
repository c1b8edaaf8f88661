"""A slow-wire model of the EP block: ``step = compute + legs x fixed + bytes / bandwidth``, fitted to bench_ep.

    torchrun --nproc_per_node 2 -m benchmarks.bench_ep --json nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 2 -m benchmarks.bench_ep --json shm.json
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc_per_node 2 -m benchmarks.bench_ep --json socket.json
    python scripts/ep_wire_fit.py nvlink=nvlink.json shm=shm.json socket=socket.json --md fit.md --png fit.png

Each ``bench_ep --json`` file is one transport (NVLink; ``NCCL_P2P_DISABLE=1`` alone: shared memory; with
``NCCL_SHM_DISABLE=1`` too: sockets), the same sizes and world size. The model, per row r and transport t:

* one leg alone, ``ms = F_t + bytes_to_others / BW_t``: the fixed cost ``F_t`` and bus bandwidth ``BW_t`` per
  GPU of the transport, least squares over the file's ``legs_alone`` points (bf16 and MXFP8 rows, three
  sizes: ``scripts/fixed_cost_fit.fit``);
* the block, ``step(r, t) = C_r + L_r * F_t + W_r / BW_t``: ``W_r`` the bytes a GPU sends to the others per
  step (every leg's bytes from the file's wire record times ``(N - 1) / N``: balanced routing), ``L_r`` the
  exchanges per step (the counts and four legs), ``C_r`` the row's compute (what does not depend on the
  wire): ``step - L_r F_t - W_r / BW_t`` on the fastest transport (``--compute-from``; the one where the
  wire weighs least), so that the other transports' steps are predicted out of sample.

Every measured step on the other transports is then predicted from the fit; the check passes when each is
within ``--tolerance`` (10%) of the measurement. The rows whose legs overlap the experts (``chunks`` > 1) do not follow a sum
model: they are listed as measured. With the fit, at a per-GPU bandwidth B (25, 50, 100 GB/s: a
200-800 Gb/s inter-node link) and the fixed cost of ``--fixed-from`` (the NVLink fit by default), the step
of each row, the gain of MXFP8 comms over bf16 comms (row iv against iii, and against row i, bf16 EP; and
the p2p row against both) and the crossover bandwidth below which the MXFP8 wire is faster
(``(W_ref - W_mx) / (C_mx - C_ref)`` for the same exchanges; none where its compute is no larger: faster at
every bandwidth).
Writes a markdown table (``--md``) and a plot of step time against bandwidth (``--png``, matplotlib).
Exit status 1 when a point is predicted worse than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fixed_cost_fit
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixed_cost_fit import fit as fit_line  # noqa: E402

from moe_quant import cli  # noqa: E402

BANDWIDTHS = (25.0, 50.0, 100.0)  # GB/s per GPU
WIRE_LEGS = ("dispatch", "combine", "combine backward", "dispatch backward")
FIT_ROWS = ("bf16", "titan", "conv_bf16", "conv_mxfp8", "p2p", "sync_free")  # no overlap: the sum model applies
GAINS = (("conv_mxfp8", "conv_bf16"), ("conv_mxfp8", "bf16"), ("p2p", "conv_bf16"), ("p2p", "bf16"),
         ("conv_mxfp8", "titan"), ("p2p", "titan"))


def transport_fit(record: dict) -> dict:
    """``{"fixed_ms", "gbps", "points"}`` of one transport from its ``legs_alone`` points."""
    points = [(p["bytes_to_others"], p["ms"] * 1e3) for p in record["legs_alone"]]
    t0_us, tbps = fit_line(points)
    return {"fixed_ms": t0_us / 1e3, "gbps": tbps * 1e3, "points": points}


def row_bytes(row: dict, world: int) -> float:
    """Bytes one GPU sends to the others per step: every leg's bytes times ``(N - 1) / N``."""
    return sum(row["wire"][leg]["bytes"] for leg in WIRE_LEGS) * (world - 1) / world


def row_exchanges(row: dict) -> int:
    """Collective launches per step: the counts exchange and the four legs (each range of chunks apart)."""
    return 1 + 4 * int(row["settings"].get("chunks", 1))


def step_ms(compute_ms: float, exchanges: int, nbytes: float, fixed_ms: float, gbps: float) -> float:
    return compute_ms + exchanges * fixed_ms + nbytes / (gbps * 1e6)


def crossover_gbps(mx: dict, ref: dict, fixed_ms: float) -> float | None:
    """Bandwidth (GB/s) below which row ``mx`` is faster than row ``ref`` (each ``{"compute_ms", "bytes",
    "exchanges"}``): ``(W_ref - W_mx) / (T_mx - T_ref)`` with ``T = C + L * fixed``; None where ``mx`` is
    faster at every bandwidth, 0 where it never is."""
    d_bytes = ref["bytes"] - mx["bytes"]
    d_time = (mx["compute_ms"] + mx["exchanges"] * fixed_ms) - (ref["compute_ms"] + ref["exchanges"] * fixed_ms)
    if d_time <= 0:
        return None if d_bytes >= 0 else 0.0
    return d_bytes / d_time / 1e6 if d_bytes > 0 else 0.0


def fit(records: dict, tolerance: float = 0.10, compute_from: str | None = None) -> dict:
    """The model over ``records`` (transport name -> bench_ep record); see the module doc. ``compute_from``:
    the transport whose steps give each row's compute (default: the one of the highest fitted bandwidth)."""
    worlds = {r["world"] for r in records.values()}
    sizes = {json.dumps(r["sizes"], sort_keys=True) for r in records.values()}
    if len(worlds) != 1 or len(sizes) != 1:
        raise ValueError(f"the files must share the world size and sizes, got worlds {sorted(worlds)}, "
                         f"sizes {sorted(sizes)}")
    world = worlds.pop()
    if world < 2:
        raise ValueError("world size 1 sends nothing to other GPUs: run bench_ep on 2 or more GPUs")
    wires = {t: transport_fit(r) for t, r in records.items()}
    if compute_from is None:
        compute_from = max(wires, key=lambda t: wires[t]["gbps"])
    elif compute_from not in wires:
        raise ValueError(f"compute_from must be one of {sorted(wires)}, got {compute_from!r}")
    rows: dict = {}
    for t, rec in records.items():
        for row in rec["rows"]:
            info = rows.setdefault(row["row"], {"label": row["label"], "bytes": row_bytes(row, world),
                                                "exchanges": row_exchanges(row), "measured": {}})
            info["measured"][t] = row["ms"]
    for name, info in rows.items():
        info["fitted"] = name in FIT_ROWS
        if not info["fitted"]:
            continue
        if compute_from not in info["measured"]:
            raise ValueError(f"row {name!r} has no step measured on {compute_from!r}, the transport that gives "
                             "its compute")
        w = wires[compute_from]
        info["compute_ms"] = (info["measured"][compute_from] - info["exchanges"] * w["fixed_ms"]
                              - info["bytes"] / (w["gbps"] * 1e6))
        info["predicted"] = {t: step_ms(info["compute_ms"], info["exchanges"], info["bytes"], wires[t]["fixed_ms"],
                                        wires[t]["gbps"]) for t in info["measured"]}
        info["error"] = {t: info["predicted"][t] / ms - 1 for t, ms in info["measured"].items()}
    checked = [abs(e) for info in rows.values() if info["fitted"]
               for t, e in info["error"].items() if t != compute_from]
    return {"world": world, "sizes": json.loads(sizes.pop()), "wires": wires, "rows": rows,
            "compute_from": compute_from, "tolerance": tolerance, "ok": bool(checked) and max(checked) <= tolerance}


def at_bandwidths(model: dict, fixed_from: str, bandwidths=BANDWIDTHS) -> dict:
    """``{"steps": {row: {B: ms}}, "gains": [(mx, ref, {B: ref / mx}, crossover)]}`` at per-GPU bandwidths."""
    fixed = model["wires"][fixed_from]["fixed_ms"]
    rows = {n: i for n, i in model["rows"].items() if i["fitted"]}
    steps = {n: {b: step_ms(i["compute_ms"], i["exchanges"], i["bytes"], fixed, b) for b in bandwidths}
             for n, i in rows.items()}
    gains = [(mx, ref, {b: steps[ref][b] / steps[mx][b] for b in bandwidths},
              crossover_gbps(rows[mx], rows[ref], fixed)) for mx, ref in GAINS if mx in rows and ref in rows]
    return {"fixed_ms": fixed, "steps": steps, "gains": gains}


def markdown(model: dict, projected: dict, fixed_from: str) -> str:
    s = model["sizes"]
    lines = [f"EP={model['world']}, D {s['dim']}, expert hidden {s['hidden']}, {s['experts_per_rank']} experts "
             f"per rank, top-{s['top_k']}, {s['tokens']} tokens per rank.", "",
             "| transport | fixed ms per exchange | bus GB/s per GPU |", "|---|---|---|"]
    lines += [f"| {t} | {w['fixed_ms']:.3f} | {w['gbps']:.1f} |" for t, w in model["wires"].items()]
    transports = list(model["wires"])
    lines += ["", "| row | MB to others per step | compute ms | " + " | ".join(
        f"{t} measured / predicted ms" for t in transports) + " |", "|---" * (3 + len(transports)) + "|"]
    for name, i in model["rows"].items():
        cells = []
        for t in transports:
            ms = i["measured"].get(t)
            if ms is None:
                cells.append("")
            elif i["fitted"]:
                cells.append(f"{ms:.2f} / {i['predicted'][t]:.2f} ({100 * i['error'][t]:+.1f}%)")
            else:
                cells.append(f"{ms:.2f} / (overlapped: not modelled)")
        compute = f"{i['compute_ms']:.2f}" if i["fitted"] else ""
        lines.append(f"| {i['label']} | {i['bytes'] / 1e6:.1f} | {compute} | " + " | ".join(cells) + " |")
    verdict = "every point" if model["ok"] else "NOT every point"
    others = ", ".join(t for t in transports if t != model["compute_from"])
    lines += ["", f"Compute from {model['compute_from']}; the fit predicts {verdict} on {others} within "
              f"{100 * model['tolerance']:.0f}%.", "",
              f"Projected (fixed cost per exchange {projected['fixed_ms']:.3f} ms, from {fixed_from}):", "",
              "| MXFP8 row | against | " + " | ".join(f"gain at {b:g} GB/s" for b in BANDWIDTHS)
              + " | crossover |", "|---" * (3 + len(BANDWIDTHS)) + "|"]
    labels = {n: i["label"] for n, i in model["rows"].items()}
    for mx, ref, gains, cross in projected["gains"]:
        c = "faster at every bandwidth" if cross is None else ("never faster" if cross == 0 else
                                                              f"faster below {cross:.0f} GB/s")
        lines.append(f"| {labels[mx]} | {labels[ref]} | " + " | ".join(f"{gains[b]:.2f}x" for b in BANDWIDTHS)
                     + f" | {c} |")
    return "\n".join(lines) + "\n"


def plot(model: dict, projected: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    fixed = projected["fixed_ms"]
    lo = min([w["gbps"] for w in model["wires"].values()] + [10.0]) / 2
    hi = max([w["gbps"] for w in model["wires"].values()] + [400.0]) * 2
    grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    for name, i in model["rows"].items():
        if not i["fitted"]:
            continue
        line, = ax.plot(grid, [step_ms(i["compute_ms"], i["exchanges"], i["bytes"], fixed, b) for b in grid],
                        label=i["label"])
        for t, ms in i["measured"].items():
            ax.plot(model["wires"][t]["gbps"], ms, "o", color=line.get_color())
    for t, w in model["wires"].items():
        ax.axvline(w["gbps"], color="grey", lw=0.5, ls=":")
        ax.text(w["gbps"], ax.get_ylim()[1], t, rotation=90, va="top", ha="right", fontsize=7, color="grey")
    for b in BANDWIDTHS:
        ax.axvline(b, color="black", lw=0.5, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bus bandwidth per GPU (GB/s)")
    ax.set_ylabel("EP block fwd+bwd per step (ms)")
    ax.set_title(f"EP={model['world']}: model (lines) and measured points (dots, at each transport's fitted "
                 f"bandwidth)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _transport_file(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE (e.g. nvlink=nvlink.json), got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a file")
    return name, path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ep_wire_fit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=_transport_file, help="NAME=bench_ep.json, one per transport")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--fixed-from", default=None, help="the transport whose fixed cost the projection uses "
                   "(default: the first file)")
    p.add_argument("--compute-from", default=None, help="the transport whose steps give each row's compute "
                   "(default: the one of the highest fitted bandwidth)")
    p.add_argument("--md", type=cli.writable_file, default=None)
    p.add_argument("--png", type=cli.writable_file, default=None)
    args = p.parse_args(argv)
    records = {}
    for name, path in args.files:
        with open(path) as fh:
            records[name] = json.load(fh)
    fixed_from = args.fixed_from or args.files[0][0]
    if fixed_from not in records:
        p.error(f"argument --fixed-from: {fixed_from!r} is none of {', '.join(records)}")
    try:
        model = fit(records, args.tolerance, args.compute_from)
    except ValueError as e:
        p.error(str(e))
    projected = at_bandwidths(model, fixed_from)
    text = markdown(model, projected, fixed_from)
    print(text, end="")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(text)
    if args.png:
        plot(model, projected, args.png)
    return 0 if model["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
