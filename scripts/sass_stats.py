"""Static SASS of one kernel variant, compiled on the CPU (no GPU needed): instruction count and opcode mix.

    python scripts/sass_stats.py 'block.config:Variant("dswiglu", "bfloat16", "rceil", "bfloat16")' [--arch sm_90a]
        [--dump PATH] [--main-path]

The spec is ``module:expression``: a config module under ``moe_quant.kernels`` and the variant to build from it.
The variant is compiled with ``CUTE_DSL_KEEP=cubin`` and disassembled with ``nvdisasm`` (``$NVDISASM``, else
the one on PATH, else the copy triton ships). A kernel's code size is what its instruction cache must hold:
the block kernel's dswiglu stalled on "no instruction" at 8880 instructions (kernels/block/NOTES.md).

``--main-path`` (the 32x1 kernel, ``quantize_32x1.config:...``): the instructions from the first 16-byte load of the
tile (``LDG.E.128``) to the last store of data or scales (an ``STG`` whose source is not ``RZ``: the K-groups tail
zeroing left out), or to the first ``VOTE`` (``round_bf16``: its exception path left out), and that per element of
a thread's 8 x 8 tile (kernels/quantize_32x1/NOTES.md, 2026-12-03).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # the repository, when run from a checkout


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not found:
        try:
            import triton

            cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
            found = cand if os.path.exists(cand) else None
        except ImportError:
            pass
    if not found:
        raise SystemExit("nvdisasm not found: set NVDISASM, put it on PATH, or install triton")
    return found


def main_path(lines: list[str]) -> int:
    """The 32x1 kernel's main path in ``lines`` (one instruction each), as ``--main-path`` describes it."""
    start = next((i for i, b in enumerate(lines) if "LDG.E.128" in b), None)
    if start is None:
        raise SystemExit("--main-path: no 16-byte load (LDG.E.128) in the kernel")
    vote = next((i for i, b in enumerate(lines) if i > start and b.startswith("VOTE")), None)
    stores = [i for i, b in enumerate(lines) if i > start and "STG" in b and not b.endswith("RZ")]
    end = vote if vote is not None else stores[-1] if stores else None
    if end is None:
        raise SystemExit("--main-path: no store after the first 16-byte load")
    return end - start + 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help='e.g. \'block.config:Variant("swiglu", "bfloat16", "rceil", "bfloat16")\'')
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--dump", help="write the instructions, one per line, to this file")
    p.add_argument("--main-path", action="store_true", help="also count the 32x1 kernel's main path (see above)")
    args = p.parse_args(argv)
    if ":" not in args.spec:
        p.error(f"spec must be module:expression, got {args.spec!r}")
    os.environ["CUTE_DSL_ARCH"] = args.arch
    tmp = tempfile.mkdtemp()
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = tmp
    mod, expr = args.spec.split(":", 1)
    try:
        variant = eval(expr, vars(importlib.import_module("moe_quant.kernels." + mod)))  # noqa: S307 (a CLI spec)
    except (ImportError, NameError, SyntaxError, TypeError, ValueError) as e:
        p.error(f"spec {args.spec!r}: {type(e).__name__}: {e}")
    from moe_quant.kernels.compile_cache import compile_variant

    compile_variant(variant, tvm_ffi=False)
    cubins = glob.glob(os.path.join(tmp, "**", "*.cubin"), recursive=True)
    if not cubins:
        raise SystemExit(f"no cubin was written under {tmp}")
    text = subprocess.run([nvdisasm(), "-c", cubins[0]], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in text.splitlines():
        if line.strip().startswith("/*") and "*/" in line:
            body = line.split("*/", 1)[1].split(";")[0].strip()
            if body:
                lines.append(body)
    ops = collections.Counter((b.split()[1] if b.startswith("@") else b.split()[0]).split(".")[0] for b in lines)
    print(f"{variant} ({args.arch}): {len(lines)} SASS instructions")
    print(" ".join(f"{op}:{n}" for op, n in ops.most_common(30)))
    if args.main_path:
        n = main_path(lines)
        print(f"main path: {n} instructions, {n / 64:.2f} per element")
    if args.dump:
        with open(args.dump, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
