"""Static SASS of one kernel variant, compiled on the CPU (no GPU needed): instruction count and opcode mix.

    python scripts/sass_stats.py 'block.config:Variant("dswiglu", "bfloat16", "rceil", "bfloat16")' [--arch sm_90a]
        [--dump PATH]

The spec is ``module:expression``: a config module under ``moe_quant.kernels`` and the variant to build from it.
The variant is compiled with ``CUTE_DSL_KEEP=cubin`` and disassembled with ``nvdisasm`` (``$NVDISASM``, else
the one on PATH, else the copy triton ships). A kernel's code size is what its instruction cache must hold:
the block kernel's dswiglu stalled on "no instruction" at 8880 instructions (kernels/block/NOTES.md).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help='e.g. \'block.config:Variant("swiglu", "bfloat16", "rceil", "bfloat16")\'')
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--dump", help="write the instructions, one per line, to this file")
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
    if args.dump:
        with open(args.dump, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
