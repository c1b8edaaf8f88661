"""scripts/ab_commits.py on a CPU: the revisions it exports, its argument checks and its table (the timing itself
needs a GPU)."""

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_commits", ROOT / "scripts" / "ab_commits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _is_git_checkout() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


needs_git = pytest.mark.skipif(not _is_git_checkout(), reason="needs the repository's git history")


@needs_git
@pytest.mark.parametrize("rev", ["HEAD", "WORKTREE"])
def test_export_writes_the_revisions_moe_quant(ab, rev, tmp_path):
    ab.export(rev, tmp_path)
    assert (tmp_path / "moe_quant" / "__init__.py").is_file()
    assert (tmp_path / "moe_quant" / "kernels" / "permute" / "kernel.py").is_file()
    if rev == "HEAD":  # the committed file, byte for byte
        want = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:moe_quant/__init__.py"], capture_output=True,
                              check=True).stdout
        assert (tmp_path / "moe_quant" / "__init__.py").read_bytes() == want


def test_worktree_export_leaves_compiled_files_out(ab, tmp_path):
    root = tmp_path / "checkout"
    (root / "moe_quant" / "__pycache__").mkdir(parents=True)
    (root / "moe_quant" / "__init__.py").write_text("X = 1\n")
    (root / "moe_quant" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"stale")
    ab.export("WORKTREE", tmp_path / "out", root=root)
    assert (tmp_path / "out" / "moe_quant" / "__init__.py").read_text() == "X = 1\n"
    assert not (tmp_path / "out" / "moe_quant" / "__pycache__").exists()
    # a folder holding a moe_quant (a copy without git history) is a revision too
    assert ab.check_revision(str(root)) == str(root)
    ab.export(str(root), tmp_path / "out2")
    assert (tmp_path / "out2" / "moe_quant" / "__init__.py").read_text() == "X = 1\n"
    assert not (tmp_path / "out2" / "moe_quant" / "__pycache__").exists()


@needs_git
def test_bad_revision_is_named(ab, tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="no-such-rev"):
        ab.check_revision("no-such-rev")
    assert ab.check_revision("HEAD") == "HEAD"
    assert ab.check_revision("WORKTREE") == "WORKTREE"
    with pytest.raises(SystemExit, match="no-such-rev"):
        ab.export("no-such-rev", tmp_path)


def test_argument_checks(ab):
    assert ab.what_list("permute,block") == ["permute", "block"]
    for bad in ("", "permute,gemm", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="permute, block"):
            ab.what_list(bad)
    assert ab.positive("3") == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.positive(bad)


def test_table_medians_spreads_and_ratio(ab):
    rows = [{"key": "permute 8x32 blocked", "side": "old", "pct": p} for p in (80.0, 70.0, 90.0)]
    rows += [{"key": "permute 8x32 blocked", "side": "new", "pct": p} for p in (88.0, 84.0, 99.0)]
    rows += [{"key": "dual 8x32 fp8", "side": "old", "pct": 50.0}]
    text = ab.table(rows).splitlines()
    assert text[1].split() == ["permute", "8x32", "blocked", "80.0", "(70.0-90.0)", "88.0", "(84.0-99.0)", "1.100"]
    assert text[2].split() == ["dual", "8x32", "fp8", "50.0", "(50.0-50.0)", "-", "nan"]


def test_child_env_puts_the_tree_first_and_keeps_the_callers_path(ab, tmp_path):
    env = ab.child_env(tmp_path, {"PYTHONPATH": os.pathsep.join(["/site", "/site/dsl"]), "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), str(ab.ROOT), "/site", "/site/dsl"]
    assert env["HOME"] == "/h"
    assert ab.child_env(tmp_path, {})["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), str(ab.ROOT)]
