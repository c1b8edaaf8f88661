"""Configuration of the received-rows permutation kernel (no cutlass import: the ops' hot path and the
on-disk cache key use it without loading the DSL).

The kernel (``kernel.py``) moves MXFP8 rows received by an all-to-all from (source rank, local
expert) order to expert-major order, writing one of three outputs (``moe_quant.ep.permute``):

* ``dequant`` -- the dequantized rows, ``bfloat16`` or ``float32`` (Hopper's emulated GEMM operand);
* ``blocked`` -- fp8 rows + the M-groups blocked scales of the experts (Blackwell's scaled GEMM operand);
* ``plain`` -- fp8 rows + row-major scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OUTS = ("dequant", "blocked", "plain")
# How a CTA's chunks are chosen (docs in kernel.py): "gather" -- consecutive destination chunks, each
# loaded from the source row the group table gives (the loads wait for the table); "scatter" -- consecutive
# source chunks, loaded first (no table needed), stored to the destination row the table gives (the table is
# built while the loads are in flight).
# "rows" -- scatter by rows: each warp loads one source row's segment of 32 x iters consecutive chunks (lane l: chunks
# l, l + 32, ...), so the row's destination (one table search) and its address math are done once per warp row
# segment instead of once per chunk.
ORDERS = ("gather", "scatter", "rows")
# The default order of each output, measured (H200, scripts/ab_kernels.py, CANDIDATES below): rows for the fp8
# outputs since 2026-11-28 (fewer instructions per chunk: the fp8 copy was issue-bound); for dequant rows with pair
# stores since 2026-12-03 (scatter before: rows alone wrote the bf16 rows slower, long-scoreboard stalls that the
# half-sector stores caused; with whole-sector stores rows is the faster order).
DEFAULT_ORDER = {"dequant": "rows", "blocked": "rows", "plain": "rows"}
# Where scatter holds its loaded chunks while the table is built: "registers" (16 bytes each), or "smem" (each
# thread's chunks copied by cp.async into shared memory, no register held: fewer registers, more CTAs per SM).
STAGINGS = ("registers", "smem")
DEQUANT_DTYPES = ("bfloat16", "float32")
CHUNK = 16  # fp8 bytes per lane per load (one 16-byte vector; half a 32-element block)
THREADS = 256  # default threads per CTA
ITERS = 4  # default chunks per thread: all loads of a CTA issued before the first store
# (source rank, expert) blocks the in-kernel table holds (shared memory: 3 int32 per block for gather, 2 for
# scatter; 3 per expert for blocked); permute_received runs the reference beyond it.
MAX_BLOCKS = 1024
# Shared memory a CTA may stage its chunks in (staging="smem"): with the table (20 KB) under the 48 KB of
# static shared memory.
MAX_STAGE_BYTES = 24 * 1024
# Row tiles a CTA may move (Variant.tiles): each tile's loads held next to the previous tile's until it is stored.
MAX_TILES = 8


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code of the permutation kernel (the cache key, with the arch)."""

    out: str  # "dequant" | "blocked" | "plain"
    out_dtype: str = "float8_e4m3fn"  # dequant: "bfloat16" | "float32"
    # Launch shape, A/B candidates (scripts/ab_kernels.py); the defaults are the measured ones.
    threads: int = THREADS
    iters: int = ITERS
    order: str = ""  # "": the measured default of the output, DEFAULT_ORDER[out]
    staging: str = "registers"  # "smem": scatter only
    # Tiles (the chunks of one CTA of tiles=1) per CTA, scatter and rows orders: the table built once for all, tile
    # j + 1's loads issued before tile j's stores (the grid `tiles` times smaller).
    tiles: int = 1
    # dequant: the lanes of a pair (the two halves of a 32-element block) swap half their loaded words, so that
    # every 16-byte store instruction of the warp writes whole 32-byte sectors (each lane's own 32 or 64 output bytes
    # take 2 or 4 stores at a 32 or 64-byte lane stride: half of each sector per instruction). None: on for dequant
    # (its default since 2026-12-03). The fp8 outputs store whole sectors already: off for them (normalized, so
    # that a candidate's fields fit every output).
    pair_stores: bool | None = None
    # Scatter and rows orders: warp 0 loads the counts of the first 64 (rank, expert) blocks before its data loads
    # (the table's first step otherwise waits for a count load issued behind the CTA's data loads), the later ones two
    # steps ahead.
    counts_first: bool = False

    family = "perm"
    kernel_module = "permute.kernel"  # compiled by compile_cache.compile_variant (never imported here)

    def __post_init__(self):
        if self.out not in OUTS:
            raise ValueError(f"out must be one of {OUTS}, got {self.out!r}")
        if not self.order:
            object.__setattr__(self, "order", DEFAULT_ORDER[self.out])
        if self.out != "dequant":
            object.__setattr__(self, "pair_stores", False)
        elif self.pair_stores is None:
            object.__setattr__(self, "pair_stores", True)
        if self.out == "dequant":
            if self.out_dtype not in DEQUANT_DTYPES:
                raise ValueError(f"dequant out_dtype must be one of {DEQUANT_DTYPES}, got {self.out_dtype!r}")
        elif self.out_dtype != "float8_e4m3fn":
            raise ValueError(f"out_dtype of out={self.out!r} is float8_e4m3fn, got {self.out_dtype!r}")
        if self.threads % 32 or not (64 <= self.threads <= 1024):
            raise ValueError(f"threads must be a multiple of 32 in [64, 1024], got {self.threads}")
        if not (1 <= self.iters <= 16):
            raise ValueError(f"iters must be in [1, 16], got {self.iters}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.staging not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {self.staging!r}")
        if self.staging != "registers" and self.order != "scatter":
            raise ValueError(f"staging={self.staging!r} is for order='scatter', got order={self.order!r}")
        if self.order == "rows" and self.iters > 8:
            raise ValueError(f"order='rows' loads iters chunks per lane before storing: iters <= 8, got {self.iters}")
        if not (1 <= self.tiles <= MAX_TILES):
            raise ValueError(f"tiles must be in [1, {MAX_TILES}], got {self.tiles}")
        if self.tiles > 1 and (self.order == "gather" or self.staging != "registers"):
            raise ValueError(f"tiles > 1 is for the scatter and rows orders with register staging, got "
                             f"order={self.order!r}, staging={self.staging!r}")
        if self.counts_first and self.order == "gather":
            raise ValueError("counts_first is for the scatter and rows orders (gather loads after the table)")
        if self.staging == "smem" and self.threads * self.iters * CHUNK > MAX_STAGE_BYTES:
            raise ValueError(f"staging='smem' holds threads * iters * {CHUNK} bytes, at most {MAX_STAGE_BYTES}: "
                             f"got threads={self.threads}, iters={self.iters}")

    @property
    def key(self) -> str:
        order = "" if self.order == "gather" else f"-{self.order}"  # gather keys as before the field
        if self.staging != "registers":
            order += f"-{self.staging}"
        if self.tiles > 1:
            order += f"-x{self.tiles}"
        if self.pair_stores:
            order += "-pairs"
        if self.counts_first:
            order += "-cfirst"
        return f"{self.out}-{self.out_dtype}-t{self.threads}i{self.iters}b{MAX_BLOCKS}{order}"

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


def all_variants() -> list[Variant]:
    return [Variant("dequant", d) for d in DEQUANT_DTYPES] + [Variant("blocked"), Variant("plain")]


# A/B candidates (scripts/ab_kernels.py): name -> fields that differ from the default. Compile-checked for
# every arch (compile_check) on the blocked and bf16 dequant outputs (CANDIDATE_OUTS). Measured and dropped (H100,
# 2026-11-24, blocked at (32768, 2048), % of memcpy; the default then, gather t256i4, 77.7): gather t256i8 54.5,
# gather t128i8 65.7, gather t256i4 on a persistent grid of 132x4 CTAs building the table once each 74.6. Scatter
# (each CTA owns consecutive input chunks: its loads need no table; the table is built and searched while they are
# in flight) measured on the H100
# (2026-11-26, `ab_kernels.py --family perm --rounds 5`, blocked, % of memcpy, median over rounds at 8192x2048 /
# 32768x2048 / 32768x7168 / 131072x7168): scatter registers 65.5 / 83.4 / 88.2 / 91.5 (the default since), scatter
# smem 66.5 / 82.1 / 87.9 / 91.3, gather 58.0 / 78.3 / 85.3 / 88.2. Fewer table builds per chunk, measured and
# dropped (H100, 2026-11-26, same script and shapes; the default in that run 64.4 / 81.8 / 86.8 / 90.0): scatter
# t256i8 62.6 / 81.4 / 86.6 / 89.8; scatter t512i4 59.1 / 78.1 / 85.9 / 89.6.
# Rows (H200, 2026-11-28, `ab_kernels.py --family perm,perm-dequant --rounds 5`, median (min-max) over rounds at
# the same shapes), blocked: scatter registers 55.0 (51.6-55.4) / 70.3 (70.1-70.4) / 77.5 (77.3-77.6) /
# 81.4 (81.3-81.5); rows t256i4 61.1 (56.9-61.5) / 78.1 (77.8-78.2) / 84.3 (84.2-84.4) / 89.3 (89.3-89.3), the
# default for fp8 outputs since (ncu at 32768x2048: 29.5M -> 18.4M instructions, 60.1 -> 43.0 us); rows t512i4
# 59.8 / 75.4 / 83.6 / 88.5, dropped. dequant (bf16): scatter registers 74.4 / 83.0 / 88.1 / 91.1, rows t256i4
# 60.9 / 71.9 / 78.2 / 80.9 (ncu: 28.8M -> 20.0M instructions, yet 62.3 -> 71.3 us with 3.0 long-scoreboard
# stalls per issue against 0.16), rows t512i4 57.3 / 63.9 / 67.3 / 68.9: dequant stays scatter.
# Rows on a persistent grid (H200, 2026-11-29, same script, 5 rounds): ncu of the rows default at 32768x2048
# blocked counted 6.9 of its 16 cycles per issued instruction stalled at a barrier (the per-CTA group table: warp 0
# builds it while the other warps wait, their loads in flight) and only 0.28 on loads (long scoreboard). A grid of 4
# or 5 CTAs per SM, each building the table once and then looping over row tiles bid, bid + grid, ... (load a
# tile, store it, next; no barrier after the first), measured against the default in the same rounds: blocked
# 61.6 / 79.1 / 85.3 / 89.7 (default) -> 4/SM 63.7 / 72.0 / 68.5 / 63.7, 5/SM 64.2 / 75.3 / 76.2 / 72.0; dequant
# (rows) 60.3 / 72.1 / 78.3 / 80.2 -> 58.8 / 63.4 / 65.8 / 66.4 and 56.4 / 63.1 / 64.8 / 65.5. Byte-exact (GPU
# tests with a grid smaller than the tiles, memcheck 0 errors) but slower from M = 32768: a warp with one tile
# in flight between its stores keeps fewer bytes in flight than fresh CTAs whose loads overlap the table build.
# Dropped (the code is in git history, commit 13bf2da).
# Two more rows candidates, the same day and script (5 rounds; the default in the same rounds 61.9 / 78.0 / 84.8 /
# 89.7 blocked): "bulk", each warp's row segment moved by two cp.async.bulk copies (global -> shared memory, counted
# by an mbarrier, then shared -> the destination row; the lanes moved only the scale bytes): 62.7 / 76.4 / 83.9 /
# 88.4, byte-exact, memcheck 0 errors, racecheck 0 hazards; ncu at 32768x2048: 19.8M instructions against 18.4M
# (lane 0's mbarrier wait spins), the same barrier stall (6.6 against 6.99 cycles per issue): the data path was
# never what cost, the per-CTA table and the scale bytes are. "rows t256i8" (8 chunks a lane): 58.3 / 71.7 /
# 84.0 / 88.7, 68 registers, 3 CTAs per SM. Both dropped (commit d3c5a9c).
# The group table (H200, 2026-11-29, ab_perm, 5 rounds, (8192, 2048) / (32768, 2048) / (32768, 7168) /
# (131072, 7168)): its passes within warp 0, one CTA barrier (was three), counts prefetched one step ahead, and the
# blocked rows scale offset once per row: blocked 61.1 / 78.7 / 84.7 / 89.7 -> 68.7 / 81.7 / 86.3 / 90.5, dequant
# 73.1 / 83.7 / 88.3 / 91.1 -> 71.9 / 85.0 / 90.3 / 92.6 (docs/lab/performance_log.md has the forms that did not land).
# "rows t256i4 scale words" (the same day, ab_kernels.py --family perm, 5 rounds, blocked): a segment's scale bytes
# moved 4 at a time, one 4-byte load and store per 4 blocks by the first 16 lanes (K % 128 == 0), instead of a byte
# per block by every other lane: 72.1 / 81.6 / 86.4 / 90.8 against the default's 72.4 / 81.7 / 86.3 / 90.6 in the
# same rounds. Byte-exact, memcheck 0 errors, racecheck 0 hazards; no gain: the scale stores were not what bounds
# the blocked rows either (the per-CTA table is). Dropped (commit 9e7c9c7).
# Since 2026-12-03 (H200, `ab_kernels.py --family perm-dequant,perm --rounds 3`, every candidate byte-exact; % of
# memcpy, median of 3 interleaved rounds at 8192x2048 / 32768x2048 / 32768x7168 / 131072x7168) the dequant output's
# default is rows with pair stores: dequant scatter (the default before) 72.4 / 84.8 / 90.3 / 92.8, scatter with pair
# stores 74.9 / 87.3 / 92.9 / 95.0, **rows with pair stores 83.2 / 90.3 / 93.8 / 95.6**; with counts first (then on
# scatter) 81.8 / 88.3 / 91.8 / 93.2, pair stores counts first 84.4 / 89.8 / 94.0 / 94.3; several tiles (scatter) 75.3 /
# 83.3 / 87.4 / 89.7 (x2), 75.7 / 83.4 / 87.6 / 90.0 (x4 i2), 79.3 / 86.3 / 89.8 / 91.7 (pair stores x4 i2). The blocked
# output in the same run: its default 69.7 / 83.4 / 86.4 / 90.5, counts first 69.9 / 83.5 / 86.3 / 90.3, x2 / x4 tiles
# 2-5 points slower. The candidates below are fields on top of each output's current default: those that name no
# order or pair stores (tiles, counts first) are rows with pair stores for dequant since that day, not yet timed so.
CANDIDATES = {
    # ptxas, sm_90a: rows 46 registers (blocked), rows pair stores 40 (dequant bf16)
    "default (rows; dequant with pair stores)": {},
    # 48 registers, 20 KB shared memory -> 5 CTAs per SM; dequant: its default until 2026-12-03 (58 registers)
    "scatter t256i4 registers": {"order": "scatter", "pair_stores": False},
    # the chunks staged in shared memory with cp.async: 40 registers, 36 KB -> 6 CTAs per SM
    "scatter t256i4 smem": {"order": "scatter", "staging": "smem", "pair_stores": False},
    # the default until 2026-11-25: 48 registers, 24 KB -> 5 CTAs per SM
    "gather t256i4": {"order": "gather", "pair_stores": False},
    # one warp per source row segment of 128 chunks: one table search and row address per 4 chunks a lane (blocked:
    # its default; dequant: rows with the half-sector stores, long-scoreboard stalls: slower than scatter)
    "rows t256i4": {"order": "rows", "pair_stores": False},
    # dequant: whole-sector stores in the scatter order (ncu at 32768x2048 of scatter without them: 16 of the 32
    # bytes of a stored sector used per store instruction, 4.87M sectors written to L2 for 4.19M); 53 registers
    "pair stores": {"order": "scatter", "pair_stores": True},
    # several tiles per CTA, tile j + 1's loads issued before tile j's stores: one table build (warp 0's scans, the
    # CTA barrier) per 2 tiles of 4 chunks a lane (blocked rows 70 registers: 3 CTAs per SM) or per 4 tiles of 2
    # chunks a lane (the same chunks a lane in flight as the default; blocked 58)
    "x2 tiles": {"tiles": 2},
    "x4 tiles i2": {"tiles": 4, "iters": 2},
    # warp 0's first counts loaded before the data loads (ncu at 32768x2048, blocked: 13.2 of the cycles per issued
    # instruction stalled at the table's CTA barrier, 1.2 on loads); blocked 48 registers
    "counts first": {"counts_first": True},
    "counts first x4 tiles i2": {"counts_first": True, "tiles": 4, "iters": 2},
}
# The outputs whose candidate variants are compile-checked: the A/B's two (scripts/ab_kernels.py perm, perm-dequant).
CANDIDATE_OUTS = (("blocked", "float8_e4m3fn"), ("dequant", "bfloat16"))


def candidate_variants() -> list[Variant]:
    """The candidates' variants of ``CANDIDATE_OUTS`` other than those outputs' defaults and each other (a candidate
    may name a default's own order, or fields that leave an output's code as it is: ``pair_stores``)."""
    defaults = [Variant(out, dtype) for out, dtype in CANDIDATE_OUTS]
    out = []
    for kw in CANDIDATES.values():
        for o, dtype in CANDIDATE_OUTS:
            v = Variant(o, dtype, **kw)
            if v not in defaults and v not in out:
                out.append(v)
    return out
