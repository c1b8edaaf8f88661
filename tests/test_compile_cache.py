"""CI without a GPU: the compile cache's build path (cross-compile, export to the disk cache) for one
variant of each kernel family, in a fresh process as a first GPU call would run it, and what the compiled functions'
TVM-FFI entries do that the launch path relies on; and the sources its disk cache hashes."""

import ast
import json

import pytest

from moe_quant.kernels import compile_cache as cc
from moe_quant.kernels import compile_check
from repo_subprocess import run_python

SCRIPT = """
import json, os, tempfile
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from moe_quant.kernels import compile_cache as cc, compile_check
first = {}
for v in compile_check.all_variants():
    first.setdefault(v.family, v)
kernels = {fam: cc.build(v, "sm_90a") for fam, v in first.items()}
built = {fam: k.source for fam, k in kernels.items()}
hashes = {fam: cc._src_hash(v) for fam, v in first.items()}
entry = {}  # what the TVM-FFI entry function of each family's kernel calls, of the symbols cc.launch relies on
ir_dir = tempfile.mkdtemp()
for fam, k in kernels.items():
    path = os.path.join(ir_dir, fam + ".ll")
    k.owner.export_to_c(path, function_name="mq_ir")
    text = open(path).read()
    body = text[text.index("@__tvm_ffi_mq_ir("):]
    body = body[:body.index("\\n}\\n")]
    entry[fam] = sorted(s for s in ("_cudaGetDevice", "_cudaSetDevice", "TVMFFIEnvGetStream") if "@" + s + "(" in body)
print(json.dumps({"built": built, "hashes": hashes, "files": sorted(os.listdir(os.environ["MOE_QUANT_CACHE_DIR"])),
                  "entry": entry}))
"""


def test_build_exports_every_family_to_the_disk_cache(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("MOE_QUANT_CACHE_DIR", str(tmp_path))
    r = run_python("-c", SCRIPT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["built"] and set(got["built"].values()) == {"compiled"}
    assert len(set(got["hashes"].values())) == len(got["hashes"])  # one source hash per family
    for fam, h in got["hashes"].items():
        assert any(f.startswith(f"{fam}-") and h in f and f.endswith(".o") for f in got["files"]), (fam, got["files"])
    # compile_cache.launch runs no device guard: each compiled function reads the current device, switches to its
    # first CUDA tensor's for the launch (and back), and launches on TVM-FFI's environment stream (torch's current
    # stream of that device)
    assert got["entry"] == {fam: ["TVMFFIEnvGetStream", "_cudaGetDevice", "_cudaSetDevice"] for fam in got["built"]}


def _moe_quant_imports(path) -> set:
    """The moe_quant modules (names relative to ``moe_quant``) that the module at ``path`` imports, at any
    depth of its body, read from its source."""
    root = cc._source_file("numerics").parent
    package = path.relative_to(root).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - node.level + 1] + tuple(node.module.split(".") if node.module else ())
        for alias in node.names:  # ``from .. import cute_utils``: the name may be a module itself
            mod = ".".join(base + (alias.name,))
            out.add(mod if cc._source_file(mod).is_file() else ".".join(base))
    return out


def test_disk_cache_hash_covers_every_module_a_kernel_reads():
    """A family's hash covers its kernel and config modules and every moe_quant module either imports (the
    constants and device code they read): editing one of them must not load a stale kernel from disk."""
    first = {}
    for v in compile_check.all_variants():
        first.setdefault(v.family, v)
    assert len(first) == 5, sorted(first)
    for fam, v in first.items():
        files = cc.sources(v)
        assert all(f.is_file() for f in files), (fam, files)
        kernel, config = files[:2]
        assert kernel == cc._source_file(f"kernels.{v.kernel_module}") and kernel.name == "kernel.py", (fam, kernel)
        assert config.name == "config.py" and config.parent == kernel.parent, (fam, config)
        for f in (kernel, config):
            for mod in _moe_quant_imports(f):
                assert cc._source_file(mod) in files, f"{fam}: {f.name} imports moe_quant.{mod}, not in {files}"
