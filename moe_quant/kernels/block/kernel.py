"""CuTe-DSL kernel: the fused quantization passes of the SwiGLU expert block (``dual``, ``swiglu``,
``dswiglu``; :mod:`moe_quant.kernels.block.config`). One source for SM90 and SM100.

Built on the colwise 32x1 kernel's K-groups tiling (:mod:`moe_quant.kernels.quantize_32x1.kernel`, whose group
scan, tile loads, transposed stores and scale-tail zeroing it reuses): a CTA owns 128 tokens of one group
(aligned to the group's start) x 128 columns; a thread holds 8 tokens x 8 columns. From those registers
it writes both forms of each output tensor:

* colwise 32x1 K-groups form: exactly as the 32x1 kernel (amax over the 4 consecutive lanes of a
  32-token block, transposed 8-token stores, one 512-byte K-groups scale tile per CTA);
* rowwise 1x32 form: a 32-column block of one token is held by lanes ``l, l^4, l^8, l^12`` (amax by two
  butterfly shuffles at offsets 4 and 8); 8-byte (e4m3) or 16-byte (bf16) stores per token. The M-groups
  blocked scale layout pads each group to 128 rows, so the CTA's 128 tokens are exactly row tile ``bx``
  (its chunk index: ``P_g = 128 * first chunk of g``) and its 128 columns exactly column tile ``by``: a
  CTA writes one whole 512-byte M-groups tile, padding rows and columns included (they hold the
  zeros the tile loads, whose scale is 0).

Tail CTAs (past the last real chunk) zero what no group covers: the colwise data and scale tails (as the
32x1 kernel), the M-groups scale rows ``[128 * chunks, M + 128 G)`` and the rowwise data rows past the
last group's end. Whatever ``offs`` holds, every write stays inside the buffers.

The ``stacked`` dSwiGLU variants (bf16 outputs) write the rowwise values of ``grad_a`` and ``grad_b`` into
columns ``[0, R)`` and ``[R, 2R)`` of one ``(M, 2R)`` buffer (``[grad_a | grad_b]``, the dx GEMM's operand of
a concatenated gate-up weight): row pitch ``2R``; the tail CTAs of output ``o`` zero the ``o``-th half of
its rows past the last group's end (one contiguous range). The other variants' code does not change.

The SwiGLU math reproduces PyTorch's CUDA ``silu`` / ``silu_backward`` and bf16 ``mul`` instruction for
instruction (kernels/block/NOTES.md): ``expf`` as libdevice's sequence (``ex2.approx.ftz`` with the
same range reduction and scaling, the ``1 + exp(-x)`` contracted into one fma), ``div.rn`` /
``rcp.rn``, a bf16 rounding (``cvt.rn``) after each PyTorch op.

``swiglu`` and ``dswiglu`` (variant fields ``staged`` and ``fast_div``, both on by default): the inputs go to
shared memory by ``cp.async`` (one commit group per token row, so row ``i`` waits for its own copies only;
no registers held while they travel), and the division and reciprocal take ptxas' own fast path without its
per-element check and branch, so the unrolled tile is one basic block whose elements the compiler interleaves.
That fast path is exact for ``a`` in [-80, bf16 max] (every bf16 value checked against PyTorch on the GPU); a
tile holding any other ``a`` (NaN, Inf, below -80) is computed again with ``div.rn`` / ``rcp.rn``. Since
2026-12-02 both also take ``lean`` (the short scale formula, the range checked by one running min) and
``dswiglu`` ``fused_grads`` (both gradients of a tile in one CTA) by default; without ``fused_grads``
neighbouring CTAs write grad_a and grad_b of one tile. Since 2026-12-03 (evening) the staged rows are laid out
so that the 8 lanes copying one token's 128 bytes write 128 contiguous bytes of shared memory, their 16-byte slots
swizzled against bank conflicts on the read-back (config ``stage_order``): with each lane's slot 64 bytes from its
neighbour's, every ``cp.async`` lane had been its own L2 request, every input sector fetched twice. ``dual`` takes
the same staging as a candidate (``staged``, off by default: its x copied and read back row by row as the SwiGLU ops'
inputs, 32 KB a CTA; the words then go to both forms as loaded words do), and with ``reread`` the forms read the
words back from the stage where they use them (:class:`StagedWords`), so the tile is not held in registers.

``tiles_per_cta`` (candidates, 2026-12-03): a CTA handles that many consecutive column tiles of its token chunk
(:meth:`QuantizeBlockKernel.one_tile` in a loop, the group record scanned once; the grid's y shrinks by that
factor, the last CTA of a row may have fewer real tiles, tail CTAs zero what they zeroed before), and the next
tile's inputs travel while this tile is computed, quantized and stored: as soon as a thread has read row i of a
staged input (its own 16-byte slots: no barrier), it copies the next tile's row i into them (one commit group per
row, so 7 groups are always newer than the row waited for; zero fills where there is no next tile). ``dswiglu``
(fused) frees a's slots as each row is read, grad_h's and b's once both outputs' tiles are read back. A redo of
the math (an ``a`` out of the fast range) reads its inputs from global memory (the stage holds the next tile).

``cols_fp8`` (dswiglu with bf16 outputs, its own variants: the block's backward on the emulated GEMM, issue 54): the
rowwise forms the bf16 values as the bf16 outputs write them, the colwise forms fp8 data as the fp8 outputs write it
(the same quantization code, each form's stores picked by its kind: ``row_fake`` and ``fake``), no M-groups scales;
so no ``round_bf16`` (which rounds both forms on the packed words). Their colwise scales are the plain K-groups ones
``(R, Mp/32)`` that the emulated GEMM's dequantization reads (``layouts.k_groups_plain_offset``), not the blocked
layout: each scale byte stored by the lane that owns it, where its 32-token block is written (tail CTAs included: their
zero blocks' scale is 0, the plain form's bytes past the last group), so no blocked scale tail to zero.

``colwise_smem`` (candidates, 2026-12-03): the colwise form's 8-token pieces go to the CTA's colwise tile in shared
memory (:func:`line_place`; dswiglu with one tile a CTA over input a's staged slots) instead of global memory, and
after a barrier :meth:`QuantizeBlockKernel.write_lines` writes each column's 128 tokens as whole 128-byte lines (16
bytes a lane, consecutive lanes in token order); the same bytes where the thread stores wrote them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.memory import SmemAllocator

from ... import layouts
from ...layouts import K_GROUP_ALIGN, TILE_BYTES, TILE_ROWS
from ...numerics import BLOCK_SIZE
from .. import cute_utils as cu
from .config import N_INPUTS, N_OUTPUTS, Variant, all_variants  # noqa: F401  (re-exported)
from ..quantize_32x1.config import HALF_COLS, TILE_COLS
from ..quantize_32x1.kernel import COLS_PER_THREAD, TILE_TOKENS, TOKENS_PER_THREAD, Quantize32x1Kernel

THREADS = 4 * 32 * (TILE_COLS // HALF_COLS)  # the 32x1 kernel's default tile: 128 columns, 256 threads

_INFO = 8  # shared words: the 32x1 group record (0..6) and, in tail CTAs, the last group's end (7)
ROW_LANES = (4, 8)  # butterfly offsets joining the 4 lanes of one token's 32-column block

# ----------------------------------------------------------------------------- SwiGLU math (PyTorch's CUDA)

# ``d = 1 + expf(-x)`` as nvcc compiles PyTorch's ``opmath_t(1) + ::exp(-x)`` (libdevice __nv_expf,
# no fast math, fmad on: the final scaling multiply and the ``1 +`` are one fma). In: x; out: d.
_ONE_PLUS_EXP_NEG = """neg.f32 n, x;
fma.rn.f32 t, n, 0f3BBB989D, 0f3F000000;
cvt.sat.f32.f32 t, t;
fma.rm.f32 j, t, 0f437C0000, 0f4B400001;
add.rn.f32 r, j, 0fCB40007F;
neg.f32 r, r;
fma.rn.f32 u, n, 0f3FB8AA3B, r;
fma.rn.f32 u, n, 0f32A57060, u;
mov.b32 jb, j;
shl.b32 jb, jb, 23;
mov.b32 sc, jb;
ex2.approx.ftz.f32 e, u;
fma.rn.f32 d, e, sc, 0f3F800000;
"""

# One element (fp32 x = a, b, g: bf16 values widened; z = 0): y = the op's fp32 result before the final
# bf16 rounding, which the caller's cvt.rn.bf16x2 does (PyTorch's __float2bfloat16, RNE).
_SILU_TIMES_B = _ONE_PLUS_EXP_NEG + """div.rn.f32 y, x, d;
cvt.rn.bf16x2.f32 hb, y, z;
mov.b32 s, hb;
mul.rn.f32 y, s, b;
"""  # h = bf16(silu(a)) * b

_GRAD_A = """mul.rn.f32 gs, g, b;
cvt.rn.bf16x2.f32 hb, gs, z;
mov.b32 gs, hb;
""" + _ONE_PLUS_EXP_NEG + """rcp.rn.f32 sg, d;
mul.rn.f32 t1, gs, sg;
sub.rn.f32 t2, 0f3F800000, sg;
fma.rn.f32 t2, x, t2, 0f3F800000;
mul.rn.f32 y, t1, t2;
"""  # grad_a = silu_backward(bf16(g * b), a): sigmoid = rcp.rn of the same denominator

_GRAD_B = _ONE_PLUS_EXP_NEG + """div.rn.f32 y, x, d;
cvt.rn.bf16x2.f32 hb, y, z;
mov.b32 s, hb;
mul.rn.f32 y, g, s;
"""  # grad_b = g * bf16(silu(a))


# ``fast_div`` (variant field): ``div.rn`` and ``rcp.rn`` as the fast path ptxas compiles them to (MUFU.RCP, one
# Newton step, for the division the residual correction), without its per-element check and branch to a slow
# path, which cut the unrolled tile into one basic block per element (nothing interleaves across them). The
# fast path is exact where a in [-80, bf16 max] (d = 1 + exp(-a) in [1, 2^116), the quotient normal), which
# the kernel checks per tile (:func:`in_fast_range`), redoing a tile outside it with div.rn / rcp.rn; and the
# quotient takes x's sign, which the residual step loses for x = -0 (-0 / d is -0).
_FAST_DIV = """rcp.approx.ftz.f32 rq, d;
neg.f32 nd, d;
fma.rn.f32 eq, nd, rq, 0f3F800000;
fma.rn.f32 rq, rq, eq, rq;
mul.rn.f32 q0, x, rq;
fma.rn.f32 eq, nd, q0, x;
fma.rn.f32 y, rq, eq, q0;
and.b32 sb, x, 0x80000000;
or.b32 y, y, sb;
"""
_FAST_RCP = """rcp.approx.ftz.f32 rq, d;
neg.f32 nd, d;
fma.rn.f32 eq, nd, rq, 0f3F800000;
fma.rn.f32 sg, rq, eq, rq;
"""
FAST_MIN, FAST_MAX = "0fC2A00000", "0f7F7F0000"  # -80 and bf16's largest finite value, as fp32


# Both gradients of one element (``fused_grads``): _GRAD_A, then _GRAD_B's division of the same ``x / d`` into yb; the
# fast form shares the reciprocal (sg is exactly the reciprocal _FAST_DIV refines: the same three instructions),
# so each result has the bits of its own element above.
_GRAD_AB = _GRAD_A + """div.rn.f32 yb, x, d;
cvt.rn.bf16x2.f32 hb, yb, z;
mov.b32 s, hb;
mul.rn.f32 yb, g, s;
"""
_FAST_DIV_SHARED = """mul.rn.f32 q0, x, sg;
fma.rn.f32 eq, nd, q0, x;
fma.rn.f32 yb, sg, eq, q0;
and.b32 sb, x, 0x80000000;
or.b32 yb, yb, sb;
"""


def _signed_residual(div: str, y: str, r: str) -> str:
    """``signed_residual`` (variant field): the fast division ``div`` (result ``y``, reciprocal ``r``) with its residual
    taken as ``d q0 - x`` and subtracted, ``y = q0 - r (d q0 - x)``: the same value as ``q0 + r (x - d q0)`` (fma rounds
    once and RN is symmetric; an exact zero residual is +0 in both, and y = q0), but -0 for x = -0 (``-0 - r * +0``)
    where the sum gives +0, so no sign fix: one instruction per element fewer."""
    old = f"fma.rn.f32 eq, nd, q0, x;\nfma.rn.f32 {y}, {r}, eq, q0;\nand.b32 sb, x, 0x80000000;\nor.b32 {y}, {y}, sb;\n"
    assert old in div, div
    new = f"neg.f32 nx, x;\nfma.rn.f32 eq, d, q0, nx;\nneg.f32 nr, {r};\nfma.rn.f32 {y}, nr, eq, q0;\n"
    return div.replace(old, new)


def _fast(element: str, signed: bool = False) -> str:
    div, shared = _FAST_DIV, _FAST_DIV_SHARED
    if signed:
        div, shared = _signed_residual(div, "y", "rq"), _signed_residual(shared, "yb", "sg")
    return (element.replace("div.rn.f32 y, x, d;\n", div).replace("rcp.rn.f32 sg, d;\n", _FAST_RCP)
            .replace("div.rn.f32 yb, x, d;\n", shared))


def _packed(element: str, inputs: tuple, outputs: int = 1) -> str:
    """PTX of ``element`` on both bf16 halves of the packed input words (named ``inputs``: any of g, x (= a), b;
    after the ``outputs`` output operands), the results (y, and yb for a second output) rounded to bf16 and packed
    into ``$0`` (and ``$1``)."""
    regs = (".reg .f32 x, n, t, j, r, u, sc, e, d, y, z, g, b, s, gs, sg, t1, t2, ylo, rq, nd, eq, q0, yb, yblo,"
            " nx, nr;\n"
            ".reg .b32 jb, hb, sb;\n")
    body = "{\n" + regs + "mov.f32 z, 0f00000000;\n"
    for half, unpack in (("lo", "shl.b32 hb, {w}, 16;"), ("hi", "and.b32 hb, {w}, 0xFFFF0000;")):
        for k, name in enumerate(inputs):
            body += unpack.format(w=f"${k + outputs}") + f"\nmov.b32 {name}, hb;\n"
        body += element
        if half == "lo":
            body += "mov.f32 ylo, y;\n" + ("mov.f32 yblo, yb;\n" if outputs == 2 else "")
    second = "cvt.rn.bf16x2.f32 $1, yb, yblo;\n" if outputs == 2 else ""
    return body + "cvt.rn.bf16x2.f32 $0, y, ylo;\n" + second + "}"


# fast: False (div.rn / rcp.rn), True (the fast path) or SIGNED (the fast path with :func:`_signed_residual`)
SIGNED = "signed"
_PTX = {(op, fast): _packed(_fast(el, fast == SIGNED) if fast else el, ins, outs) for op, el, ins, outs in (
    ("swiglu", _SILU_TIMES_B, ("x", "b"), 1), ("grad_a", _GRAD_A, ("g", "x", "b"), 1),
    ("grad_b", _GRAD_B, ("g", "x"), 1), ("grad_ab", _GRAD_AB, ("g", "x", "b"), 2))
    for fast in (False, True, SIGNED)}
assert all("div.rn" not in _PTX[op, f] and "rcp.rn" not in _PTX[op, f]
           for op in ("swiglu", "grad_a", "grad_b", "grad_ab") for f in (True, SIGNED))


def swiglu_bf16x2(a, b, fast: bool = False) -> Int32:
    """``h = bf16(bf16(silu(a)) * b)`` of two packed bf16x2 words (PyTorch's ``F.silu(a) * b``); ``fast``: the
    division's fast path only (exact for ``a`` in :func:`in_fast_range`)."""
    return cu._asm(1, [a, b], _PTX["swiglu", fast], "=r,r,r")


def grad_a_bf16x2(g, a, b, fast: bool = False) -> Int32:
    """``grad_a`` of ``h = F.silu(a) * b`` for ``grad_h = g`` (bf16x2 words): ``silu_backward(g * b, a)``."""
    return cu._asm(1, [g, a, b], _PTX["grad_a", fast], "=r,r,r,r")


def grad_b_bf16x2(g, a, fast: bool = False) -> Int32:
    """``grad_b = g * F.silu(a)`` (bf16x2 words)."""
    return cu._asm(1, [g, a], _PTX["grad_b", fast], "=r,r,r")


def grad_ab_bf16x2(g, a, b, fast: bool = False):
    """``(grad_a, grad_b)`` of :func:`grad_a_bf16x2` and :func:`grad_b_bf16x2` in one: ``exp(-a)``, its ``1 +`` and
    (``fast``) the reciprocal computed once for both (the same bits)."""
    return cu._asm(2, [g, a, b], _PTX["grad_ab", fast], "=r,=r,r,r,r")


def bf16x2_min_max(lo, hi, w):
    """Running elementwise ``min`` / ``max`` of packed bf16x2 words, a NaN propagated (``.NaN``)."""
    return (cu._asm(1, [lo, w], "min.NaN.bf16x2 $0, $1, $2;", "=r,r,r"),
            cu._asm(1, [hi, w], "max.NaN.bf16x2 $0, $1, $2;", "=r,r,r"))


def _range_check(upper: bool) -> str:
    """PTX: ``$0`` = 1 if both halves of the bf16x2 word ``$1`` are at least -80 (and with ``upper`` both halves of
    ``$2`` at most bf16's largest finite value), else 0."""
    words = 2 if upper else 1
    text = "{\n.reg .f32 " + ", ".join("abcd"[:2 * words]) + ";\n.reg .b32 t;\n.reg .pred p;\n"
    for k in range(words):
        lo, hi = "abcd"[2 * k], "abcd"[2 * k + 1]
        text += f"shl.b32 t, ${k + 1}, 16;\nmov.b32 {lo}, t;\nand.b32 t, ${k + 1}, 0xFFFF0000;\nmov.b32 {hi}, t;\n"
    text += f"setp.ge.f32 p, a, {FAST_MIN};\nsetp.ge.and.f32 p, b, {FAST_MIN}, p;\n"
    if upper:
        text += f"setp.le.and.f32 p, c, {FAST_MAX}, p;\nsetp.le.and.f32 p, d, {FAST_MAX}, p;\n"
    return text + "selp.b32 $0, 1, 0, p;\n}"


_IN_FAST_RANGE = _range_check(True)
_IN_FAST_RANGE_LO = _range_check(False)


def bf16x2_min(lo, w):
    """Running elementwise ``min`` of packed bf16x2 words (a NaN half yields to the other operand): the ``lean``
    variants' range check needs the smallest ``a`` only (:func:`in_fast_range_lo`)."""
    return cu._asm(1, [lo, w], "min.bf16x2 $0, $1, $2;", "=r,r,r")


def in_fast_range_lo(lo) -> Int32:
    """1 if both halves of the running min ``lo`` (:func:`bf16x2_min`) are at least -80, else 0. The ``lean``
    variants' check: below -80 the fast division is wrong for finite ``a`` (its reciprocal flushes to zero near
    d = 2^126); a NaN or Inf ``a`` gives a non-finite result on either path (for ``a = +Inf`` NaN where PyTorch has
    Inf), and a block holding a non-finite element is a NaN block, the same bytes (docs/design.md section 2)."""
    return cu._asm(1, [lo], _IN_FAST_RANGE_LO, "=r,r")


def in_fast_range(lo, hi) -> Int32:
    """1 if both halves of the running min ``lo`` and max ``hi`` (:func:`bf16x2_min_max`) lie in [-80, bf16
    max] (no NaN, no Inf): where the ``fast_div`` math is exact; else 0."""
    return cu._asm(1, [lo, hi], _IN_FAST_RANGE, "=r,r,r")


# ----------------------------------------------------------------------------- kernel


def stage_place(tid, order: str):
    """The 16-byte slot of thread ``tid`` within a staged row of ``THREADS`` slots (config ``stage_order``; ``tid`` an
    int or a DSL Int32). "thread": ``tid``. Otherwise lane ``4 g + q`` (column group ``g``, token quad ``q``) of warp
    ``w`` at ``32 w + 8 q + g``, the 8 lanes of one token side by side as their 128 bytes lie in global memory;
    "swizzled": ``g XOR 2 q`` in place of ``g`` (a permutation within the token's 128 bytes, so that the 8 lanes of a
    quarter warp read back from 8 distinct 16-byte bank groups)."""
    if order == "thread":
        return tid
    quad, group = tid % 4, (tid % 32) // 4
    if order == "swizzled":
        group = group ^ (quad * 2)
    return (tid // 32) * 32 + quad * 8 + group


def line_place(col, tok, esize: int = 1):
    """``colwise_smem`` (config): the byte of (column ``col``, token ``tok``) in the CTA's colwise tile in shared memory
    (``col`` < 128, ``tok`` < 128; ints or DSL Int32), of ``esize``-byte elements (1: e4m3, 2: bf16). Column ``col``'s
    128 elements (the CTA's tokens) fill row ``col`` of ``128 esize`` bytes, their pieces permuted against bank
    conflicts: e4m3, the four 32-token blocks (block ``b`` at ``b XOR (col // 8) % 4``), so that a half warp's 8-byte
    stores (4 column groups ``col // 8`` of one block, 4 token quads) fall in 4 distinct 32-byte bank groups; bf16, the
    16 8-token pieces (piece ``k`` at ``k XOR 4 ((col // 8) % 2)``), so that a quarter warp's 16-byte stores (2 column
    groups, 4 token quads) fall in 8 distinct 16-byte bank groups. Either way the lanes that read a column's 16-byte
    pieces back in order (8 a row of 128 bytes) cover each bank once."""
    group = col // COLS_PER_THREAD
    if esize == 1:
        piece = (tok // BLOCK_SIZE) ^ (group % 4)
        return col * TILE_TOKENS + piece * BLOCK_SIZE + tok % BLOCK_SIZE
    piece = (tok // TOKENS_PER_THREAD) ^ ((group % 2) * 4)
    return col * (2 * TILE_TOKENS) + piece * 16 + (tok % TOKENS_PER_THREAD) * 2


def _ld_shared_volatile(ptr, k=None) -> list:
    """Word ``k`` (``None``: all 4 words) of the 16 bytes at shared-memory ``ptr``, by a volatile ``ld.shared`` whose
    place the compiler keeps (a side effect): read again where used, never held from an earlier read."""
    addr = Int32(llvm.ptrtoint(T.i32(), ptr.llvm_ptr))
    if k is not None:
        return Int32(llvm.inline_asm(T.i32(), [addr.ir_value()], f"ld.volatile.shared.b32 $0, [$1+{4 * k}];", "=r,r",
                                     has_side_effects=True))
    st = llvm.StructType.get_literal([T.i32()] * 4)
    res = llvm.inline_asm(st, [addr.ir_value()], "ld.volatile.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                          "=r,=r,=r,=r,r", has_side_effects=True)
    return [Int32(llvm.extractvalue(T.i32(), res, [i])) for i in range(4)]


class StagedRow:
    """One token's 4 staged words (``reread``): each ``[k]`` a 4-byte read of the stage, iterating one 16-byte read."""

    def __init__(self, slot):
        self.slot = slot

    def __getitem__(self, k: int):
        return _ld_shared_volatile(self.slot, k)

    def __iter__(self):
        return iter(_ld_shared_volatile(self.slot))

    def __len__(self):
        return 4


class StagedWords:
    """``reread`` (config): the thread's staged 8 x 8 tile of input ``j`` where the forms take its words
    (``words[i][k]``, ``for w in words[i]``): each use a read of the stage, so the tile is not held in registers across
    both forms."""

    def __init__(self, kernel, stage, j: int, tid):
        self.rows = [StagedRow(kernel.stage_slot(stage, j, i, tid)) for i in range(TOKENS_PER_THREAD)]

    def __getitem__(self, i: int) -> StagedRow:
        return self.rows[i]

    def __len__(self):
        return TOKENS_PER_THREAD


class QuantizeBlockKernel(Quantize32x1Kernel):
    """The block's fused passes; see the module docstring.

    Host entry ``__call__(x0, x1, x2, rd0, rs0, cd0, cs0, rd1, rs1, cd1, cs1, offs, poffs, stream)``:
    inputs ``x0`` (``dual``: x; ``swiglu``: a; ``dswiglu``: grad_h), ``x1`` (b / a), ``x2`` (- / b), each
    ``(M, R)`` (``None`` where unused); per output tensor (``1`` only for ``dswiglu``): rowwise data
    ``(M, R)``, M-groups scales ``(M + 128 G, 4 ceil(R/128))`` uint8, colwise data ``(R, Mp)`` with
    ``Mp = round_up(M, 32) + 32 G``, K-groups scales ``(round_up(R, 128), ceil(M/32) + 4 G)`` uint8
    (scales ``None`` for bf16 outputs; ``cols_fp8``: colwise data e4m3 with its plain K-groups scales ``(R, Mp/32)``
    uint8, no M-groups scales); ``offs`` int32 ``(G,)``; ``poffs`` int32 ``(G,)`` (written).
    ``stacked``: ``rd0`` is the ``(M, 2R)`` rowwise buffer of both outputs and ``rd1`` is ``None``.
    """

    def __init__(self, variant: Variant):
        self.v = variant
        self.op = variant.op
        self.rceil = variant.mode == "rceil"
        self.in_f32 = False  # bf16 inputs only (config); read by the inherited helpers
        self.kgroups = True
        # the colwise forms' kind (bf16 values or fp8 and scales: the inherited store_tokens reads it) and the rowwise
        # forms' (config cols_fp8: dswiglu's rowwise forms bf16, its colwise forms fp8)
        self.fake = not variant.fp8_cols
        self.row_fake = variant.fake
        # cols_fp8: the colwise scales in the plain K-groups layout (layouts.k_groups_plain_offset: what the emulated
        # GEMM's dequantization reads), every byte written by the CTA whose tokens it covers (tail CTAs included)
        self.plain_cols = variant.cols_fp8
        self.fake_f32 = False
        self.n_out = N_OUTPUTS[variant.op]
        self.stacked = variant.stacked  # rowwise outputs in one (M, 2R) buffer (row pitch 2R)
        # scale bytes gathered in shared memory and written as 16-byte rows: dual with fp8 outputs (H200, 2026-11-29:
        # dual fp8 +1.0-1.5 points of memcpy; swiglu / dswiglu fp8 -0.3-0.8 then, NOTES.md), the SwiGLU ops' fp8
        # outputs with gather_scales (config)
        self.scale_tile = not variant.fake and (variant.op == "dual" or variant.gather_scales)
        self.staged, self.fast_div = variant.staged, variant.fast_div  # on for swiglu / dswiglu (config)
        # the math's fast path: _PTX's key (SIGNED: the division with the signed residual, config signed_residual)
        self.fast_kind = SIGNED if variant.signed_residual else variant.fast_div
        # both forms' amax on the packed words (max.u16x2): on for the SwiGLU ops (H200, 2026-11-29: swiglu and
        # dswiglu +1.3-2.5%; dual at two CTAs per SM -4..-11%; NOTES.md)
        self.packed_amax = variant.packed_amax
        self.lean = variant.lean  # the lean quantization and range check (config)
        self.fused = variant.fused_grads  # dswiglu: one CTA for both outputs (config)
        self.round = variant.round_bf16  # bf16 outputs rounded on the packed words (config)
        self.n_ctas = 1 if self.fused else self.n_out  # CTAs per tile
        self.n_tiles = variant.tiles_per_cta  # column tiles per CTA (config)
        self.tile_cols, self.threads, self.halves = TILE_COLS, THREADS, TILE_COLS // HALF_COLS  # inherited helpers
        # colwise_smem (config): the colwise tile gathered in shared memory, written as whole lines. dswiglu with one
        # tile a CTA gathers it over input a's staged slots (32 KB, read by then: a barrier first), the others in 16 KB
        # (e4m3) or 32 KB (bf16) of their own (the barrier first where the CTA's previous output or tile reads them)
        self.lines = variant.colwise_smem
        self.esize = 2 if self.fake else 1  # bytes of an output element
        self.lines_over_stage = self.lines and self.op == "dswiglu" and self.staged and self.n_tiles == 1
        self.lines_wait = self.lines_over_stage or self.fused or self.n_tiles > 1
        # which forms are written (config forms: swiglu's forward writes h's rowwise form alone, its backward the
        # colwise one); the other form's buffers are None, its stores, amax and tail zeroing not generated
        self.rows, self.cols = variant.rows, variant.cols

    # ------------------------------------------------------------------ host

    @cute.jit
    def __call__(self, x0: cute.Tensor, x1, x2, rd0: cute.Tensor, rs0, cd0: cute.Tensor, cs0, rd1, rs1, cd1,
                 cs1, offs: cute.Tensor, poffs: cute.Tensor, stream):
        r = x0.shape[1]
        ny = (r + (TILE_COLS - 1)) // TILE_COLS
        n_groups = Int32(offs.shape[0])
        # Mp (layouts.k_groups_padded_len): the colwise data's row length, or where none is written its formula
        row_stride = Int32(0)
        if cutlass.const_expr(self.cols):
            row_stride = Int32(cd0.shape[1])
        else:
            row_stride = layouts.k_groups_padded_len(Int32(x0.shape[0]), n_groups)
        # real chunks + tail chunks <= (Mp + 127 G + 127) / 128; one more so a tail CTA always exists
        nx = (row_stride + (TILE_TOKENS - 1) * n_groups + (TILE_TOKENS - 1)) // TILE_TOKENS + 1
        rp = Int32(0)
        sw = Int32(0)
        buf_rows = Int32(0)
        if cutlass.const_expr(not self.fake and self.cols):
            rp = Int32(cs0.shape[0])
            sw = Int32(cs0.shape[1])
        if cutlass.const_expr(not self.row_fake and self.rows):
            buf_rows = Int32(rs0.shape[0])
        self.kernel(x0, x1, x2, rd0, rs0, cd0, cs0, rd1, rs1, cd1, cs1, offs, poffs, Int32(x0.shape[0]),
                    Int32(r), n_groups, row_stride, rp, sw, buf_rows, nx, Int32(ny)).launch(
            grid=[nx * self.n_ctas, (ny + (self.n_tiles - 1)) // self.n_tiles, 1], block=[THREADS, 1, 1], stream=stream,
            # two CTAs per SM (the default): ptxas keeps to 128 registers (the 8 x 8 tile is live across both
            # forms); staged inputs take 64 or 96 KB of shared memory per CTA
            min_blocks_per_mp=self.v.ctas_per_sm, preferred_smem_carveout=100 if self.staged or self.lines else 0)

    # ------------------------------------------------------------------ device

    @cute.kernel
    def kernel(self, x0: cute.Tensor, x1, x2, rd0: cute.Tensor, rs0, cd0: cute.Tensor, cs0, rd1, rs1, cd1,
               cs1, offs: cute.Tensor, poffs: cute.Tensor, m: Int32, r: Int32, n_groups: Int32, row_stride: Int32,
               rp: Int32, sw: Int32, buf_rows: Int32, nx: Int32, ny: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        tid = Int32(tid)
        o_cta = Int32(bx) % self.n_ctas  # dswiglu: neighbouring CTAs write grad_a and grad_b of one tile
        bx = Int32(bx) // self.n_ctas
        by = Int32(by) * self.n_tiles  # the CTA's first column tile (tiles_per_cta: n_tiles of them)
        lane = tid % 32
        warp = tid // 32

        # ---- which tile (the 32x1 kernel's K-groups record), once for all the CTA's column tiles
        info = cute.make_tensor(cute.arch.alloc_smem(Int32, _INFO, alignment=16), cute.make_layout(_INFO))
        if warp == 0:
            self.scan_groups(offs, poffs, m, n_groups, lane, bx, by, info)
        cute.arch.sync_threads()
        stage = None  # staged: each input's 8 x 8 tiles, row i of thread t in 16-byte slot (8 j + i) T + stage_place(t)
        if cutlass.const_expr(self.staged):
            # dynamic shared memory (a static array is limited to 48 KB)
            stage = SmemAllocator().allocate_array(Int32, N_INPUTS[self.op] * TOKENS_PER_THREAD * THREADS * 4,
                                                   byte_alignment=16)
        ltile = None  # colwise_smem: the colwise tile, 128 elements a column (line_place)
        if cutlass.const_expr(self.lines_over_stage):
            ltile = stage + TOKENS_PER_THREAD * THREADS * 4  # input 1's (a's) slots, 32 KB
        elif cutlass.const_expr(self.lines):
            ltile = SmemAllocator().allocate_array(Int32, TILE_COLS * TILE_TOKENS * self.esize // 4,
                                                   byte_alignment=128)
        ins, outs = (x0, x1, x2), (rd0, rs0, cd0, cs0, rd1, rs1, cd1, cs1)
        sizes = (offs, m, r, n_groups, row_stride, rp, sw, buf_rows, nx, ny)
        if cutlass.const_expr(self.n_tiles == 1):
            self.one_tile(ins, outs, sizes, bx, by, Int32(0), o_cta, tid, lane, warp, info, stage, ltile)
        else:
            # tiles_per_cta: the column tiles one after the other, each tile's inputs copied during the tile before
            # (the module docstring); the last CTA of a row may have fewer real tiles
            for t in cutlass.range(0, self.n_tiles, 1, unroll=1):
                if by + t < ny:
                    self.one_tile(ins, outs, sizes, bx, by + t, t, o_cta, tid, lane, warp, info, stage, ltile)
            cute.arch.cp_async_wait_group(0)  # the last tile's copies for no next tile (zero fills) landed

    @cute.jit
    def one_tile(self, ins, outs, sizes, bx: Int32, by: Int32, t: Int32, o_cta: Int32, tid: Int32, lane: Int32,
                 warp: Int32, info, stage, ltile):
        """Column tile ``by`` of chunk ``bx``: the inputs (staged: copied by cp.async; with ``tiles_per_cta`` the
        ``t``-th of the CTA's tiles, whose copies the tile before issued, and whose math issues the next tile's), the
        math, both forms of each output, and in tail CTAs what no group covers."""
        x0, x1, x2 = ins
        offs, m, r, n_groups, row_stride, rp, sw, buf_rows, nx, ny = sizes
        chunk_total = Int32(info[5])
        src0 = Int64(0)  # first source row of the tile
        n_real = Int32(0)  # real tokens in the tile (<= 0: none)
        n_out = Int32(0)  # colwise tokens of the tile to write (real + zero padding; multiple of 32)
        out_base = Int64(0)  # colwise output element of (column 0, token 0) of the tile
        scale_base = Int64(0)  # byte of the tile's K-groups scale tile
        tail = Int32(0)
        if bx < chunk_total:
            start = Int32(info[0])
            size = Int32(info[1])
            k = bx - Int32(info[3])
            src0 = Int64(start) + Int64(k * TILE_TOKENS)
            n_real = size - k * TILE_TOKENS
            n_out = cutlass.min(cu.round_up_block(size) - k * TILE_TOKENS, Int32(TILE_TOKENS))
            out_base = Int64(info[2]) + Int64(k * TILE_TOKENS)
            tiles = (size + (TILE_TOKENS - 1)) // TILE_TOKENS
            scale_base = Int64(info[3]) * Int64(4) * Int64(rp) + Int64(TILE_BYTES) * Int64(tiles * by + k)
        else:
            tail = Int32(1)
            first = Int32(info[6]) + (bx - chunk_total) * TILE_TOKENS
            n_out = cutlass.min(row_stride - first, Int32(TILE_TOKENS))
            out_base = Int64(first)
        # M-groups row-scale tile of this CTA: row tile bx, column tile by
        mg_base = Int64(TILE_BYTES) * (Int64(bx) * Int64(ny) + Int64(by))

        # ---- this thread's 8 columns and 8 tokens (the 32x1 geometry)
        blk = warp // 2
        quad = lane % 4
        tile_col = (warp % 2) * (TILE_COLS // 2) + (lane // 4) * COLS_PER_THREAD
        col0 = by * TILE_COLS + tile_col
        t0 = blk * BLOCK_SIZE + quad * TOKENS_PER_THREAD
        col_ok = col0 < r
        write = col_ok & (blk * BLOCK_SIZE < n_out)
        # Output tensor o_cta's tile. Only its math is per output: the two forms' quantization and stores
        # below are one copy of code for both dswiglu outputs, which write through pointers picked at run
        # time (two copies, 8880 SASS instructions, overflowed the instruction cache: ncu's top stall
        # was "no instruction"; NOTES.md).
        tile = (src0, n_real, r, col0, col_ok, t0)
        # tiles_per_cta: the next tile of the CTA (its copies zero fills where there is none: no read, no branch)
        nxt = None
        if cutlass.const_expr(self.n_tiles > 1):
            nxt = (src0, n_real, r, col0 + TILE_COLS, (col0 + TILE_COLS < r) & (t + 1 < self.n_tiles), t0)
        where = (tile_col, blk, quad, lane, warp, write, tail, out_base, scale_base, mg_base, row_stride)
        tails = (offs, m, r, n_groups, chunk_total, rp, sw, buf_rows, nx, ny, bx, by, tid, info, t)
        lines = None if ltile is None else (ltile, n_out)
        if cutlass.const_expr(self.fused):
            # both gradients into the stage (grad_a over grad_h's rows, grad_b over b's), then each quantized by the
            # one copy of the code below (a loop, not unrolled)
            self.compute_both(x0, x1, x2, *tile, stage, tid, nxt, t)
            for o in cutlass.range(0, 2, 1, unroll=1):
                words = [self.staged_row(stage, 2 * o, i, tid) for i in range(TOKENS_PER_THREAD)]
                if cutlass.const_expr(nxt is not None):
                    if o == 1:  # grad_h's and b's slots read for the last time: the next tile's rows go there
                        # (their addresses from an opaque t0: hoisted out of the loop, 16 of them spilled)
                        self.stage_rows((x0, None, x2), stage, (*nxt[:5], cu.opaque(nxt[5])), tid)
                self.emit(o, words, outs, where, tile, tails, lines)
        else:
            if cutlass.const_expr(self.n_out == 1):
                words = self.compute(0, x0, x1, x2, *tile, stage, tid, nxt, t)
            else:
                words = [[Int32(0)] * 4 for _ in range(TOKENS_PER_THREAD)]
                if o_cta == 0:
                    words = self.compute(0, x0, x1, x2, *tile, stage, tid)
                else:
                    words = self.compute(1, x0, x1, x2, *tile, stage, tid)
            self.emit(o_cta, words, outs, where, tile, tails, lines)

    @cute.jit
    def emit(self, o_cta, words, outs, where, tile, tails, lines=None):
        """Output tensor ``o_cta``'s tile of this thread (``words``: 8 tokens x 4 bf16x2 words) in both forms: the
        data, the scales, and in tail CTAs what no group covers. ``lines`` (``colwise_smem``): the shared colwise tile
        and the tile's colwise tokens to write, the colwise data gathered there and written as whole lines."""
        rd0, rs0, cd0, cs0, rd1, rs1, cd1, cs1 = outs
        tile_col, blk, quad, lane, warp, write, tail, out_base, scale_base, mg_base, row_stride = where
        src0, n_real, r, col0, col_ok, t0 = tile
        offs, m, r, n_groups, chunk_total, rp, sw, buf_rows, nx, ny, bx, by, tid, info, t = tails
        row_out = self.pick(o_cta, rd0, None if self.stacked else rd1)  # stacked: both halves of one buffer
        row_sc, col_out, col_sc = self.pick(o_cta, rs0, rs1), self.pick(o_cta, cd0, cd1), self.pick(o_cta, cs0, cs1)
        # dual: both scale tiles gathered in shared memory, written as 16-byte rows after a barrier (as the 32x1
        # kernel's); swiglu and dswiglu, issue-bound, store each scale byte where it is computed (self.scale_tile)
        ctile = mtile = None
        if cutlass.const_expr(self.scale_tile):
            ctile = cute.arch.alloc_smem(cutlass.Uint8, TILE_BYTES, alignment=16)
            mtile = cute.arch.alloc_smem(cutlass.Uint8, TILE_BYTES, alignment=16)
        ltile = None  # colwise_smem: the shared colwise tile (32-bit words)
        if cutlass.const_expr(self.lines):
            ltile = lines[0]
            if cutlass.const_expr(self.lines_wait):  # the stage's or the previous output's or tile's readers done
                cute.arch.sync_threads()
        if cutlass.const_expr(self.round):  # bf16 outputs: each element rounded on the packed words (config)
            self.round_forms(o_cta, words, row_out, col_out, where, tile, ltile)
        else:
            # lean: the bytes of a NaN block's e4m3 words are replaced by the dequantization (bf16 forms): no select
            quant = dict(short=self.lean, nan_words=not (self.lean and self.fake))  # the colwise forms'
            row_quant = dict(short=self.lean, nan_words=not (self.lean and self.row_fake))
            # colwise: per column, 8 tokens of one 32-token block; the magnitudes' max of a column pair on the packed
            # words (one max.u16x2 per token for two columns)
            col_max = None
            if cutlass.const_expr(self.packed_amax):
                col_max = [cu.absmax_bf16x2([words[i][k] for i in range(TOKENS_PER_THREAD)])
                           for k in range(COLS_PER_THREAD // 2)]
            # lean with the 2-CTA register budget: the colwise store address advanced by one add per column (a 64-bit
            # pointer live across the columns: under dual's 3-CTA cap ptxas spills it on sm_100a, so there it is not;
            # nor in dswiglu's fused fp8 floor variant, where it spilled 12 / 24 bytes on sm_90a / sm_100a, 2026-12-02,
            # nor with its scale bytes gathered: 12 bytes on sm_90a, 2026-12-03)
            running = self.cols and self.lean and self.v.ctas_per_sm == 2 and not self.lines and not (
                self.fused and not self.fake and (not self.rceil or self.v.gather_scales))
            col_ptr = col_lines = None
            if cutlass.const_expr(self.lines):  # column c is 128 c elements further (line_place: the same permutation
                col_lines = ltile + self.line_word(tile_col, t0)  # for the thread's 8 columns)
            if cutlass.const_expr(running):
                col_ptr = col_out + (out_base + Int64(col0) * Int64(row_stride) + Int64(t0))  # column 0's 8 tokens
            flat = self.v.flat_scales  # fp8, SwiGLU ops: predicated scale stores at constant offsets (config)
            row_flat = flat and not self.row_fake and self.rows  # cols_fp8: the colwise scale bytes alone
            col_sc0 = row_sc0 = None
            if cutlass.const_expr(not self.cols):  # forms "rows": no colwise scale bytes
                if cutlass.const_expr(row_flat):
                    row_sc0 = row_sc + (mg_base + Int64(cu.tile_byte(t0, (warp % 2) * 2 + lane // 16)))
            elif cutlass.const_expr(self.plain_cols):  # the thread's first scale byte; column c's Mp/32 c bytes further
                col_sc0 = col_sc + layouts.k_groups_plain_offset(Int64(col0), out_base + Int64(blk * BLOCK_SIZE),
                                                                 Int64(row_stride))
            elif cutlass.const_expr(flat):
                # the thread's first scale byte of each form; its 8 columns' (tokens') bytes follow 16 bytes apart
                # (tile_byte: 16 (r % 32) + ..., and r % 32 + 7 < 32 for the 8 columns or tokens of a thread); in the
                # gathered tiles (gather_scales) at the same offsets
                if cutlass.const_expr(self.scale_tile):
                    col_sc0 = ctile + cu.tile_byte(tile_col, blk)
                    row_sc0 = mtile + cu.tile_byte(t0, (warp % 2) * 2 + lane // 16)
                else:
                    col_sc0 = col_sc + (scale_base + Int64(cu.tile_byte(tile_col, blk)))
                    if cutlass.const_expr(row_flat):
                        row_sc0 = row_sc + (mg_base + Int64(cu.tile_byte(t0, (warp % 2) * 2 + lane // 16)))
            for c in cutlass.range_constexpr(COLS_PER_THREAD if self.cols else 0):  # (forms "rows": none)
                col = [self.col_value(words[i], c) for i in range(TOKENS_PER_THREAD)]
                amax = None  # column c's half of its pair's packed max, widened (or quantize_block8's own)
                if cutlass.const_expr(self.packed_amax):
                    amax = self.col_value([col_max[c // 2]], c % 2)
                q0, q1, s, is_nan = cu.quantize_block8(col, self.rceil, amax=amax, **quant)
                if cutlass.const_expr(self.lines):  # every column and token of the tile (written out predicated)
                    self.store_tokens(col_lines + c * (TILE_TOKENS * self.esize // 4), q0, q1, s, is_nan)
                elif write:
                    if cutlass.const_expr(running):  # the next column's row of the colwise output: one add
                        self.store_tokens(col_ptr, q0, q1, s, is_nan)
                    else:
                        self.store_tokens(col_out + (out_base + Int64(col0 + c) * Int64(row_stride) + Int64(t0)),
                                          q0, q1, s, is_nan)
                if cutlass.const_expr(running):
                    col_ptr = col_ptr + Int64(row_stride)
                if cutlass.const_expr(self.plain_cols):
                    # the plain scales have no padding rows or columns: the bytes of the tile's columns and 32-token
                    # blocks (write), tail CTAs' too (their blocks are zero tokens: scale 0, the plain form's zeros
                    # past the last group)
                    if write & (quad == c // 2):
                        cu.st_global_u8(col_sc0 + layouts.k_groups_plain_offset(Int64(c), Int64(0), Int64(row_stride)),
                                        s)
                elif cutlass.const_expr(flat):
                    if (tail == 0) & (quad == c // 2):
                        cu.st_global_u8(col_sc0 + 16 * c, s)
                elif cutlass.const_expr(not self.fake):
                    if tail == 0:
                        if quad == c // 2:
                            rr = tile_col + c
                            byte = cu.tile_byte(rr, blk)
                            if cutlass.const_expr(self.scale_tile):
                                cu.st_global_u8(ctile + byte, s)
                            else:
                                cu.st_global_u8(col_sc + (scale_base + Int64(byte)), s)
            # rowwise: per token, 8 columns of one 32-column block (forms "cols": none)
            for i in cutlass.range_constexpr(TOKENS_PER_THREAD if self.rows else 0):
                amax = None
                if cutlass.const_expr(self.packed_amax):
                    row_max = cu.absmax_bf16x2(words[i])
                    amax = cutlass.max(row_max << 16, row_max & Int32(-65536))
                q0, q1, s, is_nan = cu.quantize_block8(self.row_values(words[i]), self.rceil, ROW_LANES, amax=amax,
                                                       **row_quant)
                if col_ok & (t0 + i < n_real):
                    dst = self.row_element(o_cta, src0 + Int64(t0 + i), r, col0)
                    if cutlass.const_expr(self.row_fake):
                        cu.st_global_words(row_out + dst, cu.dequantize8(q0, q1, s, is_nan, False))
                    else:
                        cu.st_global_v2(row_out + dst, q0, q1)
                if cutlass.const_expr(row_flat):
                    if (tail == 0) & ((lane // 4) % 4 == i // 2):  # one lane of the block's four writes its scale
                        cu.st_global_u8(row_sc0 + 16 * i, s)
                elif cutlass.const_expr(not self.row_fake):
                    if tail == 0:
                        if (lane // 4) % 4 == i // 2:  # one lane of the block's four writes its scale
                            rr = t0 + i
                            byte = cu.tile_byte(rr, (warp % 2) * 2 + lane // 16)
                            if cutlass.const_expr(self.scale_tile):
                                cu.st_global_u8(mtile + byte, s)
                            else:
                                cu.st_global_u8(row_sc + (mg_base + Int64(byte)), s)
        if cutlass.const_expr(self.lines):  # the scale rows below go out after the same barrier
            cute.arch.sync_threads()
            self.write_lines(col_out, lines, out_base, row_stride, r, by, tid)
        if cutlass.const_expr(self.scale_tile):
            if tail == 0:
                if cutlass.const_expr(not self.lines):
                    cute.arch.sync_threads()
                if warp == 0:
                    self.write_scale_rows(col_sc, ctile, scale_base, Int32(0), lane)
                if warp == 1:
                    self.write_scale_rows(row_sc, mtile, mg_base, Int32(0), lane)
                # the next output's or tile's bytes go there (colwise_smem: its barrier first, lines_wait)
                if cutlass.const_expr(not self.lines and (self.fused or self.n_tiles > 1)):
                    cute.arch.sync_threads()
        if tail != 0:
            self.zero_tails(o_cta, row_out, row_sc, col_sc, offs, m, r, n_groups, chunk_total, rp, sw, buf_rows,
                            ny, (bx - chunk_total) * ny + by, (nx - chunk_total) * ny, tid, lane, warp, info, t)

    def line_word(self, col, tok):
        """``colwise_smem``: the 32-bit word of (``col``, ``tok``) in the shared colwise tile (:func:`line_place`)."""
        return line_place(col, tok, self.esize) // 4

    @cute.jit
    def write_lines(self, col_out, lines, out_base: Int64, row_stride: Int32, r: Int32, by: Int32, tid: Int32):
        """``colwise_smem``: the CTA's colwise tile (``lines``: the shared tile, :func:`line_place`, and the tile's
        colwise tokens to write, a multiple of 32) into its columns' rows of the colwise output, 16 bytes a lane, so
        8 lanes (e4m3) or 16 (bf16) a column: its 128 contiguous elements (one or two whole 128-byte lines). Columns
        past R and tokens past the count are not written (where the thread's 8-token stores did not write either)."""
        ltile, n_out = lines
        per = 16 // self.esize  # tokens a lane
        lanes = TILE_TOKENS // per  # lanes a column
        if cutlass.const_expr(self.fused and self.fake):
            # the addresses from an opaque tid: hoisted out of the loop over the two outputs, they were kept live
            # across it and spilled (16 bytes, dswiglu bf16); elsewhere it costs ~130 SASS instructions and no spill
            tid = cu.opaque(tid)
        p = tid % lanes
        for s in cutlass.range_constexpr(TILE_COLS * lanes // THREADS):
            cc = s * (THREADS // lanes) + tid // lanes
            if (by * TILE_COLS + cc < r) & (p * per < n_out):
                w = cu.ld_global_v4(ltile + self.line_word(cc, p * per))
                cu.st_global_v4(col_out + (out_base + Int64(by * TILE_COLS + cc) * Int64(row_stride) + Int64(p * per)),
                                *w)

    def grid_maxima(self, words, again: bool = False):
        """Per token (rowwise) and per column pair over the tokens (colwise), the packed max of this thread's
        magnitudes (``max.u16x2`` of ``w & 0x7FFF7FFF``). ``again`` (the exception path): the magnitudes by inline
        PTX, so that the compiler cannot reuse the first pass' values there and keep them live across the stores."""
        row_max, col_max = [], []
        for i in range(TOKENS_PER_THREAD):
            if again:
                mags = [cu._asm(1, [w], "and.b32 $0, $1, 0x7FFF7FFF;", "=r,r") for w in words[i]]
            else:
                mags = [w & 0x7FFF7FFF for w in words[i]]
            row_max.append(cu.max_u16x2(cu.max_u16x2(mags[0], mags[1]), cu.max_u16x2(mags[2], mags[3])))
            col_max = mags if i == 0 else [cu.max_u16x2(a, b) for a, b in zip(col_max, mags)]
        return row_max, col_max

    def row_amax2(self, row_max, j: int):
        """The amax of the rowwise blocks of tokens 2 j (low half) and 2 j + 1 (high half), joined over the 4 lanes
        of each block (shuffles: every lane of the warp runs it)."""
        a, b = row_max[2 * j], row_max[2 * j + 1]
        return cu.quad_max_u16x2(cu.max_u16x2(cu.prmt(a, b, 0x5410), cu.prmt(a, b, 0x7632)), ROW_LANES)

    @cute.jit
    def round_forms(self, o_cta, words, row_out, col_out, where, tile, ltile=None):
        """``round_bf16``: both forms' bf16 values of output ``o_cta``'s tile (``words``), each element rounded to its
        block's e4m3 grid on the packed words (:data:`cute_utils._GRID`), the blocks' amax on the packed words too.
        Every block is stored rounded; where a lane of the warp holds a block that :func:`cute_utils.grid_exception`
        flags (rare: non-finite, huge or tiny amax), the warp finds the amaxes again (:meth:`round_exceptions`)."""
        tile_col, blk, quad, lane, warp, write, tail, out_base, scale_base, mg_base, row_stride = where
        src0, n_real, r, col0, col_ok, t0 = tile
        row_max, col_max = self.grid_maxima(words)
        hi = lo = None
        # the rowwise rows by one add each from the first (with fused_grads, per-token addresses hoisted out of the
        # loop over the two outputs spilled in the stacked variant)
        row_ptr = None
        if cutlass.const_expr(self.rows):
            row_ptr = row_out + self.row_element(o_cta, src0 + Int64(t0), r, col0)
        pitch = Int64(r) * Int64(2 if self.stacked else 1)
        n_left = n_real - t0  # the thread's real tokens
        # rowwise: tokens 2 j and 2 j + 1 (forms "cols": none)
        for j in cutlass.range_constexpr(TOKENS_PER_THREAD // 2 if self.rows else 0):
            amax2 = self.row_amax2(row_max, j)
            hi, lo = cu.grid_track(hi, lo, amax2)
            t2, sat2 = cu.grid_params(amax2, self.rceil)
            for h in cutlass.range_constexpr(2):
                i = 2 * j + h
                sel = 0x1010 if h == 0 else 0x3232  # the half, in both halves
                tt = cu.prmt(t2, t2, sel)
                st = None if sat2 is None else cu.prmt(sat2, sat2, sel)
                ys = [cu.grid_bf16x2(w, tt, st) for w in words[i]]  # reread: one 16-byte read
                if col_ok & (n_left > i):
                    cu.st_global_words(row_ptr, ys)
                row_ptr = row_ptr + pitch
        if cutlass.const_expr(self.cols):  # not for forms "rows"
            if cutlass.const_expr(ltile is None):
                col_ptr = col_out + (out_base + Int64(col0) * Int64(row_stride) + Int64(t0))  # column 0's 8 tokens
                hi, lo = self.round_columns(words, col_max, col_ptr, row_stride, write, hi, lo)
            else:  # colwise_smem: every column and token into the shared tile (written out predicated)
                hi, lo = self.round_columns(words, col_max, ltile + self.line_word(tile_col, t0),
                                            Int32(TILE_TOKENS // 2), True, hi, lo)
        if cute.arch.vote_any_sync(cu.grid_any_exception(hi, lo)):
            self.round_exceptions(o_cta, words, row_out, col_out, where, tile, ltile)

    @cute.jit
    def round_exceptions(self, o_cta, words, row_out, col_out, where, tile, ltile=None):
        """The blocks of this thread that :func:`cute_utils.grid_exception` flags, quantized and dequantized from their
        amax (found again: the whole warp runs this) and stored over the rounded values."""
        tile_col, blk, quad, lane, warp, write, tail, out_base, scale_base, mg_base, row_stride = where
        src0, n_real, r, col0, col_ok, t0 = tile
        row_max, col_max = self.grid_maxima(words, again=True)
        row_amax = [self.row_amax2(row_max, j) for j in range(TOKENS_PER_THREAD // 2)]
        col_amax = [cu.quad_max_u16x2(c, (1, 2)) for c in col_max]
        quant = dict(short=self.lean, nan_words=False)  # dequantize8 replaces a NaN block's words
        # addresses by one add per row or column, as in round_forms (no per-token address hoisted out of a loop)
        row_ptr = None
        if cutlass.const_expr(self.rows):
            row_ptr = row_out + self.row_element(o_cta, src0 + Int64(t0), r, col0)
        pitch = Int64(r) * Int64(2 if self.stacked else 1)
        n_left = n_real - t0  # the thread's real tokens
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD if self.rows else 0):
            amax16 = (row_amax[i // 2] >> (16 * (i % 2))) & Int32(0xFFFF)
            if cu.grid_exception(amax16) & col_ok & (n_left > i):
                q0, q1, s, is_nan = cu.quantize_block8(self.row_values(words[i]), self.rceil, (), amax=amax16 << 16,
                                                       **quant)
                cu.st_global_words(row_ptr, cu.dequantize8(q0, q1, s, is_nan, False))
            row_ptr = row_ptr + pitch
        if cutlass.const_expr(self.cols):  # not for forms "rows"
            if cutlass.const_expr(ltile is None):
                col_ptr = col_out + (out_base + Int64(col0) * Int64(row_stride) + Int64(t0))
                self.round_column_exceptions(words, col_amax, col_ptr, row_stride, write)
            else:  # colwise_smem: over the rounded values in the shared tile, before the barrier that writes it out
                self.round_column_exceptions(words, col_amax, ltile + self.line_word(tile_col, t0),
                                             Int32(TILE_TOKENS // 2), True)

    def pick(self, o, t0, t1):
        """The data pointer of output ``o``'s buffer: ``t0``'s or ``t1``'s (``o`` a run-time value; ``t1``
        ``None``: ``t0``'s), ``None`` where the buffer does not exist (a bf16 output's scales)."""
        if cutlass.const_expr(t0 is None):
            return None
        if cutlass.const_expr(t1 is None):
            return t0.iterator
        addr = cutlass.select_(o == 0, t0.iterator.toint(), t1.iterator.toint())
        return cute.make_ptr(t0.element_type, addr, cute.AddressSpace.gmem, assumed_align=16)

    def row_element(self, o, row: Int64, r: Int32, col0: Int32) -> Int64:
        """Element index of ``(row, col0)`` of output ``o``'s rowwise data: its own ``(M, R)`` buffer, or
        (``stacked``) columns ``[o R, (o + 1) R)`` of the one ``(M, 2R)`` buffer."""
        if cutlass.const_expr(self.stacked):
            return row * (Int64(r) * Int64(2)) + (Int64(o) * Int64(r) + Int64(col0))
        return row * Int64(r) + Int64(col0)

    @cute.jit
    def load_words(self, x, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok, t0: Int32):
        """8 tokens x 8 columns as loaded: per token 4 bf16x2 words, zeros where the token or column is not
        real. Kept packed: the tile is live across both forms."""
        words = []
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
            a0 = a1 = a2 = a3 = Int32(0)
            if col_ok & (t0 + i < n_real):
                a0, a1, a2, a3 = cu.ld_global_v4(x.iterator + ((src0 + Int64(t0 + i)) * Int64(r) + Int64(col0)))
            words.append([a0, a1, a2, a3])
        return words

    def row_values(self, row_words) -> list:
        """One token's 8 columns as fp32 bit patterns (the rowwise pass). Unpacked with ``prmt`` rather than
        the colwise pass' shifts, so the compiler cannot merge the two unpacks into 64 live registers."""
        out = []
        for w in row_words:
            out += [cu._asm(1, [w], "prmt.b32 $0, $1, 0, 0x1044;", "=r,r"),
                    cu._asm(1, [w], "prmt.b32 $0, $1, 0, 0x3244;", "=r,r")]
        return out

    def stage_row(self, x, stage, j: int, i: int, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok,
                  t0: Int32, tid: Int32):
        """Row ``i`` (8 columns) of input ``j``'s tile copied to ``stage`` by ``cp.async`` (zeros where the token
        or column is not real: nothing read there)."""
        ok = col_ok & (t0 + i < n_real)
        src = x.iterator + cutlass.select_(ok, (src0 + Int64(t0 + i)) * Int64(r) + Int64(col0), Int64(0))
        cu.cp_async_16(self.stage_slot(stage, j, i, tid), src, cutlass.select_(ok, Int32(16), Int32(0)))

    def staged_row(self, stage, j, i: int, tid: Int32) -> list:
        """Row ``i`` of input ``j``'s staged tile: 4 bf16x2 words (``j`` may be a run-time value)."""
        return list(cu.ld_global_v4(self.stage_slot(stage, j, i, tid)))

    @cute.jit
    def compute(self, o: cutlass.Constexpr, x0, x1, x2, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok,
                t0: Int32, stage, tid: Int32, nxt=None, t=None):
        """Output tensor ``o``'s 8 x 8 tile of this thread, packed as loaded (bf16x2 words); zeros past the tile's
        real tokens and columns (every op maps zeros to zeros). ``staged``: the inputs go to shared memory first
        and are read a row at a time; ``fast_div``: the math without its division's slow path, the tile redone
        with it where an ``a`` lies outside the fast path's range. ``nxt`` (``tiles_per_cta``): the next tile of the
        CTA, whose rows are copied into each staged row's slots as soon as it is read (so the stage no longer holds
        this tile for a redo: that reads the inputs again from global memory); the copies of the CTA's first tile
        (``t`` = 0) are issued here, the others' during the tile before."""
        tile = (src0, n_real, r, col0, col_ok, t0)
        if cutlass.const_expr(self.op == "dual" and not self.staged):
            return self.load_words(x0, *tile)
        xs = [x0, x1, x2][:self.inputs_of(o)]
        loaded = None
        if cutlass.const_expr(self.staged):
            if cutlass.const_expr(nxt is None):
                self.stage_rows(xs, stage, tile, tid)
            else:
                if t == 0:
                    self.stage_rows(xs, stage, tile, tid)
        else:
            loaded = [self.load_words(x, *tile) for x in xs]
        if cutlass.const_expr(self.v.reread):  # dual: both forms read the words back from the stage where they use them
            cute.arch.cp_async_wait_group(0)
            return StagedWords(self, stage, 0, tid)
        out, ok = self.math(o, loaded, stage, tid, self.fast_kind, True, xs, nxt)
        if cutlass.const_expr(self.fast_div):
            if ok == 0:  # an a below -80, Inf or NaN in the tile: div.rn / rcp.rn (inputs read again)
                if cutlass.const_expr(self.staged and nxt is None):
                    out, _ = self.math(o, loaded, stage, tid, False, False)
                else:
                    out, _ = self.math(o, [self.load_words(x, *tile) for x in xs], stage, tid, False, False)
        return out

    def stage_rows(self, xs, stage, tile, tid: Int32):
        """The thread's 8 rows of each input of ``xs`` (``None``: not copied) into its stage slots by ``cp.async``, one
        commit group per row (row i waits for its own copies)."""
        for i in range(TOKENS_PER_THREAD):
            for j in range(len(xs)):
                if xs[j] is not None:
                    self.stage_row(xs[j], stage, j, i, *tile, tid)
            cute.arch.cp_async_commit_group()

    def inputs_of(self, o: int) -> int:
        """How many of the op's inputs output ``o`` reads: dual x; swiglu a, b; dswiglu's grad_a g, a, b, its grad_b
        g, a."""
        return N_INPUTS[self.op] if self.op != "dswiglu" else 3 - o

    def math(self, o: int, loaded, stage, tid: Int32, fast: bool, first: bool, xs=None, nxt=None):
        """The op's 8 x 8 output words (``dual``: the input's words) from the inputs (``loaded``: per input the 8 rows
        of words; ``None``: read from ``stage``, on the ``first`` pass each row after its own copies), and with
        ``fast`` whether every ``a`` is in the fast path's range (Int32 1 / 0). ``nxt`` (staged, first pass): the next
        tile, whose row i of each input of ``xs`` is copied into row i's slots once they are read (a thread reads only
        the slots it copied to, so no barrier), one commit group per row: 7 groups are always newer than the row
        waited for."""
        a_in = 0 if self.op == "swiglu" else 1  # which input is a
        n_in = self.inputs_of(o)
        lo = hi = None
        out = []
        for i in range(TOKENS_PER_THREAD):
            prefetch = loaded is None and first and nxt is not None
            if loaded is None and first:
                cute.arch.cp_async_wait_group(TOKENS_PER_THREAD - 1 - (0 if prefetch else i))
            v = [self.staged_row(stage, j, i, tid) if loaded is None else loaded[j][i] for j in range(n_in)]
            if prefetch:
                for j in range(n_in):
                    self.stage_row(xs[j], stage, j, i, *nxt, tid)
                cute.arch.cp_async_commit_group()
            row = []
            for k in range(4):
                if fast:
                    if lo is None:
                        lo = hi = v[a_in][k]
                    elif self.lean:
                        lo = bf16x2_min(lo, v[a_in][k])
                    else:
                        lo, hi = bf16x2_min_max(lo, hi, v[a_in][k])
                if self.op == "dual":  # staged: the input's words as they are
                    row.append(v[0][k])
                elif self.op == "swiglu":
                    row.append(swiglu_bf16x2(v[0][k], v[1][k], fast))
                elif o == 0:
                    row.append(grad_a_bf16x2(v[0][k], v[1][k], v[2][k], fast))
                else:
                    row.append(grad_b_bf16x2(v[0][k], v[1][k], fast))
            out.append(row)
        if not fast:
            return out, Int32(1)
        return out, (in_fast_range_lo(lo) if self.lean else in_fast_range(lo, hi))

    def stage_slot(self, stage, j, i: int, tid: Int32):
        """The address of row ``i`` of input ``j``'s staged tile of thread ``tid`` (``j`` may be a run-time value):
        16-byte slot ``(8 j + i) T + p`` with ``p`` the thread's place in its row (config ``stage_order``)."""
        return stage + ((j * TOKENS_PER_THREAD + i) * THREADS + stage_place(tid, self.v.stage_order)) * 4

    @cute.jit
    def load_row(self, x, i: int, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok, t0: Int32):
        """Row ``i`` (8 columns) of the thread's tile of ``x`` from global memory: 4 words, zeros where the token or
        column is not real."""
        a0 = a1 = a2 = a3 = Int32(0)
        if col_ok & (t0 + i < n_real):
            a0, a1, a2, a3 = cu.ld_global_v4(x.iterator + ((src0 + Int64(t0 + i)) * Int64(r) + Int64(col0)))
        return [a0, a1, a2, a3]

    @cute.jit
    def compute_both(self, x0, x1, x2, src0: Int64, n_real: Int32, r: Int32, col0: Int32, col_ok, t0: Int32, stage,
                     tid: Int32, nxt=None, t=None):
        """``fused_grads``: grad_a and grad_b of this thread's tile into the stage, each row over the staged rows of
        grad_h (input 0: grad_a) and b (input 2: grad_b) as soon as they are read (every thread touches its own
        slots only: no barrier). Where an ``a`` of the tile lies below the fast path's range, the tile is computed
        again with div.rn / rcp.rn from the inputs read again from global memory, a row at a time. ``nxt``
        (``tiles_per_cta``): the next tile of the CTA, whose row i of ``a`` is copied into row i's slot of ``a`` once it
        is read (grad_h's and b's rows follow once both outputs are read back, in the caller), one commit group per row
        (7 groups are always newer than the row waited for); the copies of the CTA's first tile (``t`` = 0) are issued
        here, the others' during the tile before."""
        tile = (src0, n_real, r, col0, col_ok, t0)
        xs = [x0, x1, x2]
        if cutlass.const_expr(nxt is None):
            self.stage_rows(xs, stage, tile, tid)
        else:
            if t == 0:
                self.stage_rows(xs, stage, tile, tid)
        lo = None
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
            cute.arch.cp_async_wait_group(TOKENS_PER_THREAD - 1 - (0 if nxt is not None else i))
            v = [self.staged_row(stage, j, i, tid) for j in range(3)]
            if cutlass.const_expr(nxt is not None):
                self.stage_row(x1, stage, 1, i, *nxt, tid)
                cute.arch.cp_async_commit_group()
            for k in cutlass.range_constexpr(4):
                lo = v[1][k] if lo is None else bf16x2_min(lo, v[1][k])  # the lean check (fused implies lean)
            self.store_both(v, stage, i, tid, self.fast_kind)
        if in_fast_range_lo(lo) == 0:  # an a below -80 in the tile: div.rn / rcp.rn
            for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
                self.store_both([self.load_row(x, i, *tile) for x in xs], stage, i, tid, False)

    def store_both(self, v, stage, i: int, tid: Int32, fast: bool):
        """Row ``i``'s grad_a and grad_b words from its input words ``v`` (grad_h, a, b) into input 0's and input 2's
        stage slots."""
        ga, gb = [], []
        for k in range(4):
            wa, wb = grad_ab_bf16x2(v[0][k], v[1][k], v[2][k], fast)
            ga.append(wa)
            gb.append(wb)
        cu.st_global_v4(self.stage_slot(stage, 0, i, tid), *ga)
        cu.st_global_v4(self.stage_slot(stage, 2, i, tid), *gb)

    @cute.jit
    def zero_tails(self, o, rd, rs, cs, offs, m: Int32, r: Int32, n_groups: Int32,
                   chunk_total: Int32, rp: Int32, sw: Int32, buf_rows: Int32, ny: Int32, q: Int32, n_tail: Int32,
                   tid: Int32, lane: Int32, warp: Int32, info, t: Int32):
        """Tail CTAs (``q`` of ``n_tail``): zero the rowwise data rows past the last group's end, the M-groups
        scale rows past the last group's tiles and the K-groups scale tail of output tensor ``o``
        (``stacked``: the ``o``-th half of the rows past the end of the one ``(M, 2R)`` rowwise buffer).
        ``fused_grads`` (both outputs in one CTA): the end is found for output 0 and kept for output 1 (written
        once, behind a barrier); ``tiles_per_cta``: for the CTA's first tile ``t`` = 0 and kept for the others."""
        if cutlass.const_expr(self.rows):  # (forms "cols": no rowwise form)
            find = Int32(1)
            if cutlass.const_expr(self.fused):
                find = Int32(cutlass.select_(o == 0, Int32(1), Int32(0)))
            if cutlass.const_expr(self.n_tiles > 1):
                find = find & Int32(cutlass.select_(t == 0, Int32(1), Int32(0)))
            if find != 0:
                if warp == 0:  # the last group's sanitized end: clamp(max(offs), 0, M)
                    mx = Int32(0)
                    for sub in cutlass.range(0, (n_groups + 31) // 32, 1):
                        g = sub * 32 + lane
                        if g < n_groups:
                            mx = cutlass.max(mx, cutlass.min(Int32(offs[g]), m))
                    for d in cutlass.range_constexpr(5):
                        mx = cutlass.max(mx, cute.arch.shuffle_sync_bfly(mx, offset=16 >> d))
                    if lane == 0:
                        info[7] = mx
                cute.arch.sync_threads()
            end = Int32(info[7])
            esize = 2 if self.row_fake else 1
            step = 16 // esize
            if cutlass.const_expr(self.stacked):
                # rows [end, M) of the (M, 2R) buffer: one contiguous range of (M - end) R / 4 16-byte stores
                # (bf16), half of them per output, as many as one unstacked output's (R % 32 == 0: both halves
                # aligned, the count even)
                n16 = Int32((Int64(m) - Int64(end)) * Int64(r) // Int64(8))
                e_first = Int64(end) * (Int64(r) * Int64(2)) + Int64(o) * Int64(n16) * Int64(step)
                for w in cutlass.range(q * THREADS + tid, n16, n_tail * THREADS):
                    cu.st_global_v4(rd + (e_first + Int64(w) * Int64(step)), 0, 0, 0, 0)
            else:
                # rowwise data rows [end, M): 16-byte stores (R % 32 == 0 keeps them aligned)
                first = Int64(end) * Int64(r) * Int64(esize)
                n16 = Int32((Int64(m) * Int64(r) * Int64(esize) - first) // 16)
                for w in cutlass.range(q * THREADS + tid, n16, n_tail * THREADS):
                    e0 = Int64(end) * Int64(r) + Int64(w) * Int64(step)
                    cu.st_global_v4(rd + e0, 0, 0, 0, 0)
            if cutlass.const_expr(not self.row_fake):
                # M-groups scale rows [128 chunk_total, buf_rows): 4-byte stores (a row is 4 ny bytes)
                s_first = Int64(chunk_total) * Int64(TILE_ROWS) * Int64(4) * Int64(ny)
                n4 = Int32((Int64(buf_rows) * Int64(4) * Int64(ny) - s_first) // 4)
                for w in cutlass.range(q * THREADS + tid, n4, n_tail * THREADS):
                    cu.st_global_u32(rs + (s_first + Int64(w) * Int64(4)), 0)
        # (plain scales: the tail CTAs' blocks, emit)
        if cutlass.const_expr(not self.fake and not self.plain_cols and self.cols):
            self.zero_scale_tail(cs, chunk_total, rp, sw, q, n_tail, tid)


def make_fake_args(variant: Variant, tvm_ffi: bool):
    """Placeholder arguments for ``cute.compile``: dynamic M, R (R % 32 == 0), Mp, G, scale shapes (and with
    ``stacked``, the width of the ``(M, 2R)`` rowwise buffer, ``rd1`` None)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int32(symbol="M")
    r = cute.sym_int32(divisibility=BLOCK_SIZE, symbol="R")
    mp = cute.sym_int32(divisibility=K_GROUP_ALIGN, symbol="Mp")
    g = cute.sym_int32(symbol="G")
    in_dtype = cu.CUTLASS_DTYPES[variant.in_dtype]
    out_dtype = cu.CUTLASS_DTYPES[variant.out_dtype]  # the rowwise forms'
    col_dtype = cu.CUTLASS_DTYPES["float8_e4m3fn" if variant.fp8_cols else variant.out_dtype]

    def mat(dtype, rows, cols):
        return make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=16)

    ins = [mat(in_dtype, m, r) if i < N_INPUTS[variant.op] else None for i in range(3)]
    outs = []
    for o in range(2):
        if o >= N_OUTPUTS[variant.op]:
            outs += [None] * 4
            continue
        rs = cs = None
        if not variant.fake:
            rs = mat(cutlass.Uint8, cute.sym_int32(symbol=f"RS{o}_rows"), cute.sym_int32(symbol=f"RS{o}_cols"))
        if variant.fp8_cols:
            cs = mat(cutlass.Uint8, cute.sym_int32(symbol=f"CS{o}_rows"), cute.sym_int32(symbol=f"CS{o}_cols"))
        rd = mat(out_dtype, m, r)
        if variant.stacked:  # one (M, 2R) rowwise buffer for both outputs, passed as rd0
            rd = mat(out_dtype, m, cute.sym_int32(divisibility=2 * BLOCK_SIZE, symbol="R2")) if o == 0 else None
        cd = mat(col_dtype, r, mp)
        if not variant.rows:  # forms "cols": no rowwise buffers
            rd = rs = None
        if not variant.cols:  # forms "rows": no colwise buffers
            cd = cs = None
        outs += [rd, rs, cd, cs]
    offs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    poffs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True) if tvm_ffi else make_fake_stream()
    return (*ins, *outs, offs, poffs, stream)


def compile_variant(variant: Variant, tvm_ffi: bool, extra_options: str = ""):
    """``cute.compile`` one variant for the arch in ``CUTE_DSL_ARCH`` (or the local GPU)."""
    kernel = QuantizeBlockKernel(variant)
    args = make_fake_args(variant, tvm_ffi)
    opts = " ".join(o for o in (("--enable-tvm-ffi" if tvm_ffi else ""), extra_options) if o)
    return cute.compile(kernel, *args, options=opts)


# ----------------------------------------------------------------------------- the SwiGLU math alone (tests)


class SwiGLUMathKernel:
    """The block kernel's SwiGLU math alone, elementwise over packed bf16x2 words (``int32`` tensors): ``out =
    swiglu(a, b)``, ``grad_a(g, a, b)`` or ``grad_b(g, a)``, or one of the two outputs of the ``fused_grads``
    variants' shared math (``grad_a_fused``, ``grad_b_fused``: :func:`grad_ab_bf16x2`). The quantized outputs of the
    block kernel cannot show every bit of ``h``; this kernel runs the same PTX, so tests compare it with PyTorch's
    CUDA silu for every bf16 value (tests/test_kernel_block_gpu.py). ``path``: ``"plain"`` (div.rn / rcp.rn),
    ``"fast"`` (the ``fast_div`` variants' math: the fast path where both ``a`` of a word are in
    :func:`in_fast_range`, else plain), ``"lean"`` (the ``lean`` variants': the fast path where both ``a`` are at
    least -80, :func:`in_fast_range_lo`), ``"lean_signed"`` (the same with the ``signed_residual`` division) or
    ``"fast_only"`` (the fast path everywhere, to show where it would be wrong)."""

    THREADS = 256
    PATHS = ("plain", "fast", "lean", "fast_only", "lean_signed")
    OPS = ("swiglu", "grad_a", "grad_b", "grad_a_fused", "grad_b_fused")

    def __init__(self, op: str, path: str = "plain"):
        self.op = op
        self.path = path

    @cute.jit
    def __call__(self, g: cute.Tensor, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, stream):
        n = Int32(out.shape[0])
        self.kernel(g, a, b, out, n).launch(grid=[(n + (self.THREADS - 1)) // self.THREADS, 1, 1],
                                             block=[self.THREADS, 1, 1], stream=stream)

    def element(self, g, a, b, fast: bool):
        if cutlass.const_expr(self.op == "swiglu"):
            return swiglu_bf16x2(a, b, fast)
        if cutlass.const_expr(self.op == "grad_a"):
            return grad_a_bf16x2(g, a, b, fast)
        if cutlass.const_expr(self.op in ("grad_a_fused", "grad_b_fused")):
            return grad_ab_bf16x2(g, a, b, fast)[0 if self.op == "grad_a_fused" else 1]
        return grad_b_bf16x2(g, a, fast)

    @cute.kernel
    def kernel(self, g: cute.Tensor, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, n: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = Int32(bid) * self.THREADS + Int32(tid)
        if i < n:
            gw, aw, bw = Int32(g[i]), Int32(a[i]), Int32(b[i])
            if cutlass.const_expr(self.path == "plain"):
                out[i] = self.element(gw, aw, bw, False)
            elif cutlass.const_expr(self.path == "fast_only"):
                out[i] = self.element(gw, aw, bw, True)
            elif cutlass.const_expr(self.path in ("lean", "lean_signed")):
                fast = SIGNED if self.path == "lean_signed" else True
                out[i] = cutlass.select_(in_fast_range_lo(aw) != 0, self.element(gw, aw, bw, fast),
                                         self.element(gw, aw, bw, False))
            else:
                out[i] = cutlass.select_(in_fast_range(aw, aw) != 0, self.element(gw, aw, bw, True),
                                         self.element(gw, aw, bw, False))


_MATH_COMPILED: dict = {}


def run_swiglu_math(op: str, g, a, b, path: str = "plain"):
    """``op`` (:attr:`SwiGLUMathKernel.OPS`) of bf16 CUDA tensors with an even number of elements, through
    :class:`SwiGLUMathKernel` (``path``) on the local GPU (compiled once per op, path and process: tests only)."""
    import torch
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack

    if path not in SwiGLUMathKernel.PATHS:
        raise ValueError(f"path must be one of {SwiGLUMathKernel.PATHS}, got {path!r}")
    if op not in SwiGLUMathKernel.OPS:
        raise ValueError(f"op must be one of {SwiGLUMathKernel.OPS}, got {op!r}")
    words = [t.contiguous().view(torch.int32) for t in (g, a, b)]
    out = torch.empty_like(words[1])
    args = [from_dlpack(t, assumed_align=4).mark_layout_dynamic() for t in (*words, out)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    if (op, path) not in _MATH_COMPILED:
        _MATH_COMPILED[op, path] = cute.compile(SwiGLUMathKernel(op, path), *args, stream)
    _MATH_COMPILED[op, path](*args, stream)
    return out.view(torch.bfloat16).view(a.shape)
