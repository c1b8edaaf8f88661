"""Configuration of the received-rows permutation kernel (no cutlass import: the ops' hot path and the
on-disk cache key use it without loading the DSL).

The kernel (``permute_mxfp8.py``) moves MXFP8 rows received by an all-to-all from (source rank, local
expert) order to expert-major order, writing one of three outputs (``moe_quant.ep.permute``):

* ``dequant`` -- the dequantized rows, ``bfloat16`` or ``float32`` (Hopper's emulated GEMM operand);
* ``blocked`` -- fp8 rows + the M-groups blocked scales of the experts (Blackwell's scaled GEMM operand);
* ``plain`` -- fp8 rows + row-major scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OUTS = ("dequant", "blocked", "plain")
DEQUANT_DTYPES = ("bfloat16", "float32")
CHUNK = 16  # fp8 bytes per lane per load (one 16-byte vector; half a 32-element block)
THREADS = 256
ITERS = 4  # chunks per thread: all loads of a CTA issued before the first store
# (source rank, expert) blocks the in-kernel table holds (shared memory: 3 int32 per block, 3 per expert);
# permute_received runs the reference beyond it.
MAX_BLOCKS = 1024


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code of the permutation kernel (the cache key, with the arch)."""

    out: str  # "dequant" | "blocked" | "plain"
    out_dtype: str = "float8_e4m3fn"  # dequant: "bfloat16" | "float32"

    family = "perm"
    kernel_module = "permute_mxfp8"  # compiled by compile_cache.compile_variant (never imported here)

    def __post_init__(self):
        if self.out not in OUTS:
            raise ValueError(f"out must be one of {OUTS}, got {self.out!r}")
        if self.out == "dequant":
            if self.out_dtype not in DEQUANT_DTYPES:
                raise ValueError(f"dequant out_dtype must be one of {DEQUANT_DTYPES}, got {self.out_dtype!r}")
        elif self.out_dtype != "float8_e4m3fn":
            raise ValueError(f"out_dtype of out={self.out!r} is float8_e4m3fn, got {self.out_dtype!r}")

    @property
    def key(self) -> str:
        return f"{self.out}-{self.out_dtype}-t{THREADS}i{ITERS}b{MAX_BLOCKS}"

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


def all_variants() -> list[Variant]:
    return [Variant("dequant", d) for d in DEQUANT_DTYPES] + [Variant("blocked"), Variant("plain")]
