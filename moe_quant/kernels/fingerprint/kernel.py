"""CuTe-DSL kernel: the byte fingerprint of a buffer (the definition is :mod:`moe_quant.fingerprint`; the
kernel is tested equal to its reference).

One source for SM90 (Hopper) and SM100 (Blackwell). Memory-bound streaming read, nothing written but one
64-bit atomic add per CTA:

* The buffer is ``n`` bytes at a 16-byte aligned address (``ops`` stages anything else); its
  first word is word ``first_word`` of the tensor being fingerprinted. Vector ``v`` (bytes ``[16 v, 16 v +
  16)``) holds words ``first_word + 2 v`` and ``+ 2 v + 1``.
* A persistent grid (``grid`` CTAs, at most ``max_ctas``) walks tiles of ``threads * iters`` vectors
  (grid-stride); each thread issues its ``iters`` 16-byte loads before the first term (addresses clamped to
  the last vector, terms of vectors past the end masked to 0, so nothing is read out of bounds).
* Each word's term ``mix(w ^ (i * WORD_KEY))`` is computed in 64-bit integer registers (wrapping) and added
  to the thread's 64-bit sum.
* The last ``n % 16`` bytes (one or two words, the last zero-padded) are read byte by byte by thread 0 of CTA 0.
* Butterfly shuffles sum each warp, shared memory the warps; thread 0 adds the CTA's sum into ``out[0]``
  (a zeroed int64) with one atomic add. Integer sums do not depend on order: the result is exact.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cutlass_dsl import T

from .. import cute_utils as cu
from .config import VEC, WORD_KEY, WORD_MIX, Variant, all_variants, as_int64  # noqa: F401


KEY = as_int64(WORD_KEY)
MIX = as_int64(WORD_MIX)
LOW32 = 0xFFFFFFFF


def ld_global_v2_i64(ptr) -> tuple:
    """16-byte load of two 64-bit words (``ld.global.v2.b64``); ``ptr`` must be 16-byte aligned."""
    vec = cute.arch.load(ptr, ir.VectorType.get([2], T.i64()))
    return tuple(Int64(vector.extract(vec, [], [i])) for i in range(2))


def xs(x: Int64) -> Int64:
    """``x ^ (x >> 32)``, logical shift."""
    return x ^ ((x >> 32) & Int64(LOW32))


def term(w: Int64, i: Int64) -> Int64:
    """``mix(w ^ (i * WORD_KEY))`` mod 2**64 (moe_quant.fingerprint.word_terms)."""
    return xs(xs(w ^ (i * Int64(KEY))) * Int64(MIX))


class FingerprintKernel:
    """Host entry ``__call__(data, out, first_word, max_ctas, stream)``: ``data (n,)`` uint8 at a 16-byte
    aligned address, ``n < 2**31``; ``out (1,)`` int64, to which the sum of the terms of ``data``'s words
    (numbered from ``first_word``) is added; at most ``max_ctas`` CTAs."""

    def __init__(self, variant: Variant):
        self.v = variant
        self.threads = variant.threads
        self.iters = variant.iters

    # ------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, data: cute.Tensor, out: cute.Tensor, first_word: Int64, max_ctas: Int32, stream):
        n = Int32(data.shape[0])
        nvec = n // VEC
        per_cta = self.threads * self.iters
        n_tiles = (nvec + (per_cta - 1)) // per_cta
        grid = cutlass.max(cutlass.min(n_tiles, max_ctas), Int32(1))  # CTA 0 also reads the tail bytes
        self.kernel(data, out, first_word, n, nvec, n_tiles, grid).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    # ------------------------------------------------------------------ device

    @cute.kernel
    def kernel(self, data: cute.Tensor, out: cute.Tensor, first_word: Int64, n: Int32, nvec: Int32,
               n_tiles: Int32, grid: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        bid = Int32(bid)
        lane = tid % 32
        warp = tid // 32
        n_warps = self.threads // 32
        partial = cute.make_tensor(cute.arch.alloc_smem(Int64, n_warps, alignment=16), cute.make_layout(n_warps))
        per_cta = self.threads * self.iters
        last = cutlass.max(nvec - 1, Int32(0))

        acc = Int64(0)
        for t in cutlass.range(bid, n_tiles, grid, unroll=1):
            base = t * per_cta
            words = []
            for u in cutlass.range_constexpr(self.iters):
                v = cutlass.min(base + (u * self.threads) + tid, last)
                words.append(ld_global_v2_i64(data.iterator + Int64(v) * VEC))
            for u in cutlass.range_constexpr(self.iters):
                v = base + (u * self.threads) + tid
                i0 = first_word + Int64(v) * 2
                w0, w1 = words[u]
                s = term(w0, i0) + term(w1, i0 + 1)
                acc = acc + Int64(cutlass.select_(v < nvec, s, Int64(0)))

        # ---- the last n % 16 bytes: one or two words, the last zero-padded
        if bid == 0:
            if tid == 0:
                rem = n - nvec * VEC
                if rem > 0:
                    tail = data.iterator + Int64(nvec) * VEC
                    w0 = Int64(0)
                    w1 = Int64(0)
                    for j in cutlass.range_constexpr(VEC):
                        if j < rem:
                            byte = Int64(cu.ld_global_u8(tail + j))
                            if cutlass.const_expr(j < 8):
                                w0 = w0 | (byte << (8 * j))
                            else:
                                w1 = w1 | (byte << (8 * (j - 8)))
                    i0 = first_word + Int64(nvec) * 2
                    acc = acc + term(w0, i0)
                    if rem > 8:
                        acc = acc + term(w1, i0 + 1)

        # ---- CTA sum, one atomic add
        acc = cute.arch.warp_reduction_sum(acc)
        if lane == 0:
            partial[warp] = acc
        cute.arch.sync_threads()
        if tid == 0:
            total = Int64(0)
            for w in cutlass.range_constexpr(n_warps):
                total = total + Int64(partial[w])
            cute.arch.atomic_add(out.iterator, total)


def make_fake_args(variant: Variant, tvm_ffi: bool):
    """Placeholder arguments for ``cute.compile``: a dynamic byte count, 16-byte aligned data."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    n = cute.sym_int32(symbol="N")
    data = make_fake_compact_tensor(cutlass.Uint8, (n,), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.Int64, (1,), assumed_align=16)  # a fresh allocation (compile_cache's launch)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else make_fake_stream()
    return data, out, Int64(0), Int32(1), stream


def compile_variant(variant: Variant, tvm_ffi: bool, extra_options: str = ""):
    """``cute.compile`` one variant for the arch in ``CUTE_DSL_ARCH`` (or the local GPU)."""
    kernel = FingerprintKernel(variant)
    args = make_fake_args(variant, tvm_ffi)
    opts = " ".join(o for o in (("--enable-tvm-ffi" if tvm_ffi else ""), extra_options) if o)
    return cute.compile(kernel, *args, options=opts)
