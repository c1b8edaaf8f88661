"""``python -m examples.titan.checks`` on 2 gloo CPU ranks at debug size, for ``tests/test_titan_trainer*.py``.

Importing this skips the importing test module where torchtitan is not importable; ``NEEDS_GLOO`` is its mark."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from repo_subprocess import run_python

from examples.titan.launch import stub_missing_fsdp_names

stub_missing_fsdp_names()  # torchtitan 0.3.0 imports a name torch 2.11 lacks (a placeholder; see the launcher)
pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan not importable")
NEEDS_GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")

STEPS, SAVE_AT, KILL_AT = 5, 2, 3


def run_checks(out, *args) -> dict:
    """Runs the checks (DeepSeek-V3 debugmodel x 2 blocks, ``STEPS`` steps, a checkpoint every ``SAVE_AT``) into
    ``out``; returns the process, its report and the checks by ``(check, variant)``."""
    proc = run_python("-m", "examples.titan.checks", "--out", str(out), "--nproc", "2", "--flavor", "debugmodel",
                      "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--kill-at", str(KILL_AT), "--no-deterministic",
                      *args, timeout=1200)
    path = out / "checks.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())
    return {"proc": proc, "report": report, "out": out, "by": {(c["check"], c["variant"]): c for c in report["checks"]}}


def assert_all_passed(checks: dict, expected: list) -> None:
    report, proc = checks["report"], checks["proc"]
    failed = [c for c in report["checks"] if not c["passed"]]
    assert proc.returncode == 0 and report["passed"] and not failed, json.dumps(failed, indent=1)[-6000:]
    assert sorted(checks["by"]) == sorted(expected)
