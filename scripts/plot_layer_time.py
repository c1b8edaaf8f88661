"""Plot one expert layer's fwd+bwd time vs M from ``bench_grouped_mm --json``.

    python -m benchmarks.bench_grouped_mm --shapes dsv3,llama4 --m 16384,32768,65536,131072 --json layer.json
    python scripts/plot_layer_time.py layer.json            # writes docs/layer_time.png

One panel per shape family in the file (dsv3: K=7168 -> N=2048, llama4: 5120 -> 8192), lines for
bf16 ``torch._grouped_mm``, moe_quant emulated and torchao emulated, each point of moe_quant
labelled with its ratio to bf16. Numbers from a CPU or ``--tiny`` run are refused for the default
output path (docs/ holds GPU measurements only); pass ``--out`` to plot them elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Runnable as `python scripts/plot_layer_time.py` from the repository root without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_quant import cli  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "layer_time.png")
LINES = (  # impl key in the JSON, legend label, style
    ("bf16", "bf16 torch._grouped_mm", dict(color="black", marker="o")),
    ("moe_quant", "moe_quant emulated MXFP8", dict(color="tab:blue", marker="s")),
    ("torchao", "torchao emulated MXFP8", dict(color="tab:red", marker="^")),
)
FAMILY_TITLES = {"dsv3": "DeepSeek-V3 expert", "llama4": "Llama4 expert"}


def series(record: dict) -> dict:
    """{family: {"shape": (k, n, g), impl: {m: ms}}} from the rows that have a time."""
    out: dict = {}
    for row in record.get("rows", []):
        if row.get("ms") is None:
            continue
        fam = out.setdefault(row["family"], {"shape": (row["k"], row["n"], row["g"])})
        fam.setdefault(row["impl"], {})[row["m"]] = row["ms"]  # a later row of the same M wins
    return out


def plot(record: dict, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(record)
    if not data:
        raise SystemExit("no timed rows in the JSON")
    families = [f for f in FAMILY_TITLES if f in data] + sorted(f for f in data if f not in FAMILY_TITLES)
    fig, axes = plt.subplots(1, len(families), figsize=(6.2 * len(families), 4.6), squeeze=False)
    for ax, fam in zip(axes[0], families):
        k, n, g = data[fam]["shape"]
        for impl, label, style in LINES:
            pts = sorted(data[fam].get(impl, {}).items())
            if not pts:
                continue
            ms = [m for m, _ in pts]
            ax.plot(ms, [t for _, t in pts], label=label, **style)
            if impl == "moe_quant":
                base = data[fam].get("bf16", {})
                for m, t in pts:
                    if m in base:
                        ax.annotate(f"{t / base[m]:.2f}x", (m, t), textcoords="offset points", xytext=(0, 7),
                                    ha="center", fontsize=8, color=style["color"])
        ax.set_xscale("log", base=2)
        ax.margins(x=0.08, y=0.15)
        ax.set_yscale("log")
        ms_all = sorted({m for impl, _, _ in LINES for m in data[fam].get(impl, {})})
        ax.set_xticks(ms_all)
        ax.set_xticklabels([str(m) for m in ms_all], rotation=30)
        ax.set_xlabel("M (tokens routed to the layer)")
        ax.set_ylabel("fwd+bwd time (ms)")
        ax.set_title(f"{FAMILY_TITLES.get(fam, fam)}: K={k} -> N={n}, G={g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    smoke = " (CPU/tiny smoke numbers, not a measurement)" if is_smoke(record) else ""
    fig.suptitle(f"One expert layer fwd+bwd on {record.get('device', '?')}, torch {record.get('torch', '?')}{smoke}\n"
                 "labels: moe_quant time / bf16 time")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=130)
    plt.close(fig)


def is_smoke(record: dict) -> bool:
    return record.get("device") == "cpu" or bool(record.get("tiny"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="output of bench_grouped_mm --json")
    p.add_argument("--out", type=cli.writable_file, default=None, help=f"PNG to write (default {os.path.relpath(DEFAULT_OUT)})")
    args = p.parse_args(argv)
    try:
        with open(args.json) as fh:
            record = json.load(fh)
    except OSError as exc:
        p.error(f"cannot read {args.json}: {exc.strerror}; write it with: python -m benchmarks.bench_grouped_mm "
                f"--shapes dsv3,llama4 --m 16384,32768,65536,131072 --json {args.json}")
    except json.JSONDecodeError as exc:
        p.error(f"{args.json} is not JSON from bench_grouped_mm --json ({exc})")
    if args.out is None and is_smoke(record):
        raise SystemExit("refusing to write CPU / --tiny numbers to docs/layer_time.png; pass --out PATH to plot them")
    out = args.out or DEFAULT_OUT
    plot(record, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
