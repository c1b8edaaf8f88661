"""Configuration of the byte-fingerprint kernel (no cutlass import: the ops and the on-disk cache key use it
without loading the DSL), and the two constants of the fingerprint's definition (:mod:`moe_quant.fingerprint`,
the reference and the entry point, reads them from here; this module is part of the kernel's disk-cache hash).

The kernel (``kernel.py``) reads a 16-byte aligned byte buffer in 16-byte vectors (two 64-bit words
each), adds up every word's term in 64-bit registers, reduces within the CTA and adds the CTA's sum to an
int64 output with one 64-bit atomic add.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The definition's constants (moe_quant.fingerprint), compiled into the kernel.
WORD_KEY = 0x9E3779B97F4A7C15  # round(2**64 / golden ratio), odd: word position -> 64-bit key
WORD_MIX = 0xFF51AFD7ED558CCD  # odd 64-bit multiplier of the word mix (a bijection of the 64-bit words)


def as_int64(v: int) -> int:
    """A 64-bit pattern as the two's-complement Python int an int64 holds (how the constants enter int64 math)."""
    return v - (1 << 64) if v >= 1 << 63 else v


VEC = 16  # bytes per load (one 16-byte vector: two 64-bit words)
THREADS = 256
ITERS = 4  # vectors per thread per grid-stride step, all loads issued before the first term
# The persistent grid: at most this many CTAs per SM (ops sizes it per device). ptxas keeps about two
# loads per thread in flight (32 registers, sm_90a and sm_100a), so it is occupancy that hides the latency:
# 8 CTAs of 256 threads fill an SM.
CTAS_PER_SM = 8
# One launch reads at most this many bytes (a multiple of 16: byte indices stay in int32); longer tensors take
# one launch per piece, each adding into the same output.
MAX_LAUNCH_BYTES = 1 << 30


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code of the fingerprint kernel (the cache key, with the arch)."""

    threads: int = THREADS
    iters: int = ITERS

    family = "fp"
    kernel_module = "fingerprint.kernel"  # compiled by compile_cache.compile_variant (never imported here)

    def __post_init__(self):
        if self.threads % 32 or not (64 <= self.threads <= 1024):
            raise ValueError(f"threads must be a multiple of 32 in [64, 1024], got {self.threads}")
        if not (1 <= self.iters <= 16):
            raise ValueError(f"iters must be in [1, 16], got {self.iters}")

    @property
    def key(self) -> str:
        return f"t{self.threads}i{self.iters}"

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


def all_variants() -> list[Variant]:
    return [Variant()]


# A/B candidates (benchmarks/bench_fingerprint.py --variants): name -> fields that differ from the default.
# Compile-checked for every arch (compile_check).
CANDIDATES = {
    "t256i4 (default)": {},
    "t256i8": {"iters": 8},
    "t512i4": {"threads": 512},
}


def candidate_variants() -> list[Variant]:
    return [Variant(**kw) for kw in CANDIDATES.values() if kw]
