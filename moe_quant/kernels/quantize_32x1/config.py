"""Configuration of the colwise 32x1 kernel (no cutlass import: the ops' hot path and the on-disk
cache key use it without loading the DSL).

Two group kinds, one kernel (docs/design.md sections 3 and 4):

* ``kgroups`` -- a wgrad operand ``x (M, R)``: jagged token groups given by ``offs``, each padded
  with zeros to a multiple of 32 tokens; data written transposed ``(R, Mp)``, scales in the
  K-groups blocked layout, the padded group ends written to ``poffs``.
* ``uniform`` -- an expert weight ``W (E, N, K)`` quantized along N, seen as ``x (E*N, K)`` with E
  equal groups of N rows: data written transposed ``(E, K, N)``, scales ``(E, blocked K x N/32)``.

Output kinds: ``float8_e4m3fn`` (MXFP8 data + e8m0 scales) or the dequantized values in one pass
(``bfloat16`` / ``float32``, "fake quantization", for the emulated GEMM), in the same transposed layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GROUPS = ("kgroups", "uniform")
IN_DTYPES = ("bfloat16", "float32")
OUT_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")
MODES = ("rceil", "floor")

TILE_TOKENS = 128  # tokens of one CTA tile: four 32-token blocks, one 512-byte scale tile
TILE_COLS = 128  # default columns of x (rows of the transposed output / of the scale matrix) per CTA
COLS_PER_THREAD = 8  # one 16-byte bf16 load per token row
TOKENS_PER_THREAD = 8  # consecutive tokens of one column: one 8/16/32-byte transposed store
HALF_COLS = 64  # columns of one warp: 8 lanes x 8 columns (each block of 32 tokens is 4 lanes deep)
TILE_COLS_CHOICES = (64, 128)
# CTA order, column tiles per raster group: 1, every token tile of column tile 0, then of column tile 1, ...;
# g > 1, g column tiles side by side, then the next token tile; 0, every column tile of token tile 0 first.
RASTER_CHOICES = (0, 1, 4, 16, 32)  # each compile-checked in CI (the defaults and CANDIDATES)
# The default per group kind, measured (H200, 2026-11-29, scripts/ab_kernels.py --family q32x1,q32x1-3d, NOTES.md):
# 3D weights along N gain 2-4 points with 16 column tiles side by side; K-groups lose 2-5 points with it.
DEFAULT_RASTER = {"kgroups": 1, "uniform": 16}


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code of the 32x1 kernel (the compile-cache key, with the arch)."""

    in_dtype: str  # "bfloat16" | "float32"
    mode: str  # "rceil" | "floor"
    groups: str  # "kgroups" | "uniform"
    out_dtype: str = "float8_e4m3fn"  # or "bfloat16" | "float32": dequantized values, no scales
    # Columns per CTA (64: half a scale tile, 128 threads; 128: one whole tile, 256 threads). Every CTA
    # loads 128 tokens; a 64-column grid has two CTAs per 128-row scale tile, so rows past R still get
    # their zero scales. An A/B candidate (scripts/ab_kernels.py); the default is the measured one.
    tile_cols: int = TILE_COLS
    # fp32 input quantized as its bf16 rounding (``x.to(torch.bfloat16)``, never written): fp32 master
    # weights without a cast kernel
    as_bf16: bool = False
    # CTA order (RASTER_CHOICES; -1: the measured default of the group kind, DEFAULT_RASTER). Changes which bytes
    # the CTAs resident at once read and write together, not the work of any CTA.
    raster: int = -1
    # Fewer instructions per element, the same bytes (NOTES.md, 2026-12-03; the block kernel's fields of these names,
    # kernels/block/NOTES.md 2026-12-02 / 2026-12-03). None: each where it applies for bf16-input K-groups (the wgrad
    # operands; "lean-all", the default since the H200 A/B of 2026-12-03), off elsewhere (3D weights and fp32 inputs:
    # not measured). False: the code before.
    # lean: each block's scale in 7 instructions instead of 17 and its reciprocal in one
    # (cute_utils.e8m0_from_amax_bits_short), no NaN select of the e4m3 words that dequantized outputs replace anyway,
    # the transposed store address advanced by one add per column
    lean: bool | None = None
    # bf16 input: each column pair's amax on the packed bf16x2 words (max.u16x2), joined over the block's 4 lanes by
    # 2 shuffles per pair instead of 2 per column (not with round_bf16, which takes its amax that way itself)
    packed_amax: bool | None = None
    # e4m3 outputs: each scale byte by one store predicated on the lane that owns it, at a constant offset from the
    # thread's first byte of the shared scale tile (its 8 columns' bytes lie 16 bytes apart), instead of a branch
    # around its address arithmetic per column
    flat_scales: bool | None = None
    # bf16 input and output: each element rounded to its block's e4m3 grid on the packed words (cute_utils._GRID: 5
    # instructions per word, 7 in floor mode) instead of quantized and dequantized; a warp holding a block with a
    # non-finite, huge or tiny amax quantizes and dequantizes those blocks as before
    round_bf16: bool | None = None

    family = "q32x1"
    kernel_module = "quantize_32x1.kernel"  # compiled by compile_cache.compile_variant (never imported here)

    def __post_init__(self):
        for name, allowed in (("in_dtype", IN_DTYPES), ("mode", MODES), ("groups", GROUPS), ("out_dtype", OUT_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.tile_cols not in TILE_COLS_CHOICES:
            raise ValueError(f"tile_cols must be one of {TILE_COLS_CHOICES}, got {self.tile_cols!r}")
        if self.raster == -1:  # groups is valid (checked above): DEFAULT_RASTER has it
            object.__setattr__(self, "raster", DEFAULT_RASTER[self.groups])
        if self.raster not in RASTER_CHOICES:
            raise ValueError(f"raster must be one of {RASTER_CHOICES}, got {self.raster!r}")
        if self.as_bf16 and self.in_dtype != "float32":
            raise ValueError(f"as_bf16 rounds a float32 input, got in_dtype {self.in_dtype!r}")
        on = self.in_dtype == "bfloat16" and self.groups == "kgroups"  # the per-element fields' default
        for name in _RESOLVE_ORDER:
            if getattr(self, name) is None:
                object.__setattr__(self, name, on and applies(name, self))
        for name in ("packed_amax", "flat_scales", "round_bf16"):
            if getattr(self, name) and not applies(name, self):
                raise ValueError(f"{name} needs {_NEEDS[name]}, got in_dtype {self.in_dtype!r}, out_dtype "
                                 f"{self.out_dtype!r}, round_bf16={self.round_bf16}")

    @property
    def threads(self) -> int:
        """4 warps (one per 32-token block) per 64 columns."""
        return 4 * 32 * (self.tile_cols // HALF_COLS)

    @property
    def fake(self) -> bool:
        return self.out_dtype != "float8_e4m3fn"

    @property
    def key(self) -> str:
        tile = "" if self.tile_cols == TILE_COLS else f"-c{self.tile_cols}"  # the default's key is unchanged
        tile += "" if self.raster == 1 else f"-g{self.raster}"  # K-groups' default keeps its key
        src = "float32asbf16" if self.as_bf16 else self.in_dtype
        cuts = "".join(f"-{tag}" for name, tag in _TAGS.items() if getattr(self, name))  # "" in the defaults
        return f"{src}-{self.mode}-{self.groups}-{self.out_dtype}{tile}{cuts}"

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


ELEMENT_FIELDS = ("lean", "packed_amax", "flat_scales", "round_bf16")  # the per-element fields (2026-12-03)
_RESOLVE_ORDER = ("round_bf16", "lean", "packed_amax", "flat_scales")  # round_bf16 first: packed_amax reads it
_TAGS = dict(zip(ELEMENT_FIELDS, ("lean", "pamax", "flat", "round")))  # their key suffixes
_NEEDS = {"packed_amax": "a bfloat16 input and no round_bf16", "flat_scales": "float8_e4m3fn outputs",
          "round_bf16": "a bfloat16 input and bfloat16 outputs"}


def applies(name: str, v: Variant) -> bool:
    """Whether the per-element field ``name`` (lean, packed_amax, flat_scales, round_bf16) changes ``v``'s code."""
    bf16_in = v.in_dtype == "bfloat16"
    return {"lean": True, "packed_amax": bf16_in and not v.round_bf16, "flat_scales": not v.fake,
            "round_bf16": bf16_in and v.out_dtype == "bfloat16"}[name]


def with_candidate(v: Variant, fields: dict) -> Variant:
    """``v`` with a candidate's ``fields`` (``CANDIDATES[name]``), those of the per-element fields that do not apply to
    it left out (round_bf16 first: packed_amax does not apply where it holds), so that one candidate name can be put
    in place of every variant (scripts/ab_kernels.py, the GPU tests, scripts/sanitize_32x1.py)."""
    v = v.replace(**{k: x for k, x in fields.items() if k not in _TAGS})
    for name in _RESOLVE_ORDER:
        if name in fields and (not fields[name] or applies(name, v)):
            v = v.replace(**{name: fields[name]})
    return v


def all_variants() -> list[Variant]:
    return ([Variant(i, m, g, o) for i in IN_DTYPES for m in MODES for g in GROUPS for o in OUT_DTYPES]
            # fp32 master weights along N: the emulated GEMM's operand and the scaled GEMM's
            + [Variant("float32", m, "uniform", o, as_bf16=True) for m in MODES for o in ("bfloat16", "float8_e4m3fn")])


# A/B candidates (scripts/ab_kernels.py): name -> fields that differ from the default. Compile-checked for
# every arch (compile_check) on the operand the targets measure: bf16 in, rceil, both group kinds, e4m3 out.
# The register caps of 2026-11-26 (H100, ``min_blocks_per_mp`` for 5, 6 and 8 CTAs per SM) were never really
# measured: ab_kernels.py's swap missed the op then (NOTES.md, 2026-11-29). 5 CTAs, measured on an H200 the evening
# of 2026-11-29 (a local candidate, 12 bytes of spills in the K-groups fp8 variant): 1-3 points slower; not kept. Measured on the H200 (2026-11-29): c64
# slower from M = 32768; raster 16 for 3D along N (the default since), 1 for K-groups; g32 and g0 faster at N = 2048
# and slower at 8x8192x5120.
# The per-element fields (2026-12-03, not yet measured; NOTES.md): each alone, lean with the packed amax, and every
# field where it applies ("lean-all": lean, pamax and flat with e4m3 outputs, lean and round with bf16 outputs). A
# candidate is put in place by with_candidate (a field that does not apply to a variant is left out: "flat" with bf16
# outputs and "round" with e4m3 outputs are the defaults there).
# "pre-lean": the per-element fields off (the K-groups default before 2026-12-03 evening; the 3D default still).
# Measured on one H200 (2026-12-03, `ab_kernels.py --family q32x1,q32x1-bf16 --candidates
# default,lean,pamax,flat,round,lean-pamax,lean-all --rounds 3`, the fields off in the default then; % of memcpy at
# 8192x2048 / 32768x2048 / 32768x7168 / 131072x2048, median of 3 interleaved rounds, byte-exact): fp8 out 69.6 / 88.0 /
# 94.9 / 95.4 -> 73.8 / 89.4 / 95.2 / 95.7 (lean-all); bf16 out 86.0 / 91.7 / 93.4 / 92.6 -> 90.2 / 93.4 / 93.3 / 92.5.
CANDIDATES = {"default": {}, "pre-lean": dict.fromkeys(ELEMENT_FIELDS, False),
              "c64": {"tile_cols": 64}, "g1": {"raster": 1}, "g4": {"raster": 4},
              "g16": {"raster": 16}, "g32": {"raster": 32}, "g-all": {"raster": 0},
              "lean": {"lean": True}, "pamax": {"packed_amax": True}, "flat": {"flat_scales": True},
              "round": {"round_bf16": True}, "lean-pamax": {"lean": True, "packed_amax": True},
              "lean-all": {"lean": True, "packed_amax": True, "flat_scales": True, "round_bf16": True}}


def candidate_variants() -> list[Variant]:
    """The candidates' variants other than the defaults (a candidate may name a group kind's own default): bf16 in,
    rceil, e4m3 out, and those with per-element fields also bf16 out (the two A/B families, q32x1 and q32x1-bf16)."""
    out = []
    for kw in (kw for kw in CANDIDATES.values() if kw):
        for o in ("float8_e4m3fn", "bfloat16") if set(kw) & set(ELEMENT_FIELDS) else ("float8_e4m3fn",):
            for g in GROUPS:
                default = Variant("bfloat16", "rceil", g, o)
                if (v := with_candidate(default, kw)) != default and v not in out:
                    out.append(v)
    return out
