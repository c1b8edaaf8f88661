"""Benchmarks and scripts on a machine without a GPU, run from the repository root as documented."""

import pytest
import torch
from repo_subprocess import run_python

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


@no_gpu
@pytest.mark.parametrize("bench", ["bench_quantize", "bench_quantize_32x1", "bench_grouped_mm", "bench_moe"])
def test_benchmark_without_gpu_exits_2_with_one_line(bench):
    proc = run_python("-m", f"benchmarks.{bench}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr[-3000:]
    assert f"python -m benchmarks.{bench}" in lines[0]


def test_ab_script_runs_from_repo_root_without_pythonpath():
    proc = run_python("scripts/ab_1x32.py", "--help", pythonpath=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout


@no_gpu
@pytest.mark.parametrize("script", ["sanitize_1x32.py", "sanitize_32x1.py", "cache_timing.py"])
def test_gpu_scripts_run_from_repo_root_and_say_they_need_a_gpu(script):
    proc = run_python(f"scripts/{script}", pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"{script}: needs a CUDA GPU, and torch {torch.__version__} "
                                                "sees none (no GPU, or a CPU-only build)"], proc.stderr[-3000:]


@no_gpu
@pytest.mark.parametrize("bench", ["bench_grouped_mm", "bench_moe"])
def test_benchmark_cuda_index_without_gpu_exits_2_with_one_line(bench):
    proc = run_python("-m", f"benchmarks.{bench}", "--device", "cuda:0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr[-3000:]
    assert lines[0].startswith(f"python -m benchmarks.{bench}: --device cuda:0")


@pytest.mark.parametrize("script, argv, message", [
    ("ab_1x32.py", ["--reps", "0"], "argument --reps"),
    ("fsdp2_check.py", ["--experts", "4,1"], "argument --experts"),
    ("fsdp2_check.py", ["--steps", "abc"], "argument --steps"),
])
def test_script_argument_errors_come_first(script, argv, message):
    """Checked while parsing: before the GPU check (ab_1x32) and before the torchrun check (fsdp2_check)."""
    proc = run_python(f"scripts/{script}", *argv, pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
