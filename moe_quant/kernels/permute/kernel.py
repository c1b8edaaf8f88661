"""CuTe-DSL kernel: received MXFP8 rows, (source rank, local expert) order -> expert-major order.

One source for SM90 (Hopper) and SM100 (Blackwell); the semantics are
:func:`moe_quant.ep.permute.reference_permute_received` (the kernel is tested byte-exact against it).

* Group table, in every CTA, by warp 0 with warp scans into shared memory (no host read, no second
  launch): counts clamped to ``[0, M]`` and summed r-major with a saturating add (the running total
  clamped to M, no int32 overflow whatever the counts), giving each (r, e) block's source end (a block
  starts where the previous one ends); then an expert-major scan giving each block's destination end and
  row shift ``src - dst``; for ``blocked``, the experts' padded starts ``P_e``
  (:func:`cute_utils.m_groups_table_step`, the same definition as ``layouts.group_bounds``). One CTA
  writes ``offs``. Warp 0 builds it alone: the first pass hands over to the second through ``bar.warp.sync``
  (the blocked pass sums its experts' ends from the first pass's table, so needs no second handover: two
  ``bar.warp.sync`` made ptxas spill 8 bytes in the blocked rows variant, and a named barrier of warp 0's 32
  threads there drew racecheck hazard reports); the other warps wait at one CTA barrier at the end. The
  counts are loaded one step of 32 blocks ahead of the scan.
* Data: the input and the output are flat arrays of 16-byte fp8 chunks (half a 32-element block); a CTA
  owns ``iters * threads`` consecutive chunks, ``iters`` per thread, all loaded before the first store.
  Three orders (``Variant.order``; the default per output in ``config.DEFAULT_ORDER``):

  - ``gather``: consecutive *destination* chunks. The CTA builds the table, binary-searches each chunk's
    destination row in it (source row = row + shift), then loads: every load waits for the table.
  - ``scatter``: consecutive *source* chunks. The source side needs no table (the input's own order:
    chunk ``c`` is bytes ``16 c`` and scale byte ``c / 2``), so the CTA issues its loads first and builds
    the table while they are in flight; then it searches each source row's block (all chunks at once,
    :func:`cute_utils.upper_bounds`) and stores at row - shift. Source rows ``< T`` map one to one onto
    output rows ``< T``, rows ``>= T`` onto themselves (zeroed): every output chunk is written once.
    The loaded chunks wait in registers (``staging="registers"``) or, copied by ``cp.async``, in shared
    memory (``"smem"``: no register held, so fewer registers and more CTAs per SM).

  - ``rows``: scatter by source rows. Warp ``w`` of CTA ``b`` takes source row ``(b // S) * warps + w``,
    segment ``b % S`` of its ``S`` segments of ``32 * iters`` chunks (lane ``l``: chunks ``l, l + 32, ...`` of
    the segment: each load a warp's 512 consecutive bytes). As scatter, the loads go first and the table is
    built while they are in flight; then one search per warp row (not per chunk) gives the destination row,
    and the row's addresses are computed once for its ``iters`` chunks.

  Output rows past the total ``T`` are zero.

  Scatter and rows with ``tiles > 1`` (A/B candidates): a CTA moves ``tiles`` consecutive tiles (a tile: the chunks of
  a CTA of ``tiles = 1``) after one table build, issuing tile ``j + 1``'s loads before tile ``j``'s stores; a tile
  past the end loads in range and stores nothing, as such a CTA would.
* ``dequant`` writes ``fp32(q) * 2**(s-127)`` rounded to bf16 (or fp32), canonical NaN (the NaN handling runs
  only for a chunk with a NaN byte or a NaN scale: a finite byte under a finite scale gives no NaN); with
  ``pair_stores`` the two lanes of a 32-element block swap half their words first, so that each 16-byte store
  instruction writes whole sectors (:meth:`PermuteMxfp8Kernel.pair_words`). ``plain`` the fp8 chunk and its scale
  byte; ``blocked`` the fp8 chunk and the scale at its M-groups blocked byte, the row's last scale also zeroing the
  pad columns, and extra CTAs (one per 128-row tile of the scale buffer; gather: at the front of the grid,
  scatter: after the data CTAs) zero every other byte that holds no real scale, as the 1x32 kernel does.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...layouts import TILE_BYTES, TILE_COLS, TILE_ROWS
from ...numerics import BLOCK_SIZE, E8M0_NAN
from .. import cute_utils as cu
from .config import CHUNK, MAX_BLOCKS, Variant, all_variants  # noqa: F401

CHUNKS_PER_BLOCK = BLOCK_SIZE // CHUNK  # 2
CHUNK_WORDS = CHUNK // 4  # int32 words per chunk


class PermuteMxfp8Kernel:
    """Host entry ``__call__(data, scales, counts, out, out_scales, offs, stream)``: ``data (M, K)`` e4m3 and
    ``scales (M, K/32)`` e8m0 (read as bytes); ``counts (R, E)`` int32; ``out (M, K)`` (bf16/fp32 for dequant,
    else e4m3); ``out_scales`` e8m0 (``None`` for dequant): ``(M, K/32)`` plain or ``(M + 128 E, 4 ceil(K/128))``
    blocked; ``offs (E,)`` int32. Needs ``R * E <= MAX_BLOCKS`` and ``E <= MAX_BLOCKS``, and ``M K > 0``
    (the op launches nothing otherwise)."""

    def __init__(self, variant: Variant):
        self.v = variant
        self.out = variant.out
        self.f32 = variant.out_dtype == "float32"
        self.blocked = variant.out == "blocked"
        self.threads = variant.threads
        self.iters = variant.iters
        self.rows = variant.order == "rows"
        self.scatter = variant.order in ("scatter", "rows")  # loads before the table, searched by source row
        self.smem_staging = variant.staging == "smem"
        self.tiles = variant.tiles
        self.pairs = variant.pair_stores
        self.counts_first = variant.counts_first
        # Scatter builds the table while its loads are in flight: its scans are not unrolled (fewer registers
        # live next to the loaded chunks; their latency hides behind the loads). Gather keeps the compiler's.
        self.table_unroll = 1 if self.scatter else 0

    # ------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, data: cute.Tensor, scales: cute.Tensor, counts: cute.Tensor, out: cute.Tensor,
                 out_scales, offs: cute.Tensor, stream):
        # e4m3 / e8m0 from the caller (no views), their bytes here
        data = cute.recast_tensor(data, cutlass.Uint8)
        scales = cute.recast_tensor(scales, cutlass.Uint8)
        if cutlass.const_expr(self.out != "dequant"):
            out = cute.recast_tensor(out, cutlass.Uint8)
            out_scales = cute.recast_tensor(out_scales, cutlass.Uint8)
        m = data.shape[0]
        k = data.shape[1]
        kb = k // BLOCK_SIZE
        nc = (kb + 3) // 4
        n_chunks = Int64(m) * Int64(k) // CHUNK
        per_cta = self.threads * self.iters
        n_data = Int32((n_chunks + (per_cta - 1)) // per_cta)
        n_seg = Int32(1)
        if cutlass.const_expr(self.rows):  # a CTA per (tile of `warps` rows, segment of 32 * iters chunks)
            seg_chunks = 32 * self.iters
            n_seg = Int32((k // CHUNK + (seg_chunks - 1)) // seg_chunks)
            warps = self.threads // 32
            n_data = Int32((m + (warps - 1)) // warps) * n_seg
        if cutlass.const_expr(self.tiles > 1):  # n_data tiles, `tiles` per CTA
            n_data = (n_data + (self.tiles - 1)) // self.tiles
        n_data = cutlass.max(n_data, Int32(1))  # one CTA writes offs even with no rows
        n_pad = Int32(0)
        buf_rows = Int32(0)
        if cutlass.const_expr(self.blocked):
            buf_rows = Int32(out_scales.shape[0])
            n_pad = (buf_rows + (TILE_ROWS - 1)) // TILE_ROWS
        self.kernel(
            data, scales, counts, out, out_scales, offs, Int32(m), Int32(k), Int32(kb), Int32(nc),
            Int32(counts.shape[0]), Int32(counts.shape[1]), n_chunks, n_pad, buf_rows, n_data, n_seg,
        ).launch(grid=[n_pad + n_data, 1, 1], block=[self.threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device

    @cute.kernel
    def kernel(self, data: cute.Tensor, scales: cute.Tensor, counts: cute.Tensor, out: cute.Tensor, out_scales,
               offs: cute.Tensor, m: Int32, k: Int32, kb: Int32, nc: Int32, n_ranks: Int32, n_experts: Int32,
               n_chunks: Int64, n_pad: Int32, buf_rows: Int32, n_data: Int32, n_seg: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        bid = Int32(bid)
        layout = cute.make_layout(MAX_BLOCKS)
        t_send = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)  # r-major src ends
        t_dend = None
        if cutlass.const_expr(not self.scatter):  # gather searches the e-major destination ends
            t_dend = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)
        t_shift = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)  # src - dst
        g_end = None
        g_shift = None
        g_pend = None
        if cutlass.const_expr(self.blocked):
            g_end = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)
            g_shift = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)
            g_pend = cute.make_tensor(cute.arch.alloc_smem(Int32, MAX_BLOCKS, alignment=16), layout)
        tables = (t_send, t_dend, t_shift, g_end, g_shift, g_pend)
        n_blocks = n_ranks * n_experts
        if cutlass.const_expr(self.scatter):
            # Data CTAs first, then the pad CTAs. Every CTA issues its loads before the table exists (a pad
            # CTA's chunks all lie past the end: they read the last chunk, or nothing with smem staging).
            stage = None
            if cutlass.const_expr(self.smem_staging):
                stage = cute.arch.alloc_smem(Int32, self.threads * self.iters * CHUNK_WORDS, alignment=16)
            pre = None
            if cutlass.const_expr(self.counts_first):
                pre = self.preload_counts(counts, n_blocks, tid)
            first = bid * self.tiles  # the CTA's first tile (a tile: the chunks of a CTA of tiles=1)
            loaded = self.load_tile(data, scales, m, k, kb, n_seg, n_chunks, first, tid, stage)
            self.build_tables(counts, offs, m, n_ranks, n_experts, n_blocks, tid, bid == 0, tables, pre)
            if cutlass.const_expr(self.smem_staging):
                cute.arch.cp_async_wait_group(0)  # this thread's own copies (every CTA: none left in flight)
                loaded = (stage, *loaded[1:])
            args = (data, scales, out, out_scales, m, k, kb, nc, n_experts, n_blocks, n_seg, n_chunks, first, tid)
            if cutlass.const_expr(self.blocked):
                if bid >= n_data:
                    self.pad_tile(out_scales, nc, (bid - n_data) * TILE_ROWS, n_experts, buf_rows, tid, tables)
                else:
                    self.store_tiles(*args, loaded, tables)
            else:
                self.store_tiles(*args, loaded, tables)
        else:
            # Pad CTAs first, then the data CTAs; the table before any load.
            self.build_tables(counts, offs, m, n_ranks, n_experts, n_blocks, tid, bid == n_pad, tables)
            if cutlass.const_expr(self.blocked):
                if bid < n_pad:
                    self.pad_tile(out_scales, nc, bid * TILE_ROWS, n_experts, buf_rows, tid, tables)
                else:
                    self.gather_tile(data, scales, out, out_scales, k, kb, nc, n_ranks, n_blocks, n_chunks,
                                     bid - n_pad, tid, tables)
            else:
                self.gather_tile(data, scales, out, out_scales, k, kb, nc, n_ranks, n_blocks, n_chunks, bid, tid,
                                 tables)

    @cute.jit
    def build_tables(self, counts, offs, m: Int32, n_ranks: Int32, n_experts: Int32, n_blocks: Int32, tid: Int32,
                     writes_offs, tables, pre=None):
        """The group tables (module doc); ``pre``: warp 0's counts of the first 64 blocks, loaded already
        (:meth:`preload_counts`), the later ones then loaded two steps ahead."""
        t_send, t_dend, t_shift, g_end, g_shift, g_pend = tables
        lane = tid % 32
        warp = tid // 32
        # Warp 0 builds the whole table; the other warps wait at the one barrier at the end (the first pass hands
        # over to the second through shared memory within warp 0: bar.warp.sync).
        # ---- r-major: sanitized source ends (saturating running total: min(sum, M)); block b starts at b - 1's end
        if warp == 0:
            carry = Int32(0)
            nxt = Int32(0)  # the counts of the next 32 blocks, loaded one step ahead (no L2 round trip per step)
            nxt2 = Int32(0)  # with pre: the 32 after them, two steps ahead
            if cutlass.const_expr(pre is None):
                if lane < n_blocks:
                    nxt = Int32(cute.arch.load(counts.iterator + lane, Int32))
            else:
                nxt, nxt2 = pre
            for sub in cutlass.range(0, (n_blocks + 31) // 32, 1, unroll=self.table_unroll):
                b = sub * 32 + lane
                raw = nxt
                if cutlass.const_expr(pre is None):
                    nxt = Int32(0)
                    if b + 32 < n_blocks:
                        nxt = Int32(cute.arch.load(counts.iterator + (b + 32), Int32))
                else:
                    nxt = nxt2
                    nxt2 = Int32(0)
                    if b + 64 < n_blocks:
                        nxt2 = Int32(cute.arch.load(counts.iterator + (b + 64), Int32))
                v = cutlass.min(cutlass.max(raw, Int32(0)), m)
                for d in cutlass.range_constexpr(5):
                    y = cute.arch.shuffle_sync_up(v, offset=1 << d)
                    if lane >= (1 << d):
                        v = v + cutlass.min(y, m - v)
                end = carry + cutlass.min(v, m - carry)
                if b < n_blocks:
                    t_send[b] = end
                carry = cute.arch.shuffle_sync(end, offset=31)
            cute.arch.sync_warp()
            # ---- expert-major: destination ends and row shifts (gather: e-major, scatter: r-major); offs
            carry = Int32(0)
            for sub in cutlass.range(0, (n_blocks + 31) // 32, 1, unroll=self.table_unroll):
                i = sub * 32 + lane
                sz = Int32(0)
                src = Int32(0)
                e = Int32(0)
                r = Int32(0)
                b = Int32(0)
                if i < n_blocks:
                    e = i // n_ranks
                    r = i - e * n_ranks
                    b = r * n_experts + e
                    if b > 0:
                        src = Int32(t_send[b - 1])
                    sz = Int32(t_send[b]) - src
                dend = carry + cu.warp_inclusive_sum(sz, lane)
                if i < n_blocks:
                    if cutlass.const_expr(self.scatter):
                        t_shift[b] = src - (dend - sz)  # searched by source row
                    else:
                        t_dend[i] = dend
                        t_shift[i] = src - (dend - sz)
                    if r == n_ranks - 1:
                        if writes_offs:
                            cu.st_global_u32(offs.iterator + e, dend)
                carry = cute.arch.shuffle_sync(dend, offset=31)
            if writes_offs:
                if n_ranks == 0:
                    for e in cutlass.range(lane, n_experts, 32):
                        cu.st_global_u32(offs.iterator + e, 0)
            # ---- blocked: experts' ends, padded ends and row shifts P_e - start_e. Expert e's end (the
            # e-major running total of the block sizes, the previous pass's dend at r = R - 1) summed here from
            # the source ends: sum over ranks r of t_send[r E + e] - start_r, start_r = t_send[r E - 1] (0 for
            # r = 0), so this pass needs nothing from the previous one (module doc). The loop over ranks not
            # unrolled: unrolled, ptxas gave the blocked rows variant 62 registers (48), and it measured 2-3
            # points slower at M >= 32768 on the H200.
            if cutlass.const_expr(self.blocked):
                carry_end = Int32(0)
                carry_pend = Int32(0)
                for sub in cutlass.range(0, (n_experts + 31) // 32, 1, unroll=self.table_unroll):
                    e = sub * 32 + lane
                    raw = Int32(0)
                    if e < n_experts and n_ranks > 0:
                        raw = Int32(t_send[e])
                        for r in cutlass.range(1, n_ranks, 1, unroll=1):
                            raw = raw + (Int32(t_send[r * n_experts + e]) - Int32(t_send[r * n_experts - 1]))
                    ge, shift, pend, carry_end, carry_pend = cu.m_groups_table_step(raw, m, lane, carry_end,
                                                                                     carry_pend)
                    if e < n_experts:
                        g_end[e] = ge
                        g_shift[e] = shift
                        g_pend[e] = pend
        cute.arch.sync_threads()

    @cute.jit
    def preload_counts(self, counts, n_blocks: Int32, tid: Int32):
        """``counts_first``: warp 0's counts of blocks ``lane`` and ``lane + 32`` (0 past ``n_blocks``; other warps:
        0), loaded before the CTA's data loads so that they do not queue behind them (predicated loads, no branch:
        ptxas moves later loads ahead of a branch's)."""
        w0 = tid < 32
        return (cu.ld_global_u32_if(counts.iterator + tid, w0 & (tid < n_blocks)),
                cu.ld_global_u32_if(counts.iterator + (tid + 32), w0 & (tid + 32 < n_blocks)))

    @cute.jit
    def pad_tile(self, out_scales, nc: Int32, p0: Int32, n_experts: Int32, buf_rows: Int32, tid: Int32, tables):
        """Zero the bytes of scale-buffer row tile ``p0 / 128`` that hold no real scale."""
        _, _, _, g_end, g_shift, g_pend = tables
        nreal = Int32(0)
        in_group = Int32(0)
        if n_experts > 0:
            if p0 < Int32(g_pend[n_experts - 1]):
                j = cu.upper_bound(g_pend, n_experts, p0)
                nreal = cutlass.min(cutlass.max(Int32(g_end[j]) - (p0 - Int32(g_shift[j])), Int32(0)),
                                    Int32(TILE_ROWS))
                in_group = Int32(1)
        cu.zero_scale_tile_padding(out_scales, p0, nc, buf_rows, in_group, nreal, tid, self.threads)

    @cute.jit
    def chunk_coords(self, k: Int32, dbid: Int32, tid: Int32, k_positive: cutlass.Constexpr = False):
        """Index, row and column (in chunks) of each of this thread's ``iters`` chunks of CTA range ``dbid``:
        chunk ``dbid * threads * iters + u * threads + tid`` for ``u < iters``."""
        kc = k // CHUNK  # chunks per row
        if cutlass.const_expr(k_positive):  # the compiler drops the guards below (ptxas: 2 registers fewer)
            kc = cutlass.max(kc, Int32(1))
        base = Int64(dbid) * Int64(self.threads * self.iters)
        r0 = Int32(0)
        c0 = Int32(0)
        if kc > 0:
            r0 = Int32(base // Int64(kc))
            c0 = Int32(base - Int64(r0) * Int64(kc))
        chs = []
        rows = []
        cols = []
        for u in cutlass.range_constexpr(self.iters):
            j = c0 + (u * self.threads) + tid
            dr = Int32(0)
            if kc > 0:
                dr = j // kc
            chs.append(base + (u * self.threads) + Int64(tid))
            rows.append(r0 + dr)
            cols.append(j - dr * kc)
        return chs, rows, cols

    @cute.jit
    def gather_tile(self, data, scales, out, out_scales, k: Int32, kb: Int32, nc: Int32, n_ranks: Int32,
                    n_blocks: Int32, n_chunks: Int64, dbid: Int32, tid: Int32, tables):
        """Gather: destination chunks of range ``dbid``; each one's source row from the table, then the loads."""
        _, t_dend, t_shift, _, g_shift, _ = tables
        last = cutlass.max(n_chunks - 1, Int64(0))
        total = Int32(0)
        if n_blocks > 0:
            total = Int32(t_dend[n_blocks - 1])
        chs, rows, cols = self.chunk_coords(k, dbid, tid)
        # ---- source row (and blocked scale row) of every chunk; then all loads
        srcs = []
        brows = []
        valids = []
        for u in cutlass.range_constexpr(self.iters):
            t = rows[u]
            valid = Int32(0)
            src = Int32(0)
            brow = Int32(0)
            if chs[u] < n_chunks:
                if t < total:
                    valid = Int32(1)
                    i = cu.upper_bound(t_dend, n_blocks, t)
                    src = t + Int32(t_shift[i])
                    if cutlass.const_expr(self.blocked):
                        brow = t + Int32(g_shift[i // n_ranks])
            srcs.append(src)
            brows.append(brow)
            valids.append(valid)
        words = []
        sbytes = []
        for u in cutlass.range_constexpr(self.iters):
            src_off = cutlass.min(Int64(srcs[u]) * Int64(k) + Int64(cols[u]) * CHUNK, last * CHUNK)
            words.append(cu.ld_global_v4(data.iterator + src_off))
            sbytes.append(cu.ld_global_u8(scales.iterator + (Int64(srcs[u]) * Int64(kb) + Int64(cols[u] // 2))))
        # ---- stores
        for u in cutlass.range_constexpr(self.iters):
            w = self.pair_words(words[u])
            if chs[u] < n_chunks:
                self.store_chunk(out, out_scales, kb, nc, chs[u], rows[u], cols[u], brows[u], valids[u] != 0, w,
                                 sbytes[u])

    @cute.jit
    def load_tile(self, data, scales, m: Int32, k: Int32, kb: Int32, n_seg: Int32, n_chunks: Int64, tile: Int32,
                  tid: Int32, stage):
        """Scatter and rows: issue the loads of tile ``tile`` (no table needed); ``(words, scale bytes, row,
        cols)`` (row and cols: rows order only)."""
        if cutlass.const_expr(self.rows):
            return self.load_row_chunks(data, scales, m, k, kb, n_seg, tile, tid)
        words, sbytes = self.load_src_chunks(data, scales, n_chunks, tile, tid, stage)
        return words, sbytes, Int32(0), None

    @cute.jit
    def store_tiles(self, data, scales, out, out_scales, m: Int32, k: Int32, kb: Int32, nc: Int32, n_experts: Int32,
                    n_blocks: Int32, n_seg: Int32, n_chunks: Int64, first: Int32, tid: Int32, loaded, tables):
        """Scatter and rows: store the CTA's ``tiles`` tiles from ``first`` on, the first one ``loaded``; the next
        tile's loads are issued before this one's stores (a tile past the end loads in range and stores nothing,
        as a CTA past the end of tiles=1 would)."""
        for j in cutlass.range_constexpr(self.tiles):
            nxt = None
            if cutlass.const_expr(j + 1 < self.tiles):
                nxt = self.load_tile(data, scales, m, k, kb, n_seg, n_chunks, first + (j + 1), tid, None)
            words, sbytes, row, cols = loaded
            self.store_tile(out, out_scales, k, kb, nc, n_experts, n_blocks, n_chunks, first + j, tid, words, sbytes,
                            row, cols, tables)
            loaded = nxt

    @cute.jit
    def load_src_chunks(self, data, scales, n_chunks: Int64, dbid: Int32, tid: Int32, stage):
        """Scatter: issue the loads of this thread's source chunks of range ``dbid`` and their scale bytes (no
        table needed). A chunk's scale byte is byte ``chunk // 2`` of ``scales`` (K/16 chunks and K/32 scales
        per row). A chunk past the end reads the last one (staged: reads nothing, its copy zero-fills).
        Returns the chunks' words (staged in ``stage``, at ``(u * threads + tid) * 16`` bytes: None) and the
        scale bytes."""
        base = Int64(dbid) * Int64(self.threads * self.iters)
        last = cutlass.max(n_chunks - 1, Int64(0))
        words = []
        sbytes = []
        for u in cutlass.range_constexpr(self.iters):
            ch = base + (u * self.threads) + Int64(tid)
            src = data.iterator + cutlass.min(ch, last) * CHUNK
            if cutlass.const_expr(self.smem_staging):
                n_read = Int32(cutlass.select_(ch < n_chunks, Int32(CHUNK), Int32(0)))
                cu.cp_async_16(stage + (u * self.threads + tid) * CHUNK_WORDS, src, n_read)
            else:
                words.append(cu.ld_global_v4(src))
            sbytes.append(cu.ld_global_u8(scales.iterator + cutlass.min(ch, last) // CHUNKS_PER_BLOCK))
        if cutlass.const_expr(self.smem_staging):
            cute.arch.cp_async_commit_group()
            words = None
        return words, sbytes

    @cute.jit
    def store_tile(self, out, out_scales, k: Int32, kb: Int32, nc: Int32, n_experts: Int32, n_blocks: Int32,
                   n_chunks: Int64, bid: Int32, tid: Int32, words, sbytes, row: Int32, cols, tables):
        """The store half of ``scatter`` (``cols`` None) or ``rows``."""
        if cutlass.const_expr(self.rows):
            self.rows_tile(out, out_scales, k, kb, nc, n_experts, n_blocks, row, cols, words, sbytes, tables)
        else:
            self.scatter_tile(out, out_scales, k, kb, nc, n_experts, n_blocks, n_chunks, bid, tid, words, sbytes,
                              tables)

    @cute.jit
    def load_row_chunks(self, data, scales, m: Int32, k: Int32, kb: Int32, n_seg: Int32, bid: Int32, tid: Int32):
        """Rows: issue the loads of this lane's ``iters`` chunks of its warp's source row segment (no table
        needed). Returns the words, the scale bytes, the row and the chunk columns (``-1``: no chunk; its load
        reads chunk 0, unused)."""
        warps = self.threads // 32
        tile = bid // n_seg
        seg = bid - tile * n_seg
        row = tile * warps + tid // 32
        kc = k // CHUNK
        c0 = seg * (32 * self.iters) + tid % 32
        row_ok = row < m
        safe_row = Int32(cutlass.select_(row_ok, row, Int32(0)))
        src = data.iterator + Int64(safe_row) * Int64(k)
        ssrc = scales.iterator + Int64(safe_row) * Int64(kb)
        words = []
        sbytes = []
        cols = []
        for u in cutlass.range_constexpr(self.iters):
            col = c0 + u * 32
            ok = row_ok & (col < kc)
            safe = Int32(cutlass.select_(ok, col, Int32(0)))
            words.append(cu.ld_global_v4(src + safe * CHUNK))
            sbytes.append(cu.ld_global_u8(ssrc + safe // CHUNKS_PER_BLOCK))
            cols.append(Int32(cutlass.select_(ok, col, Int32(-1))))
        return words, sbytes, row, cols

    @cute.jit
    def rows_tile(self, out, out_scales, k: Int32, kb: Int32, nc: Int32, n_experts: Int32, n_blocks: Int32,
                  row: Int32, cols, words, sbytes, tables):
        """Rows: store this lane's loaded chunks of source row ``row`` at its destination row (one search for
        the warp's row): as :meth:`scatter_tile`, row ``s < T`` of r-major block b goes to ``s - shift[b]``, a
        row ``s >= T`` to itself, zeroed."""
        kc = cutlass.max(k // CHUNK, Int32(1))
        total, blocks = self.search_rows([row], n_blocks, tables)
        valid, dst, brow = self.destination(row, blocks[0], total, n_experts, tables)
        dst_ch = Int64(dst) * Int64(kc)
        # blocked: the byte of the lane's first scale, once per row; chunk u's scale (block + 16 u: the same
        # column of the tile 4 u column tiles on) lies 4 u tiles (2048 u bytes) further
        sbase = None
        if cutlass.const_expr(self.blocked):
            sbase = cu.blocked_offset(brow, cutlass.max(cols[0], Int32(0)) // CHUNKS_PER_BLOCK, nc)
        for u in cutlass.range_constexpr(self.iters):
            w = self.pair_words(words[u])
            if cols[u] >= 0:
                at = None
                if cutlass.const_expr(self.blocked):
                    at = sbase + (u * 32 // CHUNKS_PER_BLOCK // TILE_COLS) * TILE_BYTES
                self.store_chunk(out, out_scales, kb, nc, dst_ch + Int64(cols[u]), dst, cols[u], brow, valid, w,
                                 sbytes[u], at)

    @cute.jit
    def scatter_tile(self, out, out_scales, k: Int32, kb: Int32, nc: Int32, n_experts: Int32, n_blocks: Int32,
                     n_chunks: Int64, dbid: Int32, tid: Int32, words, sbytes, tables):
        """Scatter: store the loaded source chunks of range ``dbid`` (``words``: the words, or the stage they
        were copied to) at their destination rows: source row ``s < T`` of r-major block b (the first with
        source end ``> s``) goes to row ``s - shift[b]``; a row ``s >= T`` is output row ``s`` itself, zeroed."""
        kc = cutlass.max(k // CHUNK, Int32(1))
        chs, rows, cols = self.chunk_coords(k, dbid, tid, True)  # after the table: fewer registers held across it
        total, blocks = self.search_rows(rows, n_blocks, tables)
        for u in cutlass.range_constexpr(self.iters):
            valid, dst, brow = self.destination(rows[u], blocks[u], total, n_experts, tables)
            if cutlass.const_expr(self.smem_staging):  # read where stored: 4 registers live, not 16
                w = cu.ld_global_v4(words + (u * self.threads + tid) * CHUNK_WORDS)
            else:
                w = words[u]
            w = self.pair_words(w)
            if chs[u] < n_chunks:
                self.store_chunk(out, out_scales, kb, nc, Int64(dst) * Int64(kc) + Int64(cols[u]), dst, cols[u],
                                 brow, valid, w, sbytes[u])

    @cute.jit
    def search_rows(self, rows, n_blocks: Int32, tables):
        """``(T, blocks)``: the total ``T`` and the r-major block of each source row in ``rows`` (scatter and
        rows orders), searched together (a row past the total gets some block, unused)."""
        t_send = tables[0]
        total = Int32(0)
        if n_blocks > 0:
            total = Int32(t_send[n_blocks - 1])
        return total, cu.upper_bounds(t_send, cutlass.max(n_blocks, Int32(1)), rows)

    @cute.jit
    def destination(self, row: Int32, block: Int32, total: Int32, n_experts: Int32, tables):
        """``(valid, dst, brow)`` of source row ``row`` of r-major block ``block``: row ``s < T`` goes to output
        row ``s - shift[b]`` (blocked scale row ``dst + g_shift[b % E]``), a row ``s >= T`` to itself (``valid``
        false: zeroed)."""
        _, _, t_shift, _, g_shift, _ = tables
        valid = row < total
        dst = Int32(cutlass.select_(valid, row - Int32(t_shift[block]), row))
        brow = Int32(0)
        if cutlass.const_expr(self.blocked):
            brow = dst + Int32(g_shift[block % cutlass.max(n_experts, Int32(1))])
        return valid, dst, brow

    @cute.jit
    def pair_words(self, words):
        """``pair_stores``: the loaded words (4 packed e4m3 words of a 16-element chunk) as this lane stores them.
        The lanes 2i, 2i + 1 hold the two chunks of one 32-element block (every order: a chunk's parity is its
        lane's; the same row, scale and validity); each lane's output is P = 2 (bf16) or 4 (fp32) pieces of 16
        bytes, piece q from its words' part q (bf16: words 2q, 2q + 1; fp32: word q). Store instruction g writes
        sector g of the pair's 2P pieces: the even lane its piece 2g, the odd lane piece 2g + 1, so the even lane
        stores the even pieces of both chunks, the odd lane the odd ones. Each lane swaps the pieces of its
        partner's parity for its partner's of its own (two shuffles): returned are the words of its pieces in
        store order (its own chunk's first for the even lane, the partner's first for the odd lane). Off: the
        words as loaded."""
        if cutlass.const_expr(not self.pairs):
            return words
        w0, w1, w2, w3 = words
        a, b, c, d = (w0, w2, w1, w3) if self.f32 else (w0, w1, w2, w3)  # even pieces (a, b), odd pieces (c, d)
        odd = (Int32(cute.arch.lane_idx()) & 1) != 0
        r0 = cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(odd, a, c)), offset=1)
        r1 = cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(odd, b, d)), offset=1)
        first = [Int32(cutlass.select_(odd, r0, a)), Int32(cutlass.select_(odd, r1, b))]
        second = [Int32(cutlass.select_(odd, c, r0)), Int32(cutlass.select_(odd, d, r1))]
        return first[0], first[1], second[0], second[1]

    @cute.jit
    def store_chunk(self, out, out_scales, kb: Int32, nc: Int32, ch: Int64, row: Int32, col: Int32, brow: Int32,
                    ok, words, sbyte, scale_at=None):
        """Output chunk ``ch`` (output row ``row``, chunk column ``col``; blocked scale row ``brow``, the scale's
        byte ``scale_at`` where the caller has it): the loaded 16 bytes and scale byte where ``ok``, else zeros
        (a row past the total)."""
        w0, w1, w2, w3 = words
        w0 = Int32(cutlass.select_(ok, w0, Int32(0)))
        w1 = Int32(cutlass.select_(ok, w1, Int32(0)))
        w2 = Int32(cutlass.select_(ok, w2, Int32(0)))
        w3 = Int32(cutlass.select_(ok, w3, Int32(0)))
        s = Int32(cutlass.select_(ok, sbyte, Int32(0)))
        if cutlass.const_expr(self.out == "dequant"):
            n_words = 16 if self.f32 else 8
            vals = cute.make_rmem_tensor(n_words, Int32)
            sv = cu.e8m0_value_bits(s)
            dq = cu.dequantize4_f32 if self.f32 else cu.dequantize4_bf16
            fast = [*dq(w0, sv), *dq(w1, sv), *dq(w2, sv), *dq(w3, sv)]
            for i in cutlass.range_constexpr(n_words):
                vals[i] = Int32(fast[i])
            is_nan = s == E8M0_NAN
            if is_nan | cu.e4m3_has_nan((w0, w1, w2, w3)):  # rare: the NaN rules (a finite byte and scale give none)
                lo = cu.canonical_nan_words(cu.dequantize8(w0, w1, s, is_nan, self.f32), self.f32)
                hi = cu.canonical_nan_words(cu.dequantize8(w2, w3, s, is_nan, self.f32), self.f32)
                slow = lo + hi
                for i in cutlass.range_constexpr(n_words):
                    vals[i] = Int32(slow[i])
            dst = out.iterator + ch * CHUNK
            if cutlass.const_expr(self.pairs):  # piece g of this lane (pair_words) at the pair's byte 32 g + 16 par
                esize = 4 if self.f32 else 2
                pieces = n_words // 4
                odd = Int32(cute.arch.lane_idx()) & 1
                base = dst + odd * (-16 * (pieces - 1) // esize)  # the pair's first byte plus 16 par
                for g in cutlass.range_constexpr(pieces):
                    cu.st_global_v4(base + g * (32 // esize), *[vals[4 * g + i] for i in range(4)])
            else:
                cu.st_global_words(dst, [vals[i] for i in range(n_words // 2)])
                cu.st_global_words(dst + 8, [vals[i] for i in range(n_words // 2, n_words)])
        else:
            cu.st_global_v4(out.iterator + ch * CHUNK, w0, w1, w2, w3)
            if col % CHUNKS_PER_BLOCK == 0:
                c = col // CHUNKS_PER_BLOCK
                if cutlass.const_expr(self.out == "plain"):
                    cu.st_global_u8(out_scales.iterator + (Int64(row) * Int64(kb) + Int64(c)), s)
                else:
                    if ok:
                        if cutlass.const_expr(scale_at is None):
                            cu.store_blocked_scale(out_scales, brow, c, kb, nc, s)
                        else:
                            cu.store_blocked_scale_at(out_scales, scale_at, c, kb, nc, s)


def make_fake_args(variant: Variant, tvm_ffi: bool):
    """Placeholder arguments for ``cute.compile``: dynamic M, K (K % 32 == 0), R, E, scale rows."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int32(symbol="M")
    k = cute.sym_int32(divisibility=BLOCK_SIZE, symbol="K")
    kb = cute.sym_int32(symbol="KB")
    r = cute.sym_int32(symbol="R")
    e = cute.sym_int32(symbol="E")
    data = make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k), stride_order=(1, 0), assumed_align=16)
    scales = make_fake_compact_tensor(cutlass.Float8E8M0FNU, (m, kb), stride_order=(1, 0), assumed_align=16)
    counts = make_fake_compact_tensor(cutlass.Int32, (r, e), stride_order=(1, 0), assumed_align=4)
    out_dtype = cu.CUTLASS_DTYPES[variant.out_dtype] if variant.out == "dequant" else cutlass.Float8E4M3FN
    out = make_fake_compact_tensor(out_dtype, (m, k), stride_order=(1, 0), assumed_align=16)
    out_scales = None
    if variant.out != "dequant":
        rows = cute.sym_int32(symbol="S_rows")
        cols = cute.sym_int32(symbol="S_cols")
        out_scales = make_fake_compact_tensor(cutlass.Float8E8M0FNU, (rows, cols), stride_order=(1, 0),
                                              assumed_align=16)
    offs = make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else make_fake_stream()
    return data, scales, counts, out, out_scales, offs, stream


def compile_variant(variant: Variant, tvm_ffi: bool, extra_options: str = ""):
    """``cute.compile`` one variant for the arch in ``CUTE_DSL_ARCH`` (or the local GPU)."""
    kernel = PermuteMxfp8Kernel(variant)
    args = make_fake_args(variant, tvm_ffi)
    opts = " ".join(o for o in (("--enable-tvm-ffi" if tvm_ffi else ""), extra_options) if o)
    return cute.compile(kernel, *args, options=opts)
