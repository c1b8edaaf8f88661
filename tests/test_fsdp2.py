"""FSDP2 (fully_shard) on MXFP8-converted experts with 2 CPU processes over gloo.

Runs ``scripts/fsdp2_check.py`` under torchrun: FSDP2 training (fp32 sharded parameters,
bf16 compute) must match a hand-written data-parallel reference step for step, for even
and uneven (3 experts on 2 ranks) sharding, and each rank must tear the process group down
with no gloo thread left behind; see the script for the checks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_fsdp2_two_cpu_processes(warm_torchrun):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank: the model is tiny and the machine may be busy
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "scripts" / "fsdp2_check.py"), "--device", "cpu", "--experts", "4,3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-6000:]
    assert "[fsdp2_check] PASS experts=4 world=2" in proc.stdout, report[-6000:]
    assert "[fsdp2_check] PASS experts=3 world=2" in proc.stdout, report[-6000:]
    assert "[fsdp2_check] PASS overall" in proc.stdout, report[-6000:]
    # Teardown: every rank destroyed the process group and no gloo thread outlived it (a backend
    # left to interpreter shutdown aborted rank 0 now and then after "PASS overall").
    for rank in (0, 1):
        assert f"[fsdp2_check] rank {rank} teardown: process group destroyed, no gloo threads left" in proc.stdout, (
            report[-6000:]
        )
    assert "terminate called" not in report, report[-6000:]
