"""A/B of two revisions' kernels: each timed in its own processes, the two alternating, in interleaved rounds.

    python scripts/ab_commits.py OLD NEW [--what permute,block] [--rounds 5]

OLD and NEW are git revisions of this repository, ``WORKTREE`` (the working tree's ``moe_quant``), or a folder
holding a ``moe_quant`` (a copy without git history, e.g. on a machine the working tree was copied to). Each
revision's ``moe_quant`` is exported (``git archive``) or copied to a temporary folder, which goes first on the
``PYTHONPATH`` of the processes that time it; the benchmarks' helpers come from this checkout, and each process
checks that the ``moe_quant`` it imported is its revision's. Every round runs each revision once (OLD first in
odd rounds, NEW first in even ones). Printed per op and shape: % of a bf16 memcpy of the same tensor measured in
the same process (the benchmark's byte count), median (min-max) over the rounds, and NEW / OLD of the medians.
A clock that drifts within the run moves both sides alike; the spread says how much.

``--what``: ``permute`` (``permute_mxfp8``, blocked and dequant outputs, R = E = 8 ragged, as
``benchmarks.bench_permute``), ``block`` (the fused ``dual`` / ``swiglu`` / ``dswiglu`` ops, bf16 and fp8
outputs, as ``benchmarks.bench_block_kernels``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["--child"]:  # a child imports its revision's moe_quant, first on PYTHONPATH
    sys.path[:0] = [str(ROOT)]
from moe_quant import cli  # noqa: E402

WHAT = ("permute", "block")
PERMUTE_SHAPES = [(8192, 2048), (32768, 2048), (32768, 7168), (131072, 7168)]  # (M, K)
what_list = cli.comma_choices(*WHAT)  # --what
positive = cli.positive_int  # --rounds


# ----------------------------------------------------------------------------- parent


def export(rev: str, dest: Path, root: Path = ROOT) -> None:
    """``rev``'s ``moe_quant`` (``WORKTREE``: the working tree's, without compiled ``__pycache__``) of the checkout
    at ``root`` into ``dest``."""
    import shutil

    if rev == "WORKTREE" or _is_tree(rev):
        src = root / "moe_quant" if rev == "WORKTREE" else Path(rev) / "moe_quant"
        shutil.copytree(src, dest / "moe_quant", ignore=shutil.ignore_patterns("__pycache__"))
        return
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "moe_quant"], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"ab_commits.py: revision {rev!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def child_env(tree: Path, environ=None) -> dict:
    """The environment of a process timing ``tree``'s ``moe_quant``: ``tree`` first on ``PYTHONPATH``, then this
    checkout (the benchmarks' helpers), then the caller's ``PYTHONPATH`` (where the packages may be, e.g. a GPU
    machine's staged cutlass and torchao)."""
    environ = os.environ if environ is None else environ
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT), *rest]))


def _is_tree(rev: str) -> bool:
    return (Path(rev) / "moe_quant" / "__init__.py").is_file()


def check_revision(rev: str) -> str:
    if rev != "WORKTREE" and not _is_tree(rev) and subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                                             f"{rev}^{{commit}}"], capture_output=True).returncode != 0:
        raise argparse.ArgumentTypeError(f"expected a git revision of this repository, WORKTREE, or a folder holding "
                                         f"a moe_quant package, got {rev!r}")
    return rev


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["key"], {}).setdefault(r["side"], []).append(r["pct"])
    out = [f"{'op, shape, out':44s}  {'OLD % memcpy':20s}  {'NEW % memcpy':20s}  NEW/OLD"]
    for key, sides in by.items():
        cells = []
        for side in ("old", "new"):
            v = sides.get(side, [])
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "-")
        ratio = (statistics.median(sides["new"]) / statistics.median(sides["old"])
                 if sides.get("old") and sides.get("new") else float("nan"))
        out.append(f"{key:44s}  {cells[0]:20s}  {cells[1]:20s}  {ratio:.3f}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    from benchmarks.timing import require_cuda

    p = argparse.ArgumentParser(prog="ab_commits.py", description=__doc__.splitlines()[0])
    p.add_argument("old", type=check_revision, help="git revision, WORKTREE, or a folder holding moe_quant")
    p.add_argument("new", type=check_revision, help="git revision, WORKTREE, or a folder holding moe_quant")
    p.add_argument("--what", type=what_list, default=list(WHAT))
    p.add_argument("--rounds", type=positive, default=5)
    require_cuda(argv)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ab_commits_") as tmp:
        trees = {}
        for side, rev in (("old", args.old), ("new", args.new)):
            trees[side] = Path(tmp) / side
            trees[side].mkdir()
            export(rev, trees[side])
        for rnd in range(args.rounds):
            for side in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                out = Path(tmp) / f"{side}_{rnd}.json"
                env = child_env(trees[side])
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(args.what), str(trees[side]),
                       str(out)]
                proc = subprocess.run(cmd, env=env, cwd=str(ROOT))
                if proc.returncode != 0:
                    print(f"ab_commits.py: the {side} revision's process failed (exit {proc.returncode})",
                          file=sys.stderr)
                    return 1
                rows += [dict(r, side=side) for r in json.loads(out.read_text())]
            print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"OLD = {args.old}, NEW = {args.new}, {args.rounds} rounds ({rows[0]['device'] if rows else '-'})")
    print(table(rows))
    return 0


# ----------------------------------------------------------------------------- child (one revision, one round)


def child(what: list[str], tree: str, out: str) -> None:
    import torch

    import moe_quant

    if not Path(moe_quant.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"ab_commits.py: imported {moe_quant.__file__}, not the revision's tree {tree}")
    from benchmarks.timing import device_name

    rows = []
    if "permute" in what:
        from benchmarks.bench_permute import time_outputs

        for m, k in PERMUTE_SHAPES:
            for kind, us, t, cp in time_outputs(m, k, 8, 8, outs=("blocked", "dequant")):
                rows.append({"key": f"permute {m}x{k} {kind}", "us": us, "pct": 100 * t / cp})
            torch.cuda.empty_cache()  # the shape's rotating inputs, freed on return
    if "block" in what:
        from benchmarks.bench_block_kernels import DEFAULT_SHAPES, time_shape

        for m, r, g in DEFAULT_SHAPES:
            for x in time_shape(m, r, g, ("fake", "mxfp8"), with_unfused=False):
                rows.append({"key": f"{x['op']} {m}x{r} {'bf16' if x['out'] == 'fake' else 'fp8'}", "us": x["us"],
                             "pct": x["pct_memcpy"]})
    for row in rows:
        row["device"] = device_name()
    Path(out).write_text(json.dumps(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2].split(","), sys.argv[3], sys.argv[4])
    else:
        sys.exit(main(sys.argv[1:]))
