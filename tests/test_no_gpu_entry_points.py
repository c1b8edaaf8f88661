"""Benchmarks and scripts on a machine without a GPU, run from the repository root as documented."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_subprocess import ROOT, run_python

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


def run(*args, **kwargs):
    """``python *args`` from the repository root, forked from the warm server (``repo_subprocess.run_python``'s
    ``warm``): the same command line, environment and ``sys.path``, without ~5 s of third-party imports each."""
    return run_python(*args, warm=True, **kwargs)


@no_gpu
@pytest.mark.parametrize("bench", ["bench_quantize", "bench_quantize_32x1", "bench_grouped_mm", "bench_moe", "bench_ep",
                                   "bench_ep_block", "bench_block", "bench_host", "bench_fingerprint",
                                   "bench_block_kernels"])
def test_benchmark_without_gpu_exits_2_with_one_line(bench):
    proc = run("-m", f"benchmarks.{bench}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stderr[-3000:]
    assert f"python -m benchmarks.{bench}" in lines[0]


@pytest.mark.parametrize("script", ["ab_1x32.py", "ab_kernels.py", "ab_commits.py"])
def test_ab_script_runs_from_repo_root_without_pythonpath(script):
    proc = run(f"scripts/{script}", "--help", pythonpath=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout


@no_gpu
def test_ab_kernels_names_a_candidate_no_family_has():
    """A candidate name none of the chosen families has is an argparse error naming it (it used to be dropped
    silently, and the run timed the default alone); the families' own names pass on to the GPU check."""
    proc = run("scripts/ab_kernels.py", "--family", "block-dual", "--candidates", "default,cw-smem-bf16,pre-t4",
               pythonpath=False)
    assert proc.returncode == 2 and "--candidates: 'pre-t4' is no candidate of --family block-dual" in proc.stderr, \
        proc.stderr[-3000:]
    proc = run("scripts/ab_kernels.py", "--family", "perm,block-swiglu-fp8", "--candidates", "counts first,pre-t4",
               pythonpath=False)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-3000:]


@no_gpu
@pytest.mark.parametrize("script", ["sanitize_1x32.py", "sanitize_32x1.py", "sanitize_block.py", "sanitize_fingerprint.py",
                                    "cache_timing.py", "ab_kernels.py", "fixed_cost_fit.py", "ab_commits.py",
                                    "ncu_block.py",
                                    "probes/gemm_dequant_probe.py", "probes/before_kernel_probe.py",
                                    "probes/row_copy_probe.py", "probes/topk_sum_probe.py",
                                    "probes/dual_cols_fp8_probe.py"])
def test_gpu_scripts_run_from_repo_root_and_say_they_need_a_gpu(script):
    proc = run(f"scripts/{script}", pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    name = Path(script).name
    assert proc.stderr.strip().splitlines() == [f"{name}: needs a CUDA GPU, and torch {torch.__version__} "
                                                "sees none (no GPU, or a CPU-only build)"], proc.stderr[-3000:]


@no_gpu
def test_profile_block_from_repo_root_says_it_needs_a_gpu():
    proc = run("scripts/profile_block.py", pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"profile_block.py: --device cuda: needs a CUDA GPU, and torch "
                                                f"{torch.__version__} sees none (no GPU, or a CPU-only build)"]


@no_gpu
def test_fsdp2_check_on_cuda_without_gpu_says_so():
    proc = run("scripts/fsdp2_check.py", "--device", "cuda", pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"fsdp2_check.py: needs a CUDA GPU, and torch {torch.__version__} "
                                                "sees none (no GPU, or a CPU-only build)"], proc.stderr[-3000:]


@no_gpu
def test_gpu_check_without_gpu_stops_with_one_line(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == "" and proc.stderr.strip().splitlines() == [
        f"gpu_check.sh: needs a CUDA GPU, and torch {torch.__version__} sees none (no GPU, or a CPU-only build)"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_plot_layer_time_on_a_missing_file_says_how_to_make_it(tmp_path):
    missing = tmp_path / "layer_sweep.json"
    proc = run("scripts/plot_layer_time.py", str(missing), pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"cannot read {missing}" in proc.stderr and "benchmarks.bench_grouped_mm" in proc.stderr


def test_plot_layer_time_on_a_non_json_file_says_so(tmp_path):
    bad = tmp_path / "layer.json"
    bad.write_text("not json")
    proc = run("scripts/plot_layer_time.py", str(bad), pythonpath=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "is not JSON" in proc.stderr


@no_gpu
@pytest.mark.parametrize("bench", ["bench_grouped_mm", "bench_moe"])
def test_benchmark_cuda_index_without_gpu_exits_2_with_one_line(bench):
    proc = run("-m", f"benchmarks.{bench}", "--device", "cuda:0")
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
    proc = run(f"scripts/{script}", *argv, pythonpath=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_sass_stats_counts_a_variants_instructions_on_a_cpu(tmp_path):
    """``scripts/sass_stats.py`` compiles one variant for sm_90a on the CPU and counts its SASS (the block kernel's
    code size is what NOTES.md measures); a bad spec is a usage error naming it."""
    dump = tmp_path / "sass.txt"
    proc = run_python("scripts/sass_stats.py", 'block.config:Variant("dual", "bfloat16", "rceil", "bfloat16")',
                      "--dump", str(dump), pythonpath=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count = int(proc.stdout.split("(sm_90a): ")[1].split()[0])
    assert count > 1000 and len(dump.read_text().splitlines()) == count, proc.stdout
    assert "FMUL:" in proc.stdout and "LDG" in dump.read_text()
    bad = run_python("scripts/sass_stats.py", 'block.config:Variant("nope", "bfloat16", "rceil")', pythonpath=False)
    assert bad.returncode == 2 and "ValueError: op must be one of" in bad.stderr, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr, bad.stderr[-3000:]


def test_sass_stats_main_path_spans_the_tile_loads_to_the_last_store():
    """``--main-path`` (the 32x1 kernel's per-element counts, kernels/quantize_32x1/NOTES.md): from the first 16-byte
    load to the last store of data or scales (a zeroing store of RZ is tail code), or to the first VOTE (the
    round_bf16 exception path after it is left out)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_stats", Path(ROOT) / "scripts" / "sass_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    body = ["S2R R0, SR_TID.X", "LDG.E R5, desc[UR4][R2.64]", "@!P1 LDG.E.128 R8, desc[UR4][R2.64]", "FMUL R1, R2, R3",
            "@P1 STG.E.64 desc[UR4][R6.64], R4", "LDS.128 R4, [R0]", "STG.E.128 desc[UR4][R2.64], R4", "EXIT"]
    assert mod.main_path(body + ["STG.E.128 desc[UR4][R2.64], RZ", "EXIT"]) == 5
    vote = body[:4] + ["VOTE.ANY R0, PT, P0", "@!P0 EXIT"] + body[4:]
    assert mod.main_path(vote) == 3
    with pytest.raises(SystemExit, match="no 16-byte load"):
        mod.main_path(["EXIT"])


def test_host_glue_script_times_the_kernel_path_on_a_cpu():
    proc = run("scripts/host_glue_cpu.py", "--calls", "3", "--rounds", "1", pythonpath=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("round 0: fwd+bwd ") and " us, bwd " in proc.stdout, proc.stdout


def test_host_glue_script_times_each_quantize_op_on_a_cpu():
    proc = run("scripts/host_glue_cpu.py", "--ops", "--calls", "3", "--rounds", "1", pythonpath=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"moe_quant from {ROOT}", proc.stdout
    assert [line.split(":")[0] for line in lines[1:]] == ["quantize_1x32 (M-groups)", "run_quantize_1x32 (autograd entry)",
                                                         "quantize_32x1_k_groups", "permute_mxfp8 (blocked)"]
    assert all(line.endswith(" us") for line in lines[1:]), proc.stdout


def test_gpu_torch_script_says_what_is_missing(tmp_path):
    """``scripts/gpu_torch.sh``: a bare call prints its usage (exit 2); ``keep`` copies a part into the stash;
    ``install`` with the stash incomplete names what is missing (exit 1) and installs nothing."""
    script = str(ROOT / "scripts" / "gpu_torch.sh")
    env = dict(os.environ, STASH=str(tmp_path / "stash"), TORCH_SITE=str(tmp_path / "site"))
    bare = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "usage: bash scripts/gpu_torch.sh stage" in bare.stderr, bare.stderr
    part = tmp_path / "t01"
    part.mkdir()
    (part / "part-00").write_bytes(b"x" * 10)
    keep = subprocess.run(["bash", script, "keep", str(part)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert keep.returncode == 0 and (tmp_path / "stash" / "part-00").read_bytes() == b"x" * 10, keep.stderr
    install = subprocess.run(["bash", "-c", f"source {script} install"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert install.returncode == 1 and "parts is missing" in install.stderr, install.stderr
    (tmp_path / "stash" / "parts").write_text("2\n")  # the list says 2 parts; 1 is kept
    install = subprocess.run(["bash", "-c", f"source {script} install"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert install.returncode == 1 and "1 of 2 parts" in install.stderr, install.stderr
    assert not (tmp_path / "site").exists()
