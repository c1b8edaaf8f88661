"""``python -m examples.titan.checks`` on 2 gloo CPU ranks at debug size, for ``tests/test_titan_trainer*.py``.

Importing this skips the importing test module where torchtitan is not importable; ``NEEDS_GLOO`` is its mark.
Both test modules read one run of every check (:func:`all_checks`, once per pytest session): its 7 torchrun jobs
and two mismatch launches, mxfp8 and converted (the mxfp8 reference job serves the resume, crossload and fault
checks alike). The modules' torchrun jobs run behind the other tests (:data:`JOBS`, ``tests/background.py``),
started at collection; the tests read them last.

The jobs compute in fp32 (``--training.mixed_precision_param float32``, torchtitan's own option; its default
is bf16): on a CPU without AVX512-BF16 a bf16 matmul whose operands are both untransposed (every
``nn.Linear``'s input gradient) runs through ATen's scalar fallback GEMM, about 100x slower than fp32; a
64-token step of the debug model took 2.1 s in bf16, 0.5 s in fp32. moe_quant's experts and dispatcher
quantize fp32 activations as they do bf16 ones (the same MXFP8 wire and GEMMs).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch.distributed as dist
from background import BackgroundCommands
from repo_subprocess import warm_ranks

from examples.titan.launch import stub_missing_fsdp_names

stub_missing_fsdp_names()  # torchtitan 0.3.0 imports a name torch 2.11 lacks (a placeholder; see the launcher)
pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan not importable")
NEEDS_GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")

STEPS, SAVE_AT, KILL_AT = 5, 2, 3
CPU_COMPUTE = ("--training.mixed_precision_param", "float32")  # see the module doc
ALL_CHECKS = [("crossload", "bf16->mxfp8"), ("crossload", "mxfp8->bf16"), ("fault", "mxfp8"), ("mismatch", "converted"),
              ("mismatch", "mxfp8"), ("resume", "mxfp8")]


JOBS = BackgroundCommands("titan_jobs_")  # both trainer test modules' jobs, one after another (tests/background.py)
JOB_TIMEOUT = 900.0  # one torchrun job's limit; a test waits longer (its job may queue behind others)
WAIT = 3600.0


def checks_argv(out, *args, job_args: tuple = ()) -> list:
    """``python -m examples.titan.checks`` (DeepSeek-V3 debugmodel x 2 blocks, ``STEPS`` steps, a checkpoint every
    ``SAVE_AT``) into ``out``; ``job_args``: more of torchtitan's options for every job."""
    return [sys.executable, "-m", "examples.titan.checks", "--out", str(out), "--nproc", "2", "--flavor", "debugmodel",
            "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--kill-at", str(KILL_AT), "--no-deterministic",
            *args, "--", *CPU_COMPUTE, *job_args]


def submit(key: str, make) -> None:
    """Queue ``make(folder) -> (argv, timeout_s)`` as :data:`JOBS`' ``key``, its ranks warm (``warm_ranks``)."""
    JOBS.submit(key, make, env=warm_ranks())


def submit_all_checks() -> None:
    """One run of every check (resume, crossload, fault, mismatch with ``scale_mode=floor``; variant mxfp8, and
    converted for the mismatch), shared by both test modules."""
    submit("all", lambda out: (checks_argv(out, "--variants", "mxfp8", "--checks", "resume,crossload,fault,mismatch",
                                           "--mismatch", "scale_mode=floor", "--mismatch-variants", "mxfp8,converted",
                                           "--fault-variants", "mxfp8"), 1200.0))


def checks_result(key: str) -> dict:
    """A submitted checks run's result: its job (:class:`background.Done`), report, folder and checks by
    ``(check, variant)``."""
    job, out = JOBS.result(key, WAIT), JOBS.folder(key)
    path = out / "checks.json"
    assert path.exists(), job.tail()
    report = json.loads(path.read_text())
    return {"job": job, "report": report, "out": out, "by": {(c["check"], c["variant"]): c for c in report["checks"]}}


def all_checks() -> dict:
    submit_all_checks()
    return checks_result("all")


def assert_all_passed(checks: dict, expected: list) -> None:
    """The run made every check of :data:`ALL_CHECKS` and no other record (a failed ``setup`` check, say); the
    ``expected`` ones passed; the exit status says whether all passed."""
    report, job = checks["report"], checks["job"]
    failed = [c for c in report["checks"] if not c["passed"]]
    mine = [c for c in failed if (c["check"], c["variant"]) in expected]
    assert not mine, json.dumps(mine, indent=1)[-6000:]
    assert sorted(checks["by"]) == sorted(ALL_CHECKS) and len(report["checks"]) == len(ALL_CHECKS), \
        json.dumps(failed, indent=1)[-6000:]
    assert (job.rc == 0) == report["passed"] == (not failed), (job.rc, job.tail())
