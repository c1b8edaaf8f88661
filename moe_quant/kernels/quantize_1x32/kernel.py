"""CuTe-DSL kernel: rowwise (1x32) MXFP8 quantization of ``x (M, K)``, optional jagged M groups.

One source for SM90 (Hopper) and SM100 (Blackwell). Memory-bound streaming design:

* The input is viewed as a flat array of 8-element chunks (16 bytes of bf16); a
  32-element scale block is 4 consecutive chunks held by 4 consecutive lanes (a
  "quad"), so every warp load is 512 contiguous bytes, whatever K is (K % 128 != 0
  and tiny K included). A CTA owns ``iters * threads`` consecutive chunks and issues
  all of its 16-byte loads before the first use.
* amax: integer max of magnitude bit patterns in each lane, then 2 butterfly shuffles
  in the quad. Scale, reciprocal, saturating e4m3 cast: exact bit recipes in
  :mod:`moe_quant.kernels.cute_utils` (same definition as :mod:`moe_quant.numerics`).
* Scales go straight to their final byte: plain ``(M, K/32)``, the blocked layout of
  the whole matrix, or the M-groups blocked layout (each group's scale rows blocked
  on their own at padded row ``P_g``). Group lookup: while its loads are in flight, each
  CTA rebuilds the sanitized group table (``clamp(offs, 0, M)``, running max, padded
  prefix sums -- the same definition as :func:`moe_quant.layouts.group_bounds`) with warp
  scans into shared memory, ``table`` groups per pass (any G), and binary-searches it for
  the row of each of its blocks.
* One block's scale is known to all 4 lanes of its quad, so lane j of a quad writes the
  scales of the quad's blocks of iterations u = j, j + 4, ...: each lane does the
  row/column arithmetic, the group search and the scale store of one block per 4
  iterations instead of the quad's first lane doing all of them (the index arithmetic
  had made the kernel bound by its instruction issue on the H200; NOTES.md).
* Padding (the "fused per-group padding"): extra CTAs at the front of the grid, one
  per 128-row tile of the scale buffer, zero every byte that holds no real scale:
  rows past a group's end inside its last tile, and the tail after the last group.
  Pad columns (``K/32 % 4 != 0``) of real rows are zeroed by the lane that writes the
  row's last scale. Real and padding bytes are disjoint, so no ordering is needed.
* Fake-quant mode writes ``bf16(q * 2**(s-127))`` (or fp32) in the same pass; no fp8
  is materialized.
* ``as_bf16`` (fp32 input): each loaded value is rounded to bf16 first (``cvt.rn``, as
  ``x.to(torch.bfloat16)``), so fp32 master weights are quantized as their bf16 values
  without a cast kernel writing and the kernel reading a bf16 copy.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...layouts import TILE_ROWS
from ...numerics import BLOCK_SIZE
from .. import cute_utils as cu
from .config import (  # noqa: F401  (re-exported: the kernel's config dataclasses)
    CHUNK,
    DEFAULT_TILE,
    LANES_PER_BLOCK,
    TileConfig,
    Variant,
    all_variants,
)



class Quantize1x32Kernel:
    """Rowwise 1x32 MXFP8 quantization; see the module docstring.

    Host entry ``__call__(x, out, scales, offs, stream)``: ``x (M, K)``; ``out (M, K)``
    (e4m3, or bf16/fp32 for ``fake``); ``scales`` e8m0 (``None`` for ``fake``; stored as bytes): plain
    ``(M, K/32)``, blocked ``(128 ceil(M/128), 4 ceil(K/128))`` or M-groups
    ``(M + 128 G, 4 ceil(K/128))``; ``offs`` int32 ``(G,)`` for ``mgroups`` else ``None``.
    """

    def __init__(self, variant: Variant):
        self.v = variant
        self.rceil = variant.mode == "rceil"
        self.in_f32 = variant.in_dtype == "float32"
        self.as_bf16 = variant.as_bf16  # fp32 loads rounded to bf16 before the block math
        self.kind = variant.kind
        self.fake_f32 = variant.kind == "fake" and variant.out_dtype == "float32"
        self.threads = variant.tile.threads
        self.iters = variant.tile.iters
        self.table = variant.tile.table
        self.has_pad = variant.kind in ("blocked", "mgroups")
        self.prefetch_offs = variant.tile.prefetch_offs

    # ------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, scales, offs, stream):
        if cutlass.const_expr(scales is not None):
            scales = cute.recast_tensor(scales, cutlass.Uint8)  # e8m0 from the caller (no view), bytes here
        m = x.shape[0]
        k = x.shape[1]
        kb = k // BLOCK_SIZE
        nc = (kb + 3) // 4
        n_chunks = Int64(m) * Int64(k) // CHUNK
        per_cta = self.threads * self.iters
        n_data = Int32((n_chunks + (per_cta - 1)) // per_cta)
        n_pad = Int32(0)
        pad_tile0 = Int32(0)
        n_groups = Int32(0)
        buf_rows = Int32(0)
        if cutlass.const_expr(self.kind == "mgroups"):
            n_groups = Int32(offs.shape[0])
            buf_rows = Int32(scales.shape[0])
            n_pad = (buf_rows + (TILE_ROWS - 1)) // TILE_ROWS
        if cutlass.const_expr(self.kind == "blocked"):
            # Only the last row tile can hold padding rows; pad columns are written by the data CTAs.
            buf_rows = Int32(scales.shape[0])
            pad_tile0 = Int32(m) // TILE_ROWS
            n_pad = buf_rows // TILE_ROWS - pad_tile0
        self.kernel(
            x, out, scales, offs, Int32(m), Int32(kb), Int32(nc), n_chunks, n_pad, pad_tile0, n_groups, buf_rows
        ).launch(grid=[n_pad + n_data, 1, 1], block=[self.threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        out: cute.Tensor,
        scales,
        offs,
        m: Int32,
        kb: Int32,
        nc: Int32,
        n_chunks: Int64,
        n_pad: Int32,
        pad_tile0: Int32,
        n_groups: Int32,
        buf_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        bid = Int32(bid)
        t_end = None
        t_shift = None
        t_pend = None
        if cutlass.const_expr(self.kind == "mgroups"):
            layout = cute.make_layout(self.table)
            t_end = cute.make_tensor(cute.arch.alloc_smem(Int32, self.table, alignment=16), layout)
            t_shift = cute.make_tensor(cute.arch.alloc_smem(Int32, self.table, alignment=16), layout)
            t_pend = cute.make_tensor(cute.arch.alloc_smem(Int32, self.table, alignment=16), layout)
        if cutlass.const_expr(self.has_pad):
            if bid < n_pad:
                self.pad_tile(scales, offs, m, nc, pad_tile0 + bid, n_groups, buf_rows, tid, t_end, t_shift, t_pend)
            else:
                self.data_tile(x, out, scales, offs, m, kb, nc, n_chunks, bid - n_pad, n_groups, tid,
                               t_end, t_shift, t_pend)
        else:
            self.data_tile(x, out, scales, offs, m, kb, nc, n_chunks, bid, n_groups, tid, t_end, t_shift, t_pend)

    @cute.jit
    def table_pass(self, pas: Int32, offs, m: Int32, n_groups: Int32, lane: Int32, warp: Int32,
                   carry_end: Int32, carry_pend: Int32, t_end, t_shift, t_pend, pre: Int32):
        """Pass ``pas`` over the groups: warp 0 fills the table with groups ``[g0, g0 + n)``, then the
        CTA syncs. Returns ``(n, carry_end, carry_pend)``."""
        g0 = pas * self.table
        n = cutlass.min(Int32(self.table), n_groups - g0)
        if warp == 0:
            carry_end, carry_pend = self.build_table(
                offs, m, g0, n, n_groups, lane, carry_end, carry_pend, t_end, t_shift, t_pend, pre
            )
        cute.arch.sync_threads()
        return n, carry_end, carry_pend

    @cute.jit
    def build_table(self, offs, m: Int32, g0: Int32, n: Int32, n_groups: Int32, lane: Int32,
                    carry_end: Int32, carry_pend: Int32, t_end, t_shift, t_pend, pre: Int32):
        """Warp-wide: sanitized ends, row shift ``P_g - start_g`` and padded end of groups
        ``[g0, g0 + n)`` into the table; returns the carries for the next groups.

        ``end_g = max_{j<=g} clamp(offs[j], 0, M)``; ``P_g = sum_{j<g} round_up(size_j, 128)``.
        ``pre`` is ``offs[lane]`` loaded early (used for groups 0..31).
        """
        for sub in cutlass.range(0, (n + 31) // 32, 1):
            i = sub * 32 + lane
            g = g0 + i
            raw = pre
            if cutlass.const_expr(self.prefetch_offs):
                if g >= 32:
                    raw = Int32(0)
                    if g < n_groups:
                        raw = Int32(offs[g])
            else:
                raw = Int32(0)
                if g < n_groups:
                    raw = Int32(offs[g])
            e, shift, pend, carry_end, carry_pend = cu.m_groups_table_step(raw, m, lane, carry_end, carry_pend)
            if i < n:
                t_end[i] = e
                t_shift[i] = shift
                t_pend[i] = pend
        return carry_end, carry_pend

    @cute.jit
    def pad_tile(self, scales, offs, m: Int32, nc: Int32, tile: Int32, n_groups: Int32, buf_rows: Int32,
                 tid: Int32, t_end, t_shift, t_pend):
        """Zero the bytes of scale-buffer row tile ``tile`` that hold no real scale."""
        p0 = tile * TILE_ROWS
        nreal = Int32(0)
        in_group = Int32(0)
        if cutlass.const_expr(self.kind == "blocked"):
            nreal = m - p0
            in_group = Int32(1)
        else:
            lane = tid % 32
            warp = tid // 32
            pre = Int32(0)
            if cutlass.const_expr(self.prefetch_offs):
                if warp == 0:
                    if lane < n_groups:
                        pre = Int32(offs[lane])
            carry_end = Int32(0)
            carry_pend = Int32(0)
            for pas in cutlass.range(0, (n_groups + (self.table - 1)) // self.table, 1):
                n, carry_end, carry_pend = self.table_pass(
                    pas, offs, m, n_groups, lane, warp, carry_end, carry_pend, t_end, t_shift, t_pend, pre
                )
                if in_group == 0:
                    if p0 < Int32(t_pend[n - 1]):
                        j = cu.upper_bound(t_pend, n, p0)
                        nreal = cutlass.min(cutlass.max(Int32(t_end[j]) - (p0 - Int32(t_shift[j])), Int32(0)),
                                            Int32(TILE_ROWS))
                        in_group = Int32(1)
                cute.arch.sync_threads()
        cu.zero_scale_tile_padding(scales, p0, nc, buf_rows, in_group, nreal, tid, self.threads)

    @cute.jit
    def data_tile(self, x, out, scales, offs, m: Int32, kb: Int32, nc: Int32, n_chunks: Int64, dbid: Int32,
                  n_groups: Int32, tid: Int32, t_end, t_shift, t_pend):
        threads = self.threads
        iters = self.iters
        lane = tid % 32
        warp = tid // 32
        base = Int64(dbid) * Int64(threads * iters)
        last = n_chunks - 1

        # ---- issue every load of this CTA first (and warp 0's first offsets, for the group table)
        pre = Int32(0)
        if cutlass.const_expr(self.kind == "mgroups" and self.prefetch_offs):
            if warp == 0:
                if lane < n_groups:
                    pre = Int32(offs[lane])
        xw = []
        for u in cutlass.range_constexpr(iters):
            ch = cutlass.min(base + (u * threads) + Int64(tid), last)
            src = x.iterator + ch * CHUNK
            if cutlass.const_expr(self.in_f32):
                a0, a1, a2, a3 = cu.ld_global_v4(src)
                a4, a5, a6, a7 = cu.ld_global_v4(src + 4)
                xw.append((a0, a1, a2, a3, a4, a5, a6, a7))
            else:
                w0, w1, w2, w3 = cu.ld_global_v4(src)
                xw.append((w0, w1, w2, w3))

        # ---- the scales this lane writes: the 4 lanes of a quad hold the same block's scale, so lane j of the
        # quad writes the scales of iterations u = j, j + 4, ... ("rounds" of 4 iterations): every lane does the
        # row/column arithmetic (and the group search) of one block per round, not of every block
        n_rounds = (iters + LANES_PER_BLOCK - 1) // LANES_PER_BLOCK
        quad_pos = lane % LANES_PER_BLOCK
        rows = []
        cols = []
        mine = []  # this lane's block of each round exists (u < iters and inside the tensor)
        if cutlass.const_expr(self.kind != "fake"):
            blk0 = base // LANES_PER_BLOCK  # first block of the CTA (CTA-uniform)
            r0 = Int32(blk0 // Int64(kb))
            c0 = Int32(blk0 - Int64(r0) * Int64(kb))
            for rd in cutlass.range_constexpr(n_rounds):
                u = quad_pos + rd * LANES_PER_BLOCK  # dynamic: this lane's iteration of the round
                t = c0 + (u * threads + tid) // LANES_PER_BLOCK
                dr = t // kb
                rows.append(r0 + dr)
                cols.append(t - dr * kb)
                ch = base + Int64(u * threads + tid)
                ok = ch < n_chunks
                if cutlass.const_expr(iters % LANES_PER_BLOCK != 0):
                    ok = ok & (u < iters)
                mine.append(ok)

        # ---- M groups: while the loads are in flight, warp 0 builds the group table and every lane looks up
        # the group of its blocks' rows (row shift P_g - start_g)
        found = None
        shift = None
        if cutlass.const_expr(self.kind == "mgroups"):
            found = cute.make_rmem_tensor(cute.make_layout(n_rounds), Int32)
            shift = cute.make_rmem_tensor(cute.make_layout(n_rounds), Int32)
            for rd in cutlass.range_constexpr(n_rounds):
                found[rd] = Int32(0)
                shift[rd] = Int32(0)
            carry_end = Int32(0)
            carry_pend = Int32(0)
            for pas in cutlass.range(0, (n_groups + (self.table - 1)) // self.table, 1):
                n, carry_end, carry_pend = self.table_pass(
                    pas, offs, m, n_groups, lane, warp, carry_end, carry_pend, t_end, t_shift, t_pend, pre
                )
                last_end = Int32(t_end[n - 1])
                for rd in cutlass.range_constexpr(n_rounds):
                    if found[rd] == 0:
                        if rows[rd] < last_end:
                            j = cu.upper_bound(t_end, n, rows[rd])
                            shift[rd] = Int32(t_shift[j])
                            found[rd] = Int32(1)
                cute.arch.sync_threads()

        # ---- quantize; store data
        svals = []
        for u in cutlass.range_constexpr(iters):
            ch = base + (u * threads) + Int64(tid)
            if cutlass.const_expr(self.in_f32):
                xs = cu.f32_bits_as_bf16(xw[u]) if cutlass.const_expr(self.as_bf16) else xw[u]
            else:
                w0, w1, w2, w3 = xw[u]
                l0, h0 = cu.bf16x2_to_f32_bits(w0)
                l1, h1 = cu.bf16x2_to_f32_bits(w1)
                l2, h2 = cu.bf16x2_to_f32_bits(w2)
                l3, h3 = cu.bf16x2_to_f32_bits(w3)
                xs = (l0, h0, l1, h1, l2, h2, l3, h3)
            q0, q1, s, is_nan = cu.quantize_block8(xs, self.rceil)
            valid = ch < n_chunks
            if cutlass.const_expr(self.kind == "fake"):
                words = cu.dequantize8(q0, q1, s, is_nan, self.fake_f32)
                if valid:
                    cu.st_global_words(out.iterator + ch * CHUNK, words)
            else:
                if valid:
                    cu.st_global_v2(out.iterator + ch * CHUNK, q0, q1)
                svals.append(s)

        # ---- store this lane's scales (one per round)
        if cutlass.const_expr(self.kind != "fake"):
            for rd in cutlass.range_constexpr(n_rounds):
                u0 = rd * LANES_PER_BLOCK
                s = svals[u0]
                for d in cutlass.range_constexpr(1, LANES_PER_BLOCK):
                    if cutlass.const_expr(u0 + d < iters):
                        s = Int32(cutlass.select_(quad_pos == d, svals[u0 + d], s))
                if mine[rd]:
                    if cutlass.const_expr(self.kind == "mgroups"):
                        if found[rd] != 0:
                            cu.store_blocked_scale(scales, rows[rd] + shift[rd], cols[rd], kb, nc, s)
                    elif cutlass.const_expr(self.kind == "plain"):
                        cu.st_global_u8(scales.iterator + (Int64(rows[rd]) * Int64(kb) + Int64(cols[rd])), s)
                    else:
                        cu.store_blocked_scale(scales, rows[rd], cols[rd], kb, nc, s)


def make_fake_args(variant: Variant, tvm_ffi: bool):
    """Placeholder arguments for ``cute.compile``: dynamic M, K (K % 32 == 0), rows, G."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int32(symbol="M")
    k = cute.sym_int32(divisibility=BLOCK_SIZE, symbol="K")
    x = make_fake_compact_tensor(cu.CUTLASS_DTYPES[variant.in_dtype], (m, k), stride_order=(1, 0), assumed_align=16)
    out_dtype = cu.CUTLASS_DTYPES[variant.out_dtype]
    out = make_fake_compact_tensor(out_dtype, (m, k), stride_order=(1, 0), assumed_align=16)
    scales = None
    offs = None
    if variant.kind != "fake":
        rows = cute.sym_int32(symbol="S_rows")
        cols = cute.sym_int32(symbol="S_cols")
        scales = make_fake_compact_tensor(cutlass.Float8E8M0FNU, (rows, cols), stride_order=(1, 0), assumed_align=16)
    if variant.kind == "mgroups":
        g = cute.sym_int32(symbol="G")
        offs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else make_fake_stream()
    return x, out, scales, offs, stream


def compile_variant(variant: Variant, tvm_ffi: bool, extra_options: str = ""):
    """``cute.compile`` one variant for the arch in ``CUTE_DSL_ARCH`` (or the local GPU)."""
    kernel = Quantize1x32Kernel(variant)
    args = make_fake_args(variant, tvm_ffi)
    opts = " ".join(o for o in (("--enable-tvm-ffi" if tvm_ffi else ""), extra_options) if o)
    return cute.compile(kernel, *args, options=opts)
