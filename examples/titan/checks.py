"""Checkpoint and fault checks of torchtitan's trainer with the configs of :mod:`examples.titan.config_registry`::

    python -m examples.titan.checks --out out/titan_checks [--nproc 2] [--variants mxfp8,bf16] [--modes eager]
    python -m examples.titan.checks --out /tmp/c --flavor debugmodel -- --compile.backend aot_eager   # CPU (gloo)

Every job is launched the way users launch torchtitan (``torchrun -m examples.titan.launch``, i.e.
``torchtitan.train``), checkpoints are torchtitan's DCP (its ``CheckpointManager``):

* ``resume`` (each variant and mode): a reference job of ``--steps`` S steps saving every ``--save-at`` N steps;
  a fresh job resuming from the reference's step-N checkpoint. Pass: it starts at step N + 1 and its losses of
  steps N + 1 .. S equal the reference's bit for bit, on every rank.
* ``crossload`` (each mode; it runs the bf16 and mxfp8 references if ``--variants`` has not): the bf16
  reference's step-N checkpoint loaded by a fresh job of the converted model
  (``mxfp8``), and the ``mxfp8`` reference's by a bf16 job. Pass: both load (DCP raises on a key the checkpoint
  lacks: the state dict keys are the same), continue at step N + 1, and their step-N+1 loss is within
  ``--crossload-rtol`` of the reference that wrote the checkpoint (the same weights and batch, the other
  experts' numerics).
* ``fault`` (each of ``--fault-variants``, eager): the last rank kills itself (SIGKILL) after step K
  (``--kill-at``, N < K < S); the job is restarted and resumes from the step-N checkpoint: ``--restart manual``
  (default): the killed job fails and a second job is started in its dump folder; ``torchrun``: torchrun's own
  ``--max-restarts 1`` restarts every rank (with gloo its restarted ranks failed now and then to connect,
  ``Gloo connectFullMesh failed ... Connection refused``). Pass: the restart happened (the rank logged steps
  N + 1 .. K twice) and the losses of steps 1 .. S equal the reference's bit for bit.
* ``mismatch`` (each of ``--mismatch``, e.g. ``scale_mode=floor``, for each of ``--mismatch-variants``: ``mxfp8``,
  ``converted``): the ranks started by hand, the last with that moe_quant setting changed. Pass: every rank exits
  with an error within ``--mismatch-timeout`` seconds, every log holds the same ``... disagree on ...`` message
  (moe_quant's settings check when torchtitan parallelizes the model, or its dispatcher's handshake), none a
  watchdog or timeout. ``converted`` (torchtitan's dispatcher) takes only ``scale_mode``: the dispatcher settings
  are unused there, so ranks that differ in them train alike.

``--deterministic`` (default where CUDA is present) adds torchtitan's ``--debug.deterministic`` to every job: a
bit-for-bit comparison needs the same kernels to give the same bits run to run (CUDA atomics in index_add and
scatter_add do not). Arguments after ``--`` go to every job (torchtitan's command line). The report,
``<out>/checks.json``, is rewritten after every check; the exit status is 1 if any check failed. Checkpoints are
deleted once no check needs them (``--keep-checkpoints`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from examples.titan import runs

MISMATCH_MESSAGE = re.compile(r"(?:EP ranks|moe_quant: ranks) disagree on [^\n]*")
MISMATCH_VARIANTS = ("mxfp8", "converted")
HANG_WORDS = ("watchdog", "Watchdog", "timed out", "Timeout", "DistBackendError")


def parse_args(argv=None):
    p, argv, extra = runs.parser(__doc__, argv, layers=2, steps=6, modes="eager", timeout=900.0)
    p.add_argument("--save-at", type=int, default=3, help="N: checkpoint interval and the step resumed from")
    p.add_argument("--kill-at", type=int, default=None, help="K: the fault check's kill step (default N + 1)")
    p.add_argument("--checks", default="resume,crossload,fault,mismatch")
    p.add_argument("--fault-variants", default="mxfp8")
    p.add_argument("--mismatch", default="scale_mode=floor,wire=bf16",
                   help="moe_quant settings the last rank gets instead (comma list of name=value)")
    p.add_argument("--restart", default="manual", choices=["manual", "torchrun"],
                   help="fault check: restart by a second job (manual) or by torchrun --max-restarts 1")
    p.add_argument("--crossload-rtol", type=float, default=0.02)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available())
    p.add_argument("--mismatch-timeout", type=float, default=300.0)
    p.add_argument("--mismatch-variants", default="mxfp8",
                   help="variants of the mismatch check: mxfp8 (moe_quant's dispatcher), converted (torchtitan's)")
    p.add_argument("--keep-checkpoints", action="store_true")
    args = p.parse_args(argv)
    args.extra = extra
    args.variants = runs.names(p, "--variants", args.variants, runs.VARIANTS)
    args.fault_variants = runs.names(p, "--fault-variants", args.fault_variants, runs.VARIANTS)
    args.modes = runs.names(p, "--modes", args.modes, ("eager", "compiled"))
    args.checks = runs.names(p, "--checks", args.checks, ("resume", "crossload", "fault", "mismatch"))
    args.mismatch = [tuple(kv.split("=", 1)) for kv in args.mismatch.split(",") if kv]
    if any(len(kv) != 2 or kv[0] not in ("scale_mode", "wire", "capacity_factor") for kv in args.mismatch):
        p.error("--mismatch takes name=value pairs of scale_mode, wire, capacity_factor")
    args.mismatch_variants = runs.names(p, "--mismatch-variants", args.mismatch_variants, MISMATCH_VARIANTS)
    # converted (torchtitan's dispatcher): only scale_mode is in effect (see the module doc)
    args.mismatch_runs = [(v, kv) for v in args.mismatch_variants for kv in args.mismatch
                          if v == "mxfp8" or kv[0] == "scale_mode"]
    if "converted" in args.mismatch_variants and not any(v == "converted" for v, _ in args.mismatch_runs):
        p.error("--mismatch-variants converted needs a scale_mode=... in --mismatch (its only setting in effect)")
    if args.kill_at is None:
        args.kill_at = args.save_at + 1
    if not 1 <= args.save_at < args.kill_at < args.steps:
        p.error(f"need 1 <= --save-at ({args.save_at}) < --kill-at ({args.kill_at}) < --steps ({args.steps})")
    if args.nproc < 2:
        p.error("--nproc must be at least 2 (expert parallelism over the ranks)")
    return args


class Checks:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = []
        self.refs = {}  # (variant, mode) -> reference dump folder

    def job_args(self, mode: str, steps: int) -> list[str]:
        a = self.args
        args = ["--moe_quant.layers", str(a.layers), "--training.steps", str(steps), "--checkpoint.enable",
                "--checkpoint.interval", str(a.save_at), "--checkpoint.last-save-model-only", "--metrics.log_freq", "1"]
        if mode == "compiled":
            args.append("--compile.enable")
        if a.deterministic:
            args.append("--debug.deterministic")
        return args + a.extra

    def launch(self, name: str, variant: str, mode: str, *, seed_from=None, env=None, max_restarts=0, fresh=True,
               log=None):
        """One torchrun job in the dump folder ``<out>/<name>`` (``fresh``: emptied first); ``seed_from``: (dump,
        step) to resume from."""
        dump = self.out / name
        if fresh:
            shutil.rmtree(dump, ignore_errors=True)
        if seed_from is not None:
            runs.seed_checkpoint(seed_from[0], seed_from[1], str(dump))
        targs = runs.trainer_args(self.args.flavor, variant, str(dump), self.job_args(mode, self.args.steps))
        log = str(self.out / f"{log or name}.log")
        job = runs.run(runs.torchrun(self.args.nproc, targs, max_restarts=max_restarts), log, env=env,
                       timeout=self.args.timeout)
        print(f"  job {name}: rc {job.rc}, {job.seconds:.0f} s", flush=True)
        return str(dump), job

    def record(self, name: str, variant: str | None, mode: str | None, passed: bool, **details):
        self.results.append({"check": name, "variant": variant, "mode": mode, "passed": bool(passed), **details})
        print(f"{'PASS' if passed else 'FAIL'} {name} {variant or ''} {mode or ''}: "
              f"{details.get('summary', '')}", flush=True)
        self.write()

    def write(self):
        a = self.args
        report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                  else "cpu", "nproc": a.nproc, "flavor": a.flavor, "layers": a.layers, "steps": a.steps,
                  "save_at": a.save_at, "kill_at": a.kill_at, "deterministic": a.deterministic, "extra": a.extra,
                  "command": " ".join(sys.argv), "checks": self.results,
                  "passed": all(r["passed"] for r in self.results)}
        (self.out / "checks.json").write_text(json.dumps(report, indent=1))

    def reference(self, variant: str, mode: str):
        key = (variant, mode)
        if key not in self.refs:
            dump, job = self.launch(f"ref_{variant}_{mode}", variant, mode)
            self.refs[key] = (dump, job)
        return self.refs[key]

    def _ref_ok(self, name, variant, mode) -> str | None:
        dump, job = self.reference(variant, mode)
        if job.rc != 0 or self.args.save_at not in runs.checkpoint_steps(dump):
            self.record(name, variant, mode, False, summary=f"the reference job failed (rc {job.rc})",
                        log=runs.log_tail(job.log))
            return None
        return dump

    def resume(self, variant: str, mode: str):
        a = self.args
        ref = self._ref_ok("resume", variant, mode)
        if ref is None:
            return
        dump, job = self.launch(f"resume_{variant}_{mode}", variant, mode, seed_from=(ref, a.save_at))
        want, got = runs.losses(ref), runs.losses(dump)
        steps = list(range(a.save_at + 1, a.steps + 1))
        ok = job.rc == 0 and sorted(got) == sorted(want) == list(range(a.nproc))
        diffs = []
        for r in sorted(got):
            if sorted(got[r]) != steps:
                ok = False
                diffs.append(f"rank {r} logged steps {sorted(got[r])}, expected {steps}")
                continue
            diffs += [f"rank {r} step {s}: {got[r][s]!r} != {want[r].get(s)!r}" for s in steps
                      if got[r][s] != want[r].get(s)]
        ok = ok and not diffs
        self.record("resume", variant, mode, ok, summary=f"steps {steps[0]}..{steps[-1]} after resuming from step "
                    f"{a.save_at}: {'equal bit for bit' if ok else f'{len(diffs)} difference(s)'}",
                    reference=want, resumed=got, differences=diffs, seconds=job.seconds,
                    log=None if ok else runs.log_tail(job.log))
        self.setup_of(variant, ref)

    def setup_of(self, variant, dump):
        """What the reference job built, checked against the variant (every rank)."""
        want = {"bf16": ("GroupedExperts", False, "AllToAllTokenDispatcher"),
                "converted": ("GroupedExperts", True, "AllToAllTokenDispatcher"),
                "mxfp8": ("GroupedExperts", True, "TitanMXFP8TokenDispatcher"),
                "mxfp8_sync_free": ("GroupedExperts", True, "TitanMXFP8TokenDispatcher")}[variant]
        problems = []
        for r, s in runs.setup(dump).items():
            got = (s["experts"], s["experts_converted"], s["dispatchers"], s["ep_sizes"])
            n = len(s["experts"])
            expected = ([want[0]] * n, [want[1]] * n, [want[2]] * n, [self.args.nproc] * n)
            if n == 0 or got != expected:
                problems.append(f"rank {r}: {got}")
        if problems:
            self.record("setup", variant, None, False, summary="; ".join(problems))

    def crossload(self, mode: str):
        a = self.args
        for src, dst in (("bf16", "mxfp8"), ("mxfp8", "bf16")):
            ref = self._ref_ok("crossload", src, mode)
            if ref is None:
                continue
            dump, job = self.launch(f"crossload_{src}_to_{dst}_{mode}", dst, mode, seed_from=(ref, a.save_at))
            got, want = runs.losses(dump), runs.losses(ref)
            step = a.save_at + 1
            first = {r: min(v) if v else None for r, v in got.items()}
            pairs = {r: (got[r].get(step), want[r].get(step)) for r in got}
            ok = job.rc == 0 and len(got) == a.nproc and all(f == step for f in first.values()) and all(
                g is not None and w is not None and math.isfinite(g) and abs(g - w) <= a.crossload_rtol * abs(w)
                for g, w in pairs.values())
            self.record("crossload", f"{src}->{dst}", mode, ok,
                        summary=f"{src} checkpoint of step {a.save_at} into the {dst} model: first step "
                        f"{sorted(set(first.values()))}, step {step} loss {pairs.get(0)} (loaded, written-by)",
                        first_step=first, losses=pairs, seconds=job.seconds, log=None if ok else runs.log_tail(job.log))

    def fault(self, variant: str):
        a = self.args
        ref = self._ref_ok("fault", variant, "eager")
        if ref is None:
            return
        victim, kill = a.nproc - 1, {"MOE_QUANT_TITAN_KILL": f"{a.nproc - 1}:{a.kill_at}"}
        if a.restart == "torchrun":  # torchrun restarts every rank once the killed one is gone
            dump, job = self.launch(f"fault_{variant}", variant, "eager", env=kill, max_restarts=1)
            jobs = [job]
        else:  # the job fails; a second job in the same dump folder resumes from its last checkpoint
            dump, first = self.launch(f"fault_{variant}", variant, "eager", env=kill, log=f"fault_{variant}_killed")
            dump, job = self.launch(f"fault_{variant}", variant, "eager", fresh=False)
            jobs = [first, job]
        rows = runs.raw_rows(dump, victim)
        twice = sorted({r["step"] for r in rows if sum(x["step"] == r["step"] for x in rows) > 1})
        got, want = runs.losses(dump), runs.losses(ref)
        diffs = [f"rank {r} step {s}: {got.get(r, {}).get(s)!r} != {want[r][s]!r}" for r in want for s in want[r]
                 if got.get(r, {}).get(s) != want[r][s]]
        restarted = twice == list(range(a.save_at + 1, a.kill_at + 1))
        ok = job.rc == 0 and restarted and not diffs and (a.restart == "torchrun" or jobs[0].rc not in (0, None))
        self.record("fault", variant, "eager", ok,
                    summary=f"rank {victim} killed after step {a.kill_at}, restarted by {a.restart}; steps logged "
                    f"twice {twice}; " + ("losses equal the uninterrupted run bit for bit" if not diffs
                                    else f"{len(diffs)} difference(s)"),
                    restart=a.restart, exit_codes=[j.rc for j in jobs], logged_twice=twice, differences=diffs,
                    seconds=sum(j.seconds for j in jobs), log=None if ok else [runs.log_tail(j.log) for j in jobs])

    def mismatch(self, setting: tuple, variant: str = "mxfp8"):
        a = self.args
        name, value = setting
        tag = f"mismatch_{name}" + ("" if variant == "mxfp8" else f"_{variant}")
        shutil.rmtree(self.out / tag, ignore_errors=True)
        rank_args = []
        for r in range(a.nproc):
            dump = self.out / tag / f"rank{r}"
            extra = [f"--moe_quant.{name}", value] if r == a.nproc - 1 else []
            rank_args.append(runs.trainer_args(a.flavor, variant, str(dump), self.job_args("eager", a.steps) + extra))
        logs = [str(self.out / f"{tag}_rank{r}.log") for r in range(a.nproc)]
        jobs = runs.run_ranks(rank_args, logs, timeout=a.mismatch_timeout)
        texts = [runs.log_tail(j.log, 200_000) for j in jobs]
        messages = [sorted(set(MISMATCH_MESSAGE.findall(t))) for t in texts]
        hangs = [[w for w in HANG_WORDS if w in t] for t in texts]
        ok = (all(j.rc not in (0, None) for j in jobs) and all(len(m) == 1 for m in messages)
              and len({m[0] for m in messages if m}) == 1 and not any(hangs))
        self.record("mismatch", variant, "eager", ok,
                    summary=f"rank {a.nproc - 1} with {name}={value}: exit codes {[j.rc for j in jobs]} after "
                    f"{max(j.seconds for j in jobs):.0f} s; {messages[0][0] if messages[0] else 'no message'}",
                    messages=messages, exit_codes=[j.rc for j in jobs], seconds=[j.seconds for j in jobs],
                    hang_words=hangs, logs=None if ok else [runs.log_tail(j.log) for j in jobs])

    def drop_checkpoints(self, keep=()):
        if self.args.keep_checkpoints:
            return
        for d in self.out.glob("*/checkpoint"):
            if not any(str(d.parent) == str(k) for k in keep):
                shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs.exit_on_sigterm()
    c = Checks(args)
    refs = {(v, m) for v in args.variants for m in args.modes} | (
        {(v, m) for v in ("bf16", "mxfp8") for m in args.modes} if "crossload" in args.checks else set()) | (
        {(v, "eager") for v in args.fault_variants} if "fault" in args.checks else set())
    jobs = (len(refs) + (len(args.variants) * len(args.modes) if "resume" in args.checks else 0)
            + (2 * len(args.modes) if "crossload" in args.checks else 0)
            + ((2 if args.restart == "manual" else 1) * len(args.fault_variants) if "fault" in args.checks else 0))
    print(f"examples.titan.checks: {args.nproc} ranks, {args.flavor} x {args.layers} layers, {args.steps} steps, "
          f"checkpoint every {args.save_at}; about {jobs} torchrun jobs and "
          f"{len(args.mismatch_runs) if 'mismatch' in args.checks else 0} mismatch launches",
          flush=True)
    t0 = time.monotonic()
    for mode in args.modes:
        for variant in args.variants:
            if "resume" in args.checks:
                c.resume(variant, mode)
            keep = [c.refs[k][0] for k in c.refs if k[0] in ("bf16", "mxfp8") or k[0] in args.fault_variants]
            c.drop_checkpoints(keep=keep)
        if "crossload" in args.checks:
            c.crossload(mode)
        c.drop_checkpoints(keep=[c.refs[k][0] for k in c.refs if k[1] == "eager" and k[0] in args.fault_variants])
    if "fault" in args.checks:
        for variant in args.fault_variants:
            c.fault(variant)
            c.drop_checkpoints()
    if "mismatch" in args.checks:
        for variant, setting in args.mismatch_runs:
            c.mismatch(setting, variant)
    c.drop_checkpoints()
    c.write()
    failed = [r for r in c.results if not r["passed"]]
    print(f"{len(c.results) - len(failed)} of {len(c.results)} checks passed in {time.monotonic() - t0:.0f} s; "
          f"report: {c.out / 'checks.json'}", flush=True)
    return 1 if failed or not c.results else 0


if __name__ == "__main__":
    sys.exit(main())
