"""Launching jobs of :mod:`examples.titan.config_registry` through torchtitan's trainer and reading what they wrote
(for :mod:`examples.titan.bench` and :mod:`examples.titan.checks`).

A job is ``torchrun --standalone --nproc_per_node N -m examples.titan.launch --module examples.titan.config_registry
--config <fn> --dump_folder <dir> ...`` from the repository root (``examples.titan.launch`` is
``torchtitan.train`` plus the shims a released torch lacks), with ``PYTORCH_ALLOC_CONF=expandable_segments:True``
as torchtitan's own ``run_train.sh`` launches every job (:data:`ALLOC_CONF`; an allocator setting of the caller's,
``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``, is kept instead). What a job leaves in its dump folder:
``metrics/rank<r>.jsonl`` (every logged step), ``setup/rank<r>.json`` (what was built), ``checkpoint/step-<n>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.titan.config_registry"
VARIANTS = ("bf16", "converted", "mxfp8", "mxfp8_sync_free")


def parser(doc: str, argv=None, *, layers: int | None, steps: int, modes: str, timeout: float):
    """The arguments :mod:`examples.titan.bench`, :mod:`examples.titan.checks` and :mod:`examples.titan.fit_layers`
    share: ``(parser, argv, extra)``, ``extra`` being what follows ``--`` (for every job's torchtitan command line);
    ``layers`` None: no ``--layers`` (a script that picks the count itself)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (the jobs' dump folders and logs, the report)")
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count() if cuda else 2, help="ranks per job")
    p.add_argument("--flavor", default="16B" if cuda else "debugmodel", choices=["16B", "debugmodel"])
    if layers is not None:
        p.add_argument("--layers", type=int, default=layers,
                       help="transformer blocks kept (block 0 dense, the others MoE)")
    p.add_argument("--steps", type=int, default=steps, help="steps of every job")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default=modes, help="eager and/or compiled (torchtitan's --compile.enable)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per job")
    return p, argv, extra


def names(p, flag: str, text: str, allowed) -> list[str]:
    """A comma list of ``allowed`` names (``p.error`` otherwise)."""
    out = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in out if n not in allowed]
    if bad or not out:
        p.error(f"{flag} takes a comma list of {list(allowed)}, got {text!r}")
    return out


def config_name(flavor: str, variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    prefix = {"16B": "deepseek_v3_16b", "debugmodel": "deepseek_v3_debug"}.get(flavor)
    if prefix is None:
        raise ValueError(f"flavor must be 16B or debugmodel, got {flavor!r}")
    return f"{prefix}_{variant}"


def trainer_args(flavor: str, variant: str, dump: str, args=()) -> list[str]:
    """``examples.titan.launch``'s arguments (torchtitan's command line) for one job."""
    return ["--module", MODULE, "--config", config_name(flavor, variant), "--dump_folder", str(dump), *args]


def torchrun(nproc: int, targs: list[str], *, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(max_restarts), "-m", "examples.titan.launch", *targs]


@dataclasses.dataclass
class Job:
    rc: int | None  # None: killed at the timeout
    seconds: float
    log: str


ALLOC_CONF = "expandable_segments:True"  # what torchtitan's run_train.sh sets for its jobs


def alloc_conf(env: dict) -> str:
    """The CUDA caching allocator's settings a job started with ``env`` runs with."""
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    if not alloc_conf(env):
        env["PYTORCH_ALLOC_CONF"] = ALLOC_CONF
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def _finish(proc, started: float, timeout: float | None, log_file) -> Job:
    """Wait for ``proc`` (its own process group); at the timeout, or if this process is interrupted, kill the group."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    except BaseException:
        _kill(proc)
        raise
    finally:
        log_file.close()
    if rc is None:
        _kill(proc)
    return Job(rc=rc, seconds=time.monotonic() - started, log=log_file.name)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit) raises SystemExit, so the jobs' process groups are killed on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def run(cmd: list[str], log: str, *, env: dict | None = None, timeout: float | None = None) -> Job:
    """Run ``cmd`` from the repository root (its output to ``log``); never longer than ``timeout`` seconds."""
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    started = time.monotonic()
    log_file = open(log, "w", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=log_file, stderr=subprocess.STDOUT,
                            preexec_fn=os.setpgrp)  # a group, not a new session: a time limit ends it too
    return _finish(proc, started, timeout, log_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(rank_args: list[list[str]], logs: list[str], *, timeout: float) -> list[Job]:
    """One process per rank started by hand (no torchrun), rank ``r`` with its own arguments ``rank_args[r]``; the
    interpreter torchrun would start (``PYTHON_EXEC``, else this one)."""
    world, port = len(rank_args), free_port()
    started = time.monotonic()
    procs = []
    for rank, (targs, log) in enumerate(zip(rank_args, logs)):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
        log_file = open(log, "w", encoding="utf-8")
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        procs.append((subprocess.Popen([python, "-m", "examples.titan.launch", *targs], cwd=ROOT, env=env,
                                       stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp), log_file))
    deadline = started + timeout
    try:
        return [_finish(p, started, max(0.0, deadline - time.monotonic()), f) for p, f in procs]
    except BaseException:
        for p, _ in procs:
            if p.poll() is None:
                _kill(p)
        raise


def read_jsonl(path: str) -> list[dict]:
    """The rows of one rank's metrics file (:mod:`examples.titan.metrics`); a later row of the same step (a
    resumed or restarted job) replaces the earlier."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def metrics(dump: str) -> dict[int, list[dict]]:
    """Every rank's logged steps (a step logged again by a resumed job: its later row)."""
    folder = Path(dump) / "metrics"
    if not folder.is_dir():
        return {}
    return {int(p.stem[4:]): read_jsonl(str(p)) for p in sorted(folder.glob("rank*.jsonl"))}


def losses(dump: str) -> dict[int, dict[int, float]]:
    """``{rank: {step: global average loss}}``."""
    return {r: {row["step"]: row["loss_metrics/global_avg_loss"] for row in rows} for r, rows in metrics(dump).items()}


def raw_rows(dump: str, rank: int) -> list[dict]:
    """A rank's rows as written, duplicates included (a restarted job logs the steps after its checkpoint again)."""
    path = Path(dump) / "metrics" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def setup(dump: str) -> dict[int, dict]:
    folder = Path(dump) / "setup"
    if not folder.is_dir():
        return {}
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))}


def checkpoint_steps(dump: str) -> list[int]:
    folder = Path(dump) / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.glob("step-*") if (p / ".metadata").exists())


def seed_checkpoint(src_dump: str, step: int, dst_dump: str) -> None:
    """Put ``src_dump``'s checkpoint of ``step`` in ``dst_dump``'s checkpoint folder (hard links where the file
    system allows, else copies), so a fresh job in ``dst_dump`` resumes from it."""
    src = Path(src_dump) / "checkpoint" / f"step-{step}"
    if not (src / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint of step {step} in {src_dump}")
    dst = Path(dst_dump) / "checkpoint" / f"step-{step}"
    dst.parent.mkdir(parents=True, exist_ok=True)

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def log_tail(path: str, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


__all__ = ["exit_on_sigterm", "parser", "names", "config_name", "trainer_args", "torchrun", "run", "run_ranks",
           "metrics", "losses", "raw_rows", "setup", "checkpoint_steps", "seed_checkpoint", "log_tail", "Job",
           "VARIANTS"]
