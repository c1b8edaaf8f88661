"""Configuration of the rowwise 1x32 kernel (no cutlass import: the ops' hot path and the on-disk
cache key use it without loading the DSL)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ...numerics import BLOCK_SIZE

KINDS = ("plain", "blocked", "mgroups", "fake")
IN_DTYPES = ("bfloat16", "float32")
FAKE_OUT_DTYPES = ("bfloat16", "float32")
MODES = ("rceil", "floor")
CHUNK = 8  # elements per lane per load (16 bytes of bf16)
LANES_PER_BLOCK = BLOCK_SIZE // CHUNK  # 4


@dataclass(frozen=True)
class TileConfig:
    """Launch shape. ``threads * iters`` chunks of 8 elements per CTA."""

    threads: int = 256
    iters: int = 4
    table: int = 256  # groups resolved per pass of the shared-memory group table
    # M-groups knob, chosen by an A/B on an H100 (scripts/ab_1x32.py, one process, ragged G=8; % of memcpy at
    # (8192,2048) / (32768,2048) / (32768,7168) / (131072,7168), 2026-11-22, before each lane of a quad took one
    # block's scale (NOTES.md)): prefetch on 82.2 / 87.3 / 90.8 / 92.1, off 84.8 / 92.2 / 95.0 / 96.0 (default)
    prefetch_offs: bool = False  # warp 0 loads offs[0:32] before its data loads (measured slower)

    def __post_init__(self):
        if self.threads % 32 or not (32 <= self.threads <= 1024):
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.table % 32 or self.table < 32:
            raise ValueError(f"table must be a positive multiple of 32, got {self.table}")

    @property
    def chunks_per_cta(self) -> int:
        return self.threads * self.iters

    @property
    def key(self) -> str:
        return f"t{self.threads}i{self.iters}g{self.table}{'p' if self.prefetch_offs else ''}"

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """``"256x4"`` optionally followed by ``:pf`` (A/B runs)."""
        head, *flags = text.split(":")
        th, it = (int(v) for v in head.split("x"))
        return cls(threads=th, iters=it, prefetch_offs="pf" in flags)


def _default_tile() -> TileConfig:
    env = os.environ.get("MOE_QUANT_TILE_1X32")
    return TileConfig.parse(env) if env else TileConfig()


DEFAULT_TILE = _default_tile()


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code (the compile-cache key, with the arch)."""

    in_dtype: str  # "bfloat16" | "float32"
    mode: str  # "rceil" | "floor"
    kind: str  # "plain" | "blocked" | "mgroups" | "fake"
    out_dtype: str = "float8_e4m3fn"  # fake: "bfloat16" | "float32"
    tile: TileConfig = DEFAULT_TILE
    # fp32 input quantized as its bf16 rounding (``x.to(torch.bfloat16)``, never written): fp32 master
    # weights without a cast kernel
    as_bf16: bool = False

    family = "q1x32"
    kernel_module = "quantize_1x32.kernel"  # compiled by compile_cache.compile_variant (never imported here)

    def __post_init__(self):
        if self.in_dtype not in IN_DTYPES:
            raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {self.in_dtype!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "fake":
            if self.out_dtype not in FAKE_OUT_DTYPES:
                raise ValueError(f"fake out_dtype must be one of {FAKE_OUT_DTYPES}, got {self.out_dtype!r}")
        elif self.out_dtype != "float8_e4m3fn":
            raise ValueError(f"out_dtype of kind {self.kind!r} is float8_e4m3fn, got {self.out_dtype!r}")
        if self.as_bf16 and self.in_dtype != "float32":
            raise ValueError(f"as_bf16 rounds a float32 input, got in_dtype {self.in_dtype!r}")

    @property
    def key(self) -> str:
        src = "float32asbf16" if self.as_bf16 else self.in_dtype
        return f"{src}-{self.mode}-{self.kind}-{self.out_dtype}-{self.tile.key}"

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


def all_variants(tile: TileConfig = DEFAULT_TILE) -> list[Variant]:
    out = []
    for in_dtype in IN_DTYPES:
        for mode in MODES:
            for kind in ("plain", "blocked", "mgroups"):
                out.append(Variant(in_dtype, mode, kind, tile=tile))
            for od in FAKE_OUT_DTYPES:
                out.append(Variant(in_dtype, mode, "fake", od, tile=tile))
    for mode in MODES:  # fp32 master weights along K: the emulated GEMM's operand, the scaled GEMM's two layouts
        for kind, od in (("fake", "bfloat16"), ("blocked", "float8_e4m3fn"), ("mgroups", "float8_e4m3fn")):
            out.append(Variant("float32", mode, kind, od, tile=tile, as_bf16=True))
    return out
