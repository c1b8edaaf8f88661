"""CI without a GPU: the compile cache's build path (cross-compile, export to the disk cache) for one
variant of each kernel family, in a fresh process as a first GPU call would run it."""

import json
import os
import sys

import pytest

pytest.importorskip("cutlass")

from repo_subprocess import run_python  # noqa: E402

SCRIPT = """
import json, os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from moe_quant.kernels import compile_cache as cc, compile_check
first = {}
for v in compile_check.all_variants():
    first.setdefault(v.family, v)
built = {fam: cc.build(v, "sm_90a").source for fam, v in first.items()}
hashes = {fam: cc._src_hash(v) for fam, v in first.items()}
print(json.dumps({"built": built, "hashes": hashes, "files": sorted(os.listdir(os.environ["MOE_QUANT_CACHE_DIR"]))}))
"""


def test_build_exports_every_family_to_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_QUANT_CACHE_DIR", str(tmp_path))
    r = run_python("-c", SCRIPT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["built"] and set(got["built"].values()) == {"compiled"}
    assert len(set(got["hashes"].values())) == len(got["hashes"])  # one source hash per family
    for fam, h in got["hashes"].items():
        assert any(f.startswith(f"{fam}-") and h in f and f.endswith(".o") for f in got["files"]), (fam, got["files"])
