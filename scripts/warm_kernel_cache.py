"""Precompile kernel variants for one GPU architecture into the on-disk kernel cache, on any machine (no GPU needed),
so that a GPU machine given the directory loads them instead of compiling (``moe_quant.kernels.compile_cache``:
an object file per variant, named by the variant, the architecture and a hash of the family's sources; a stale
file is never loaded; no shared library beside it, which would point at this machine's runtime libraries).

    CUTE_DSL_ARCH=sm_90a MOE_QUANT_CACHE_DIR=DIR python scripts/warm_kernel_cache.py sm_90a [--in-place] [--match W ...]
    # then on the GPU machine: MOE_QUANT_CACHE_DIR=DIR (a writable copy)

Without ``--in-place``: every variant the package launches and the A/B candidates (``compile_check.all_variants``,
what CI compile-checks). With it, also every variant the GPU tests and the sanitizer scripts put in place of a
default (each family's ``*_in_place`` for every candidate: a candidate in both scale modes and every output kind,
where ``all_variants`` lists the mode and outputs the A/B script times). Those are compiled when a test enters its
in-place context, each 1-20 s on the GPU machine's CPU (more with several test processes): the GPU suite's
candidate tests spend most of their time there without this cache.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moe_quant.kernels import compile_cache as cc  # noqa: E402
from moe_quant.kernels import compile_check  # noqa: E402


def in_place_variants() -> list:
    """Every variant an A/B candidate can be put in place as, through the families' own in-place entries (the
    calls the GPU tests and sanitizer scripts make), recorded instead of compiled."""
    from moe_quant.kernels.block import config as config_block
    from moe_quant.kernels.block import ops as ops_block
    from moe_quant.kernels.permute import config as config_permute
    from moe_quant.kernels.permute import ops as ops_permute
    from moe_quant.kernels.quantize_32x1 import config as config_32x1
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

    seen: list = []

    @contextlib.contextmanager
    def record(key, variant, device):
        if variant not in seen:
            seen.append(variant)
        yield

    cpu = torch.device("cpu")
    names = {name for op in config_block.OPS for name in config_block.candidates_any_output(op)}
    with mock.patch.object(cc, "in_place_of", record), contextlib.ExitStack() as stack:
        for name in sorted(names):
            ops_block.candidate_in_place(stack, name, cpu)
        for fields in config_32x1.CANDIDATES.values():
            for v in config_32x1.all_variants():
                if v.in_dtype == "bfloat16":
                    stack.enter_context(ops_32x1.variant_in_place(config_32x1.with_candidate(v, fields), cpu))
        for fields in config_permute.CANDIDATES.values():
            stack.enter_context(ops_permute.variants_in_place(cpu, **fields))
    return seen


def variants(in_place: bool) -> list:
    out = compile_check.all_variants()
    return out + [v for v in in_place_variants() if v not in out] if in_place else out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arch", help="e.g. sm_90a (set CUTE_DSL_ARCH to the same before running)")
    p.add_argument("--in-place", action="store_true", help="also the variants candidates are put in place as")
    p.add_argument("--match", nargs="+", default=[], metavar="W",
                   help="only the variants whose name (family/key, e.g. fp/...) contains every W")
    args = p.parse_args(argv)
    cc.LINK_SHARED = False  # object files only: the cache is for another machine (compile_cache.LINK_SHARED)
    todo = [v for v in variants(args.in_place) if all(w in compile_check.variant_name(v) for w in args.match)]
    print(f"{len(todo)} variants for {args.arch} into {cc.cache_dir()}", flush=True)
    t0, failed = time.time(), 0
    for v in todo:
        try:
            cc.build(v, args.arch)
        except Exception as e:  # noqa: BLE001 (report every variant that does not build, then fail)
            failed += 1
            print(f"FAIL {compile_check.variant_name(v)}: {e!r}"[:300], flush=True)
    print(f"{len(todo) - failed} built, {failed} failed in {time.time() - t0:.0f} s "
          f"(compiled {cc.STATS['compiled']}, already cached {cc.STATS['disk_hits']})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
