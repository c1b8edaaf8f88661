"""CuTe-DSL kernel: colwise (32x1) MXFP8 quantization of ``x (M, R)`` along dim 0, in token groups.

One source for SM90 (Hopper) and SM100 (Blackwell); plain 16-byte loads, no TMA. The two
group kinds and output kinds are described in :mod:`moe_quant.kernels.quantize_32x1.config`.

Work split. A CTA owns one tile of 128 tokens x 128 columns: tokens ``[128 k, 128 k + 128)`` of
one group (aligned to the group's start, so the tile's four 32-token blocks are exactly four
scale columns of that group), columns ``[128 y, 128 y + 128)``. Its scales are then one whole
512-byte tile of the blocked layout (128 scale rows x 4 scale columns), and every transposed
output row gets 128 consecutive tokens.

* CTA order (``raster``): the grid's x index walks ``raster`` column tiles of one token tile, then the next
  token tile (0: every column tile). 3D weights along N run 16 side by side (2-4 points faster on the H200 than
  every token tile of one column tile first, which K-groups keep: NOTES.md, 2026-11-29).
* (Default ``tile_cols`` = 128, 256 threads; with 64, 128 threads and half a scale tile per CTA.)
  Warp ``w`` takes block ``b = w // 2`` (tokens ``32 b ..``) and column half ``w % 2``; lane
  ``l`` takes 8 columns (``l // 4``) and 8 consecutive tokens (``8 (l % 4) ..``) of the block.
  Every warp load instruction reads 4 rows x 128 contiguous bytes; all 8 (16 for fp32) loads of a
  thread are issued before the first use.
* amax per column: integer max of magnitude bit patterns over the thread's 8 tokens, then two
  butterfly shuffles across the 4 lanes of the block. Scale, reciprocal and saturating cast are
  the exact recipes of :mod:`moe_quant.kernels.cute_utils` (one definition with ``numerics.py``).
* A thread's 8 tokens of one column are contiguous in the transposed output: one 8-byte (e4m3),
  16-byte (bf16) or 2x16-byte (fp32) store per column. The scale bytes are gathered in a shared-memory
  copy of the CTA's 512-byte scale tile and written as 16-byte rows by warp 0 (one-byte stores were
  partial-sector writes to L2: NOTES.md, 2026-11-28).
* Padding is fused: tokens past a group's end up to its 32-aligned end are quantized as zeros
  (they are never loaded), so their data bytes and scales come out 0 exactly as the reference's
  zero padding does (a NaN block stays NaN, padding included). Columns past R get scale 0.
* ``kgroups``: each CTA resolves its tile from the group table, built by warp 0 from the
  sanitized offsets (``clamp(offs, 0, M)`` and a running max, :func:`cute_utils.sanitized_group_ends`,
  as :func:`moe_quant.layouts.group_bounds`); chunk prefix sums map the CTA index to (group,
  chunk). CTAs past the last real chunk zero the tail of the data buffer (tokens past the last
  padded group end) and the scale bytes past the last group's tiles. CTA (0, 0) also writes the
  padded group ends ``poffs``. Whatever ``offs`` holds, every write stays inside the buffers.
* ``uniform``: tile ``(e, k)`` of expert e, no table.
* ``as_bf16`` (fp32 input): loaded values are rounded to bf16 first (as ``x.to(torch.bfloat16)``):
  fp32 master weights quantized as their bf16 values, no cast kernel.
* A/B candidates with fewer instructions per element, the same bytes (config fields, off in the defaults: NOTES.md,
  2026-12-03): ``lean`` (short scale and reciprocal, store address by one add per column), ``packed_amax`` (amax on
  the packed bf16x2 words), ``flat_scales`` (predicated scale-byte stores at constant offsets), ``round_bf16``
  (bf16 outputs rounded to the block's e4m3 grid on the packed words; the block kernel's colwise code, shared here).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...layouts import K_GROUP_ALIGN, TILE_BYTES, TILE_ROWS
from ...numerics import BLOCK_SIZE
from .. import cute_utils as cu
from .config import (  # noqa: F401  (re-exported: the kernel's config)
    COLS_PER_THREAD,
    HALF_COLS,
    TILE_TOKENS,
    TOKENS_PER_THREAD,
    Variant,
    all_variants,
)

_INFO = 8  # shared-memory words: start, size, padded start, chunk start, -, chunk total, padded total


class Quantize32x1Kernel:
    """Colwise 32x1 MXFP8 quantization in token groups; see the module docstring.

    Host entry ``__call__(x, out, scales, offs, poffs, stream)``:

    * ``kgroups``: ``x (M, R)``, ``out (R, Mp)`` with ``Mp = round_up(M, 32) + 32 G``, ``scales``
      uint8 ``(round_up(R, 128), ceil(M/32) + 4 G)`` (``None`` for fake outputs), ``offs`` int32
      ``(G,)``, ``poffs`` int32 ``(G,)`` (written: padded group ends).
    * ``uniform``: ``x (E*N, K)``, ``out (E, K, N)``, ``scales`` e8m0 ``(E, round_up(K, 128) *
      4 ceil(N/128))`` (or ``None``), ``offs`` and ``poffs`` ``None``.
    """

    def __init__(self, variant: Variant):
        self.v = variant
        self.rceil = variant.mode == "rceil"
        self.in_f32 = variant.in_dtype == "float32"
        self.as_bf16 = variant.as_bf16  # fp32 loads rounded to bf16 before the block math
        self.kgroups = variant.groups == "kgroups"
        self.fake = variant.fake
        self.fake_f32 = variant.out_dtype == "float32"
        self.tile_cols = variant.tile_cols
        self.threads = variant.threads
        self.halves = variant.tile_cols // HALF_COLS  # warps per 32-token block
        self.raster = variant.raster
        # fewer instructions per element, the same bytes (config; NOTES.md, 2026-12-03)
        self.lean = variant.lean
        self.packed_amax = variant.packed_amax
        self.flat = variant.flat_scales
        self.round = variant.round_bf16

    # ------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, scales, offs, poffs, stream):
        if cutlass.const_expr(scales is not None):
            scales = cute.recast_tensor(scales, cutlass.Uint8)  # e8m0 from the caller (no view), bytes here
        r = x.shape[1]
        # whole 128-row scale tiles: a 64-column grid covers each with two CTAs (pad rows get zero scales)
        ny = (r + (TILE_ROWS - 1)) // TILE_ROWS * (TILE_ROWS // self.tile_cols)
        nx = Int32(0)
        n_groups = Int32(0)
        row_stride = Int32(0)
        rp = Int32(0)
        sw = Int32(0)
        if cutlass.const_expr(self.kgroups):
            n_groups = Int32(offs.shape[0])
            row_stride = Int32(out.shape[1])  # Mp
            # real chunks + tail chunks <= (Mp + 127 G + 127) / 128; one more so a tail CTA always exists
            nx = (row_stride + (TILE_TOKENS - 1) * n_groups + (TILE_TOKENS - 1)) // TILE_TOKENS + 1
            if cutlass.const_expr(not self.fake):
                rp = Int32(scales.shape[0])
                sw = Int32(scales.shape[1])
        else:
            n_groups = Int32(out.shape[0])  # E
            row_stride = Int32(out.shape[2])  # N
            nx = n_groups * ((row_stride + (TILE_TOKENS - 1)) // TILE_TOKENS)
            rp = (Int32(r) + (TILE_ROWS - 1)) // TILE_ROWS * TILE_ROWS
        # CTA order (config.RASTER_CHOICES): grid x walks g column tiles of one token tile, then the next token tile
        g = self.raster
        grid = [nx * ny, 1, 1] if g == 0 else [nx * g, (ny + (g - 1)) // g, 1]
        self.kernel(x, out, scales, offs, poffs, Int32(x.shape[0]), Int32(r), n_groups, row_stride, rp, sw, nx,
                    Int32(ny)).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor, scales, offs, poffs, m: Int32, r: Int32, n_groups: Int32,
               row_stride: Int32, rp: Int32, sw: Int32, nx: Int32, ny: Int32):
        tid, _, _ = cute.arch.thread_idx()
        gx, gy, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.raster == 1):
            self.tile(x, out, scales, offs, poffs, m, r, n_groups, row_stride, rp, sw, nx, ny, Int32(tid),
                      Int32(gx), Int32(gy))
        elif cutlass.const_expr(self.raster == 0):
            self.tile(x, out, scales, offs, poffs, m, r, n_groups, row_stride, rp, sw, nx, ny, Int32(tid),
                      Int32(gx) // ny, Int32(gx) % ny)
        else:
            by = Int32(gy) * self.raster + Int32(gx) % self.raster
            if by < ny:  # the last raster group's missing column tiles
                self.tile(x, out, scales, offs, poffs, m, r, n_groups, row_stride, rp, sw, nx, ny, Int32(tid),
                          Int32(gx) // self.raster, by)

    @cute.jit
    def tile(self, x: cute.Tensor, out: cute.Tensor, scales, offs, poffs, m: Int32, r: Int32, n_groups: Int32,
             row_stride: Int32, rp: Int32, sw: Int32, nx: Int32, ny: Int32, tid: Int32, bx: Int32, by: Int32):
        """CTA ``(bx, by)``: token tile ``bx`` (of a group, or a tail tile), column tile ``by``."""
        ty = by * self.tile_cols // TILE_ROWS  # the 128-row scale tile of this CTA's columns
        row0 = by * self.tile_cols - ty * TILE_ROWS  # its first row there (0, or 64 for a 64-column grid)
        lane = tid % 32
        warp = tid // 32

        # ---- which tile: source rows, how many are real, where the output and scales go
        src0 = Int64(0)  # first source row of the tile
        n_real = Int32(0)  # real tokens in the tile (<= 0: none)
        n_out = Int32(0)  # tokens of the tile to write (real + zero padding; multiple of 32)
        out_base = Int64(0)  # output element of (column 0, token 0) of the tile
        scale_base = Int64(0)  # byte of the tile's 512-byte scale block
        tail = Int32(0)
        chunk_total = Int32(0)
        if cutlass.const_expr(self.kgroups):
            info = cute.make_tensor(cute.arch.alloc_smem(Int32, _INFO, alignment=16), cute.make_layout(_INFO))
            if warp == 0:
                self.scan_groups(offs, poffs, m, n_groups, lane, bx, by, info)
            cute.arch.sync_threads()
            chunk_total = Int32(info[5])
            if bx < chunk_total:
                start = Int32(info[0])
                size = Int32(info[1])
                k = bx - Int32(info[3])
                src0 = Int64(start) + Int64(k * TILE_TOKENS)
                n_real = size - k * TILE_TOKENS
                n_out = cutlass.min(cu.round_up_block(size) - k * TILE_TOKENS, Int32(TILE_TOKENS))
                out_base = Int64(info[2]) + Int64(k * TILE_TOKENS)
                tiles = (size + (TILE_TOKENS - 1)) // TILE_TOKENS
                scale_base = (Int64(info[3]) * Int64(4) * Int64(rp)
                              + Int64(TILE_BYTES) * Int64(tiles * ty + k))
            else:
                tail = Int32(1)
                first = Int32(info[6]) + (bx - chunk_total) * TILE_TOKENS
                n_out = cutlass.min(row_stride - first, Int32(TILE_TOKENS))
                out_base = Int64(first)
        else:
            nch = (row_stride + (TILE_TOKENS - 1)) // TILE_TOKENS
            e = bx // nch
            k = bx - e * nch
            src0 = Int64(e) * Int64(row_stride) + Int64(k * TILE_TOKENS)
            n_real = cutlass.min(row_stride - k * TILE_TOKENS, Int32(TILE_TOKENS))
            n_out = n_real
            out_base = Int64(e) * Int64(r) * Int64(row_stride) + Int64(k * TILE_TOKENS)
            scale_base = Int64(e) * Int64(rp) * Int64(4 * nch) + Int64(TILE_BYTES) * Int64(nch * ty + k)

        # ---- this thread's 8 columns and 8 tokens
        blk = warp // self.halves
        quad = lane % 4
        tile_col = (warp % self.halves) * HALF_COLS + (lane // 4) * COLS_PER_THREAD
        col0 = by * self.tile_cols + tile_col
        t0 = blk * BLOCK_SIZE + quad * TOKENS_PER_THREAD
        col_ok = col0 < r
        words = self.load_tile_words(x, src0, n_real, r, col0, col_ok, t0)
        vals = None if self.round else self.unpack_tile(words)  # fp32 bit patterns (round_bf16: the words only)

        # ---- per column: scale, quantize 8 tokens, store transposed
        write = col_ok & (blk * BLOCK_SIZE < n_out)
        # the CTA's scale bytes are gathered in shared memory and written as whole 16-byte rows of its scale tile
        # (one byte store per scale reached L2 as a partial sector: a quarter of the kernel's L2 sector writes)
        stile = cute.arch.alloc_smem(cutlass.Uint8, TILE_BYTES, alignment=16) if not self.fake else None
        col_ptr = None  # lean, round_bf16: column c's 8 tokens of the output, advanced by one add per column
        if cutlass.const_expr(self.lean or self.round):
            col_ptr = out.iterator + (out_base + Int64(col0) * Int64(row_stride) + Int64(t0))
        if cutlass.const_expr(self.round):
            self.round_tile(words, col_ptr, row_stride, write)
        else:
            self.quantize_tile(words, vals, out, stile, col_ptr, out_base, row_stride, row0, tile_col, col0, t0, blk,
                               quad, tail, write)

        if cutlass.const_expr(not self.fake):
            if tail == 0:
                self.store_scale_tile(scales.iterator, stile, scale_base, row0, tid)

        if cutlass.const_expr(self.kgroups and not self.fake):
            if tail != 0:
                self.zero_scale_tail(scales.iterator, chunk_total, rp, sw, (bx - chunk_total) * ny + by,
                                     (nx - chunk_total) * ny, tid)

    @cute.jit
    def quantize_tile(self, words, vals, out, stile, col_ptr, out_base: Int64, row_stride: Int32, row0: Int32,
                      tile_col: Int32, col0: Int32, t0: Int32, blk: Int32, quad: Int32, tail: Int32, write):
        """Per column of the thread's tile (``words`` as loaded, ``vals`` unpacked): the block's scale, its 8 tokens
        quantized (or dequantized) and stored transposed; e4m3 outputs' scale bytes into the shared tile ``stile``."""
        # packed_amax: per column pair the blocks' amax on the packed words, joined over the quad (both halves at once)
        col_amax = None
        if cutlass.const_expr(self.packed_amax):
            col_amax = [cu.quad_max_u16x2(cu.absmax_bf16x2([words[i][p] for i in range(TOKENS_PER_THREAD)]))
                        for p in range(COLS_PER_THREAD // 2)]
        # lean: the short scale and reciprocal; a NaN block's e4m3 words not selected where dequantize8 replaces them
        quant = dict(short=self.lean, nan_words=not (self.lean and self.fake))
        sc0 = None  # flat_scales: the thread's first scale byte in the tile; its 8 columns' bytes are 16 apart
        if cutlass.const_expr(self.flat):
            sc0 = stile + cu.tile_byte(row0 + tile_col, blk)  # (row0 + tile_col) % 32 + 7 < 32: no wrap
        for c in cutlass.range_constexpr(COLS_PER_THREAD):
            col = [vals[i][c] for i in range(TOKENS_PER_THREAD)]
            lanes, amax = cu.QUAD_LANES, None
            if cutlass.const_expr(self.packed_amax):
                lanes, amax = (), self.col_value(col_amax, c)
            q0, q1, s, is_nan = cu.quantize_block8(col, self.rceil, lanes, amax=amax, **quant)
            if cutlass.const_expr(self.lean):
                if write:
                    self.store_tokens(col_ptr, q0, q1, s, is_nan)
                col_ptr = col_ptr + Int64(row_stride)
            else:
                dst = out_base + Int64(col0 + c) * Int64(row_stride) + Int64(t0)
                if write:
                    self.store_tokens(out.iterator + dst, q0, q1, s, is_nan)
            if cutlass.const_expr(self.flat):
                if (tail == 0) & (quad == c // 2):
                    cu.st_global_u8(sc0 + 16 * c, s)
            elif cutlass.const_expr(not self.fake):
                if tail == 0:
                    # lane q of the block's quad holds columns 2q, 2q+1: rows row0 + tile_col + c of scale tile ty
                    if quad == c // 2:
                        rr = row0 + tile_col + c
                        cu.st_global_u8(stile + cu.tile_byte(rr, blk), s)

    @cute.jit
    def round_tile(self, words, col_ptr, row_stride: Int32, write):
        """``round_bf16`` (bf16 in and out): :meth:`round_columns`, then where any lane of the warp holds a block that
        :func:`cute_utils.grid_exception` flags, :meth:`round_column_exceptions` (its amaxes joined again)."""
        col_max = [cu.absmax_bf16x2([words[i][p] for i in range(TOKENS_PER_THREAD)])
                   for p in range(COLS_PER_THREAD // 2)]
        hi, lo = self.round_columns(words, col_max, col_ptr, row_stride, write, None, None)
        if cute.arch.vote_any_sync(cu.grid_any_exception(hi, lo)):
            col_amax = [cu.quad_max_u16x2(m, (1, 2)) for m in col_max]
            self.round_column_exceptions(words, col_amax, col_ptr, row_stride, write)

    @cute.jit
    def store_scale_tile(self, sp, stile, scale_base: Int64, row0: Int32, tid: Int32):
        """The CTA's scale bytes, gathered in ``stile`` (the tile's 512-byte layout), to the tile at byte
        ``scale_base`` of the scale buffer at ``sp``, after a barrier, by warp 0 (:meth:`write_scale_rows`)."""
        cute.arch.sync_threads()
        if tid < 32:
            self.write_scale_rows(sp, stile, scale_base, row0, tid)

    @cute.jit
    def write_scale_rows(self, sp, stile, scale_base: Int64, row0: Int32, lane: Int32):
        """Lane ``lane``'s 16-byte row of the gathered scale tile ``stile`` to the tile at byte ``scale_base`` of
        the buffer at ``sp`` (``tile_cols`` = 64: the 8 bytes of rows ``row0 ..`` in it)."""
        off = 16 * lane + 4 * (row0 // 32)
        if cutlass.const_expr(self.tile_cols == 128):
            a, b, c, d = cu.ld_global_v4(stile + off)
            cu.st_global_v4(sp + (scale_base + Int64(off)), a, b, c, d)
        else:
            a, b = cu.ld_global_v2(stile + off)
            cu.st_global_v2(sp + (scale_base + Int64(off)), a, b)

    @cute.jit
    def scan_groups(self, offs, poffs, m: Int32, n_groups: Int32, lane: Int32, bx: Int32, by: Int32, info):
        """Warp 0: walk the groups 32 at a time; the lane whose group owns chunk ``bx`` records it.

        Group g (sanitized end ``e``, start ``prev``, size ``sz``) has ``ceil(sz/128)`` chunks and
        ``round_up(sz, 32)`` padded tokens; their prefix sums place its chunks and padded tokens.
        """
        carry_end = Int32(0)
        carry_ch = Int32(0)
        carry_pad = Int32(0)
        for sub in cutlass.range(0, (n_groups + 31) // 32, 1):
            g = sub * 32 + lane
            raw = Int32(0)
            if g < n_groups:
                raw = Int32(offs[g])
            e, prev = cu.sanitized_group_ends(raw, m, lane, carry_end)
            sz = e - prev
            ch = (sz + (TILE_TOKENS - 1)) // TILE_TOKENS
            pad = cu.round_up_block(sz)
            ch_end = carry_ch + cu.warp_inclusive_sum(ch, lane)
            pad_end = carry_pad + cu.warp_inclusive_sum(pad, lane)
            if g < n_groups:
                if bx == 0:
                    if by == 0:
                        poffs[g] = pad_end
                if bx >= ch_end - ch:
                    if bx < ch_end:
                        info[0] = prev
                        info[1] = sz
                        info[2] = pad_end - pad
                        info[3] = ch_end - ch
            carry_end = cute.arch.shuffle_sync(e, offset=31)
            carry_ch = cute.arch.shuffle_sync(ch_end, offset=31)
            carry_pad = cute.arch.shuffle_sync(pad_end, offset=31)
        if lane == 0:
            info[5] = carry_ch
            info[6] = carry_pad

    @cute.jit
    def load_tile_words(self, x, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok, t0: Int32):
        """8 tokens x 8 columns as loaded (per token 4 bf16x2 words, or 8 fp32 words; zeros where the token or column
        is not real). Every load is issued before any value is used."""
        words = []
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
            ok = col_ok & (t0 + i < n_real)
            src = x.iterator + ((src0 + Int64(t0 + i)) * Int64(r) + Int64(col0))
            if cutlass.const_expr(self.in_f32):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = Int32(0)
                if ok:
                    a0, a1, a2, a3 = cu.ld_global_v4(src)
                    a4, a5, a6, a7 = cu.ld_global_v4(src + 4)
                words.append([a0, a1, a2, a3, a4, a5, a6, a7])
            else:
                a0 = a1 = a2 = a3 = Int32(0)
                if ok:
                    a0, a1, a2, a3 = cu.ld_global_v4(src)
                words.append([a0, a1, a2, a3])
        return words

    def unpack_tile(self, words):
        """:meth:`load_tile_words`' tile as 8 tokens x 8 columns of fp32 bit patterns (``as_bf16``: fp32 rounded to
        bf16 first)."""
        vals = []
        for i in range(TOKENS_PER_THREAD):
            if self.in_f32:
                vals.append(cu.f32_bits_as_bf16(words[i]) if self.as_bf16 else words[i])
            else:
                row = []
                for wd in words[i]:
                    lo, hi = cu.bf16x2_to_f32_bits(wd)
                    row += [lo, hi]
                vals.append(row)
        return vals

    @cute.jit
    def store_tokens(self, ptr, q0, q1, s, is_nan):
        """8 consecutive tokens of one output row at ``ptr``: e4m3 bytes, or their dequantized values."""
        if cutlass.const_expr(not self.fake):
            cu.st_global_v2(ptr, q0, q1)
        else:
            cu.st_global_words(ptr, cu.dequantize8(q0, q1, s, is_nan, self.fake_f32))

    def col_value(self, row_words, c: int):
        """Column ``c`` of one token's packed bf16x2 words as an fp32 bit pattern."""
        w = row_words[c // 2]
        return w << 16 if c % 2 == 0 else w & Int32(-65536)

    @cute.jit
    def round_columns(self, words, col_max, col_ptr, row_stride: Int32, write, hi, lo):
        """``round_bf16``, colwise: the thread's 8 columns of 8 tokens (``words``: per token 4 bf16x2 words) rounded
        to their blocks' e4m3 grids on the packed words (:data:`cute_utils._GRID`; ``col_max``: per column pair the
        thread's packed magnitude max, joined here over the block's 4 lanes) and stored as bf16 from ``col_ptr``
        (column 0's 8 tokens; a column is ``row_stride`` elements further) where ``write``. Returns the running
        :func:`cute_utils.grid_track` ``(hi, lo)`` continued from the given one (``None``: none yet)."""
        for p in cutlass.range_constexpr(COLS_PER_THREAD // 2):  # colwise: columns 2 p and 2 p + 1
            amax2 = cu.quad_max_u16x2(col_max[p], (1, 2))
            hi, lo = cu.grid_track(hi, lo, amax2)
            t2, sat2 = cu.grid_params(amax2, self.rceil)
            ys = [cu.grid_bf16x2(words[i][p], t2, sat2) for i in range(TOKENS_PER_THREAD)]
            for h in cutlass.range_constexpr(2):
                sel = 0x5410 if h == 0 else 0x7632
                if write:
                    cu.st_global_v4(col_ptr + Int64(h) * Int64(row_stride),
                                    *[cu.prmt(ys[2 * m], ys[2 * m + 1], sel) for m in range(TOKENS_PER_THREAD // 2)])
            col_ptr = col_ptr + Int64(2) * Int64(row_stride)
        return hi, lo

    @cute.jit
    def round_column_exceptions(self, words, col_amax, col_ptr, row_stride: Int32, write):
        """After :meth:`round_columns`: the columns whose block :func:`cute_utils.grid_exception` flags (``col_amax``:
        per column pair the blocks' joined amax), quantized and dequantized and stored over the rounded values."""
        quant = dict(short=self.lean, nan_words=False)  # dequantize8 replaces a NaN block's words
        for c in cutlass.range_constexpr(COLS_PER_THREAD):
            amax16 = (col_amax[c // 2] >> (16 * (c % 2))) & Int32(0xFFFF)
            if cu.grid_exception(amax16) & write:
                col = [self.col_value(words[i], c) for i in range(TOKENS_PER_THREAD)]
                q0, q1, s, is_nan = cu.quantize_block8(col, self.rceil, (), amax=amax16 << 16, **quant)
                self.store_tokens(col_ptr, q0, q1, s, is_nan)
            col_ptr = col_ptr + Int64(row_stride)

    @cute.jit
    def zero_scale_tail(self, sp, chunk_total: Int32, rp: Int32, sw: Int32, q: Int32, n_tail: Int32,
                        tid: Int32):
        """Zero the scale bytes past the last group's tiles, ``[4 Rp S_end, Rp W)`` of the buffer at ``sp``, 16
        bytes a store, shared by the ``n_tail`` tail CTAs (``q`` is this CTA's rank among them)."""
        start = Int64(chunk_total) * Int64(4) * Int64(rp)
        n16 = Int32((Int64(rp) * Int64(sw) - start) // 16)
        for w in cutlass.range(q * self.threads + tid, n16, n_tail * self.threads):
            cu.st_global_v4(sp + (start + Int64(w) * Int64(16)), 0, 0, 0, 0)


def make_fake_args(variant: Variant, tvm_ffi: bool):
    """Placeholder arguments for ``cute.compile``: dynamic M, R (R % 32 == 0), Mp, G, E, N."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int32(symbol="M")
    r = cute.sym_int32(divisibility=BLOCK_SIZE, symbol="R")
    x = make_fake_compact_tensor(cu.CUTLASS_DTYPES[variant.in_dtype], (m, r), stride_order=(1, 0), assumed_align=16)
    out_dtype = cu.CUTLASS_DTYPES[variant.out_dtype]
    scales = offs = poffs = None
    if variant.groups == "kgroups":
        mp = cute.sym_int32(divisibility=K_GROUP_ALIGN, symbol="Mp")
        out = make_fake_compact_tensor(out_dtype, (r, mp), stride_order=(1, 0), assumed_align=16)
        g = cute.sym_int32(symbol="G")
        offs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
        poffs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    else:
        e = cute.sym_int32(symbol="E")
        n = cute.sym_int32(divisibility=BLOCK_SIZE, symbol="N")
        out = make_fake_compact_tensor(out_dtype, (e, r, n), stride_order=(2, 1, 0), assumed_align=16)
    if not variant.fake:
        rows = cute.sym_int32(symbol="S_rows")
        cols = cute.sym_int32(symbol="S_cols")
        scales = make_fake_compact_tensor(cutlass.Float8E8M0FNU, (rows, cols), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else make_fake_stream()
    return x, out, scales, offs, poffs, stream


def compile_variant(variant: Variant, tvm_ffi: bool, extra_options: str = ""):
    """``cute.compile`` one variant for the arch in ``CUTE_DSL_ARCH`` (or the local GPU)."""
    kernel = Quantize32x1Kernel(variant)
    args = make_fake_args(variant, tvm_ffi)
    opts = " ".join(o for o in (("--enable-tvm-ffi" if tvm_ffi else ""), extra_options) if o)
    return cute.compile(kernel, *args, options=opts)
