"""``scripts/warm_kernel_cache.py``: which variants it precompiles (the in-place ones through the families' own
in-place entries, recorded, nothing compiled) and, where cutlass is installed, one run into a fresh cache dir and a
second run that finds it there."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_quant.kernels import compile_cache as cc
from moe_quant.kernels import compile_check
from moe_quant.kernels.block import config as config_block
from moe_quant.kernels.permute import config as config_permute
from moe_quant.kernels.permute import ops as ops_permute
from moe_quant.kernels.quantize_32x1 import config as config_32x1

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "warm_kernel_cache.py"


def _script():
    spec = importlib.util.spec_from_file_location("warm_kernel_cache_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_in_place_variants_cover_every_mode_and_output_a_candidate_is_put_in_place_as():
    warm = _script()
    before = dict(cc.STATS)
    extra = warm.in_place_variants()
    assert cc.STATS == before  # recorded, not compiled
    listed = compile_check.all_variants()
    assert warm.variants(False) == listed
    every = warm.variants(True)
    assert every[:len(listed)] == listed and len(every) == len(set(every)) and set(extra) <= set(every)
    # block: each candidate variant (rceil, as the A/B script times it) also in floor, as the GPU tests run it
    for v in config_block.candidate_variants():
        assert v.replace(mode="floor") in every, v
    # 32x1: a candidate in place of every bf16-input default, the fp32 output included
    for fields in (f for f in config_32x1.CANDIDATES.values() if f):
        for v in config_32x1.all_variants():
            if v.in_dtype == "bfloat16":
                assert config_32x1.with_candidate(v, fields) in every, (fields, v)
    # permute: a candidate for every output of the op
    for fields in config_permute.CANDIDATES.values():
        for out, name in ops_permute.OPS:
            assert config_permute.Variant(out, name, **fields) in every, (fields, out)
    assert len(every) > len(listed)


def test_a_run_fills_a_cache_the_next_run_finds(tmp_path):
    pytest.importorskip("cutlass")
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "MOE_QUANT_CACHE_DIR": str(tmp_path)}
    fp = [compile_check.variant_name(v) for v in compile_check.all_variants() if v.family == "fp"]
    assert fp
    words = fp[0].split("/")  # one variant: its family and its key
    cmd = [sys.executable, str(SCRIPT), "sm_90a", "--match", *words]
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 variants for sm_90a" in first.stdout and "(compiled 1, already cached 0)" in first.stdout, first.stdout
    assert any(p.suffix == ".o" for p in tmp_path.iterdir())
    # object files only (no shared library linked against this machine's runtime libraries)
    assert not any(p.suffix == ".so" for p in tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
    second = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "(compiled 0, already cached 1)" in second.stdout, second.stdout + second.stderr
