"""Configuration of the SwiGLU expert block's fused quantization kernel (no cutlass import).

One kernel, three ops (docs/design.md, "The SwiGLU expert block"; :mod:`moe_quant.block_quantize`):

* ``dual`` -- ``x (M, R)`` read once; written in the rowwise 1x32 form (``(M, R)``, M-groups blocked
  scales) and the colwise 32x1 K-groups form (``(R, Mp)``, K-groups blocked scales). Its ``cols_fp8`` variants
  (bf16 outputs: the block's forward on the emulated GEMM) write the rowwise bf16 values beside the colwise form in
  fp8 and plain K-groups scales (what the block keeps of x).
* ``swiglu`` -- ``a``, ``b`` read once; ``h = silu(a) * b`` (PyTorch's CUDA silu, instruction for
  instruction: kernels/block/NOTES.md) written in both forms, ``h`` itself never; its ``forms`` variants write one
  form alone (the block's forward the rowwise one, its backward the colwise one).
* ``dswiglu`` -- ``grad_h``, ``a``, ``b`` read once; ``grad_a`` and ``grad_b`` of the SwiGLU written in
  both forms each. Its ``stacked`` variants (bf16 outputs only: the emulated GEMM of a concatenated gate-up
  weight) write the two rowwise forms as ``[grad_a | grad_b]``, the two halves of one ``(M, 2R)`` buffer
  (row pitch ``2R``); every other variant's code is unchanged by the flag. Its ``cols_fp8`` variants (bf16 outputs:
  the emulated GEMM's backward) write the colwise forms in fp8 and K-groups scales beside bf16 rowwise forms.

Output kinds: ``float8_e4m3fn`` (data + e8m0 scales, the scaled GEMM's operands) or ``bfloat16``
(the dequantized values, no scales: the emulated GEMM's operands).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OPS = ("dual", "swiglu", "dswiglu")
SWIGLU_OPS = ("swiglu", "dswiglu")  # the ops with SwiGLU inputs and math (staged, fast_div)
# bf16 only: the SwiGLU inputs are GEMM outputs; fp32 activations (fp32 models) take the 1x32 and 32x1
# kernels instead (a fp32 8 x 8 tile live across both forms needs more than 128 registers)
IN_DTYPES = ("bfloat16",)
OUT_DTYPES = ("float8_e4m3fn", "bfloat16")
MODES = ("rceil", "floor")
N_INPUTS = {"dual": 1, "swiglu": 2, "dswiglu": 3}
N_OUTPUTS = {"dual": 1, "swiglu": 1, "dswiglu": 2}  # tensors written in both forms
STAGE_ORDERS = ("thread", "row", "swizzled")  # the staged inputs' shared-memory layout (Variant.stage_order)
TILES_PER_CTA = (1, 2, 4)  # tiles_per_cta choices
CTAS_PER_SM = (2, 3, 4)  # min_blocks_per_mp choices (the defaults and the dual candidates, compile-checked in CI)
FORMS = ("both", "rows", "cols")  # Variant.forms: which forms of the op's outputs are written


@dataclass(frozen=True)
class Variant:
    """Everything that changes the generated code of the block kernel (the compile-cache key, with the arch)."""

    op: str  # "dual" | "swiglu" | "dswiglu"
    in_dtype: str  # "bfloat16"
    mode: str  # "rceil" | "floor"
    out_dtype: str = "float8_e4m3fn"  # or "bfloat16": dequantized values, no scales
    stacked: bool = False  # dswiglu, bf16 only: both rowwise outputs in one (M, 2R) buffer (row pitch 2R)
    # None: the op's default (both on for the SwiGLU ops since 2026-11-29, H200 A/B below; off for dual, whose staged
    # candidates `dstage*` are not yet measured; fast_div: swiglu / dswiglu only)
    staged: bool | None = None  # inputs copied to shared memory by cp.async (one commit group per row), read per row
    fast_div: bool | None = None  # silu's division and sigmoid's reciprocal without ptxas' per-element branch
    # None: the op's default. Both forms' amax on the packed bf16x2 words (max.u16x2); on for the SwiGLU ops
    packed_amax: bool | None = None
    ctas_per_sm: int = 2  # the launch's register cap: 2 -> 128 registers a thread (256 threads a CTA), 3 -> 80, 4 -> 64
    # None: the op's default, on for the SwiGLU ops since 2026-12-02 (the A/B on the H200 below, CANDIDATES), off for
    # dual (its lean-c3 candidate not yet measured). Fewer instructions, the same bytes (kernels/block/NOTES.md,
    # 2026-12-02): each block's scale in 7 instructions instead of 17 and its reciprocal in one, no NaN select of the
    # e4m3 words that bf16 outputs replace anyway, colwise store addresses advanced per column (at 2 CTAs per SM), and
    # (swiglu / dswiglu) the fast division's range checked by one running min (a below -80); non-finite a take the
    # fast path (their outputs are non-finite either way, and a block holding any non-finite element is NaN)
    lean: bool | None = None
    # dswiglu only: one CTA computes both grad_a and grad_b of its tile (exp(-a) and the reciprocal once for both,
    # grad_h and a read once), the two tiles parked in shared memory (over the staged inputs) and quantized one
    # after the other by one copy of the quantization code. None: on for dswiglu where staged, fast_div and lean
    # hold (the default since 2026-12-02, the A/B below), else off
    fused_grads: bool | None = None
    # bf16 outputs (the default since 2026-12-03, the A/Bs below): the dequantized bf16 value of an element is the
    # element rounded (RNE) to its block's e4m3 grid, which the block's amax gives: per packed bf16x2 word and form one
    # bf16 addition and subtraction of 24 * 2^max(e, k-6) and the sign (5 instructions; 7 in floor mode, its 448 2^k
    # saturation), instead of the quantize-dequantize sequence per element and form. A block whose amax is non-finite,
    # at least 2^124 or in (0, 2^-108) is quantized and dequantized as before (cute_utils._GRID, kernels/block/NOTES.md,
    # 2026-12-03). None: on for bf16 outputs
    round_bf16: bool | None = None
    # swiglu / dswiglu with fast_div (the default since 2026-12-03): the fast division's residual taken as d q0 - x and
    # subtracted (the same quotient; x = -0 gives -0 by itself): no sign fix, one instruction per element fewer
    # (kernel.py _signed_residual). None: on where fast_div is
    signed_residual: bool | None = None
    # swiglu / dswiglu with fp8 outputs (the default since 2026-12-03): each scale byte by one store predicated on the
    # lane that owns it, at a constant offset from the form's first byte of the thread (the scale bytes of a thread's
    # 8 columns, and of its 8 tokens, lie 16 bytes apart in the blocked tile), instead of a branch per block around its
    # address arithmetic (kernels/block/NOTES.md, 2026-12-03). None: on for the SwiGLU ops' fp8 outputs
    flat_scales: bool | None = None
    # staged SwiGLU inputs: where a thread's 16-byte slot of a row lies in shared memory. "thread" (the default before
    # 2026-12-03, evening): slot tid of the row, so the 8 lanes that copy one token's 128 contiguous bytes (lanes q, q +
    # 4, ..., q + 28) write 64 bytes apart; ncu on one H200 counted then one L2 request per lane of each cp.async and
    # every input sector fetched twice (swiglu: 31.1M sectors read for 17.3M of input). "row": those 8 lanes' slots
    # adjacent (128 contiguous bytes a token, as in global memory: one request per 4 sectors; the read-back
    # ld.shared.v4 then meets 4-way bank conflicts); "swizzled": the same 128 bytes with the 16-byte slots permuted
    # (column group XOR 2 x token quad), so the read-back is free of bank conflicts too. Each thread reads back only its
    # own slots in every layout. None: "swizzled" where staged (the default since the A/B on the H200, kernels/block/
    # NOTES.md: swiglu bf16 66.9-71.8 -> 89.7-94.6% of memcpy), else "thread"
    stage_order: str | None = None
    # swiglu / dswiglu with fp8 outputs (candidate `gather`; level or slower on 2026-12-03, NOTES.md): the scale bytes
    # gathered in shared memory (the CTA's K-groups and M-groups tiles, 512 bytes each) and written as 16-byte rows
    # after a barrier, as dual's fp8 outputs always are (kernel.py ``scale_tile``), instead of one-byte global stores
    # (each a partial-sector L2 write). Lost 0.3-0.8 points of memcpy on 2026-11-29, when the kernels were issue-bound.
    # None: off
    gather_scales: bool | None = None
    # staged inputs (candidates `t2`, `t4`, measured 2026-12-03 evening, NOTES.md; dual's `dstage-t2`, `dstage-t4`, not
    # yet measured): one CTA handles this many consecutive column tiles of its token chunk (the group record read once),
    # and the next tile's inputs travel (cp.async, into the slots just read) while this tile is computed, quantized and
    # stored (kernel.py's docstring; dswiglu with fused_grads only: its input a's slots free as each row is read,
    # grad_h's and b's once both outputs' words are read back). The same bytes: only the order of the work changes. 1:
    # one tile a CTA. None: 4 for staged swiglu with fp8 outputs (the default since 2026-12-03 night, after its
    # sanitizer run; the A/B of that evening at SWIGLU_T4 below), else 1
    tiles_per_cta: int | None = None
    # every op and output kind (candidates `cw-smem` for fp8 outputs, `cw-smem-bf16` for bf16; measured 2026-12-03
    # night, NOTES.md: fp8 outputs 1-12 points slower, bf16 level but dual's +0.2-0.8): the CTA's colwise tile (128
    # columns x 128 tokens, 16 KB e4m3 / 32 KB bf16) gathered in shared memory (kernel.py ``line_place``: each column's
    # tokens in one row, its pieces permuted against bank conflicts) and written after a barrier by 16-byte stores, 8
    # (e4m3) or 16 (bf16) lanes a column: each column's 128 contiguous elements (the CTA's tokens) whole 128-byte lines,
    # 4 sectors a request, instead of the thread's 8-token stores that put one sector (e4m3; bf16: two) of each of 8
    # columns in a request (ncu, one H200: dual fp8 wrote 9.03M sectors in 6.38M requests). dswiglu with one tile a CTA
    # gathers over its staged input a's slots (32 KB, free once the math has read them); the others take 16 / 32 KB more
    # shared memory. None: off
    colwise_smem: bool | None = None
    # dual with staged inputs, one tile a CTA (candidates `dreread*`; slower everywhere, 2026-12-03 night, NOTES.md):
    # the tile is not held in registers across both forms; each form reads the words it uses back from the stage where
    # it uses them (kernel.py ``StagedWords``: volatile ld.shared), so ptxas keeps far fewer live (78 instead of 125
    # with round_bf16)
    reread: bool = False
    # dswiglu with bf16 outputs (the emulated GEMM's): the colwise forms (w1's and w3's weight-gradient operands) in
    # fp8 e4m3, as the fp8 outputs write them (the 32x1 kernel's bytes), with plain K-groups scales (R, Mp/32) (the
    # form the emulated GEMM's dequantization reads: no unblocking on the host side, issue 54's follow-up), the rowwise
    # forms the bf16 values as ever: the backward keeps each colwise form at H + H/32 bytes a padded row instead of 2H
    # until its weight gradient's GEMM dequantizes it (issue 54: the fused block's peak is its second dx GEMM, where
    # both are alive). Both forms quantized from the packed words (no round_bf16), each colwise scale byte by one store
    # predicated on the lane that owns it (flat_scales' kind of store, at the plain layout's offsets). dual with bf16
    # outputs likewise (the block's forward on the emulated GEMM, issue 54): x's rowwise bf16 values (w1's and w3's
    # forward operand) and the colwise form the block keeps of x, in one read of x instead of a 1x32 and a 32x1 pass.
    # Its own variants (all_variants), not a candidate: the op writes other buffers
    cols_fp8: bool = False
    # swiglu only: the forms of h written. "both" (the tests' and benchmarks' op); "rows" (the block's forward: w2's
    # forward operand alone, its colwise form made again in the backward) and "cols" (the backward: w2's weight-gradient
    # operand alone), issue 54: each drops the other form's stores, 2 (bf16) or 1 + 1/32 (fp8) bytes an element of h,
    # its amax and rounding code, and its tail zeroing. Its own variants (all_variants), not a candidate: the op writes
    # other buffers
    forms: str = "both"

    family = "block"
    kernel_module = "block.kernel"  # compiled by compile_cache.compile_variant (never imported here)
    # modules the kernel builds on (names relative to moe_quant; part of the disk-cache hash)
    kernel_deps = ("kernels.quantize_32x1.kernel", "kernels.quantize_32x1.config")

    def __post_init__(self):
        for name, allowed in (("op", OPS), ("in_dtype", IN_DTYPES), ("mode", MODES), ("out_dtype", OUT_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cols_fp8 and (self.op not in ("dual", "dswiglu") or self.out_dtype != "bfloat16"):
            raise ValueError(f"cols_fp8 writes fp8 colwise forms beside bf16 rowwise ones: op must be 'dual' or "
                             f"'dswiglu' with out_dtype 'bfloat16', got {self.op!r} with {self.out_dtype!r}")
        if self.forms not in FORMS:
            raise ValueError(f"forms must be one of {FORMS}, got {self.forms!r}")
        if self.forms != "both" and self.op != "swiglu":
            raise ValueError(f"forms 'rows' / 'cols' write one form of h: op must be 'swiglu', got {self.op!r}")
        if self.cols_fp8 and (self.round_bf16 or self.gather_scales or self.colwise_smem):
            raise ValueError(f"cols_fp8 quantizes both forms from the words and stores its colwise scale bytes where "
                             f"they are made: round_bf16, gather_scales and colwise_smem must be off, got round_bf16="
                             f"{self.round_bf16}, gather_scales={self.gather_scales}, colwise_smem={self.colwise_smem}")
        if self.stacked and (self.op != "dswiglu" or self.out_dtype != "bfloat16"):
            raise ValueError(f"stacked rowwise outputs exist for op 'dswiglu' with bfloat16 outputs only, got "
                             f"{self.op!r} with {self.out_dtype!r}")
        if self.stage_order not in (None, *STAGE_ORDERS):
            raise ValueError(f"stage_order must be one of {STAGE_ORDERS}, got {self.stage_order!r}")
        if self.ctas_per_sm not in CTAS_PER_SM:
            raise ValueError(f"ctas_per_sm must be one of {CTAS_PER_SM}, got {self.ctas_per_sm!r}")
        for name in ("staged", "fast_div", "packed_amax", "lean"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.op in SWIGLU_OPS)
        if self.stage_order is None:
            object.__setattr__(self, "stage_order", "swizzled" if self.staged else "thread")
        swiglu = self.op in SWIGLU_OPS
        for name, default in (("round_bf16", self.fake and not self.cols_fp8), ("signed_residual", self.fast_div),
                              ("flat_scales", swiglu and self.fp8_cols), ("gather_scales", False),
                              ("colwise_smem", False)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.tiles_per_cta is None:
            object.__setattr__(self, "tiles_per_cta", 4 if self.op == "swiglu" and self.staged and not self.fake else 1)
        if self.fused_grads is None:
            fused = self.op == "dswiglu" and self.staged and self.fast_div and self.lean
            object.__setattr__(self, "fused_grads", fused)
        if self.fused_grads and not (self.op == "dswiglu" and self.staged and self.fast_div and self.lean):
            raise ValueError("fused_grads computes both dswiglu outputs from the staged inputs with the fast division "
                             f"and the lean range check: op must be 'dswiglu' with staged, fast_div and lean, got "
                             f"{self.op!r} (staged={self.staged}, fast_div={self.fast_div}, lean={self.lean})")
        if self.round_bf16 and self.out_dtype != "bfloat16":
            raise ValueError(f"round_bf16 rounds the dequantized bf16 outputs: out_dtype must be 'bfloat16', got "
                             f"{self.out_dtype!r}")
        if self.flat_scales and (not self.fp8_cols or self.op not in SWIGLU_OPS):
            raise ValueError(f"flat_scales stores the fp8 outputs' scale bytes of the SwiGLU ops: op must be 'swiglu' or "
                             f"'dswiglu' with out_dtype 'float8_e4m3fn' (or cols_fp8), got {self.op!r} with "
                             f"{self.out_dtype!r}")
        if self.gather_scales and (self.fake or self.op not in SWIGLU_OPS):
            raise ValueError(f"gather_scales gathers the fp8 outputs' scale bytes of the SwiGLU ops (dual's always are): "
                             f"op must be 'swiglu' or 'dswiglu' with out_dtype 'float8_e4m3fn', got {self.op!r} with "
                             f"{self.out_dtype!r}")
        if self.tiles_per_cta not in TILES_PER_CTA:
            raise ValueError(f"tiles_per_cta must be one of {TILES_PER_CTA}, got {self.tiles_per_cta!r}")
        if self.tiles_per_cta != 1 and not (self.staged and (self.op in ("dual", "swiglu") or self.fused_grads)):
            raise ValueError(f"tiles_per_cta overlaps the next tile's staged inputs with this tile's work: op 'dual' or "
                             f"'swiglu' with staged, or 'dswiglu' with fused_grads, got {self.op!r} (staged="
                             f"{self.staged}, fused_grads={self.fused_grads})")
        if self.reread and not (self.op == "dual" and self.staged and self.tiles_per_cta == 1):
            raise ValueError(f"reread reads dual's words back from its stage for each form: op 'dual' with staged and "
                             f"tiles_per_cta 1, got {self.op!r} (staged={self.staged}, tiles_per_cta="
                             f"{self.tiles_per_cta})")
        if self.signed_residual and not self.fast_div:
            raise ValueError(f"signed_residual changes the fast division: it needs fast_div (op 'swiglu' or "
                             f"'dswiglu'), got op {self.op!r} with fast_div={self.fast_div}")
        if self.stage_order != "thread" and not self.staged:
            raise ValueError(f"stage_order lays out the staged inputs: it needs staged, got op {self.op!r} with "
                             f"staged={self.staged}")
        if self.fast_div and self.op == "dual":
            raise ValueError("fast_div changes the SwiGLU ops' math: op must be 'swiglu' or 'dswiglu', got 'dual'")

    @property
    def fake(self) -> bool:
        """The rowwise forms are bf16 values (no scales); the colwise ones too unless :attr:`cols_fp8`."""
        return self.out_dtype != "float8_e4m3fn"

    @property
    def rows(self) -> bool:
        """The rowwise forms are written (:attr:`forms`)."""
        return self.forms != "cols"

    @property
    def cols(self) -> bool:
        """The colwise forms are written (:attr:`forms`)."""
        return self.forms != "rows"

    @property
    def fp8_cols(self) -> bool:
        """The colwise forms are fp8 data and K-groups scales: fp8 outputs, or ``cols_fp8``."""
        return not self.fake or self.cols_fp8

    @property
    def key(self) -> str:
        return (f"{self.op}-{self.in_dtype}-{self.mode}-{self.out_dtype}" + ("-stacked" if self.stacked else "")
                + ("-staged" if self.staged else "") + ("-fastdiv" if self.fast_div else "")
                + ("" if self.packed_amax == (self.op in SWIGLU_OPS) else "-pamax" if self.packed_amax else "-nopamax")
                + (f"-c{self.ctas_per_sm}" if self.ctas_per_sm != 2 else "") + ("-fused" if self.fused_grads else "")
                + ("-lean" if self.lean else "") + ("-round" if self.round_bf16 else "")
                + ("-sres" if self.signed_residual else "") + ("-flat" if self.flat_scales else "")
                + ("" if self.stage_order == "thread" else f"-stage{self.stage_order}")
                + ("-gather" if self.gather_scales else "")
                + (f"-t{self.tiles_per_cta}" if self.tiles_per_cta != 1 else "") + ("-reread" if self.reread else "")
                + ("-cwsmem" if self.colwise_smem else "") + ("-fp8cols" if self.cols_fp8 else "")
                + ("" if self.forms == "both" else f"-{self.forms}only"))

    def replace(self, **kw) -> "Variant":
        return dataclasses.replace(self, **kw)


def all_variants() -> list[Variant]:
    return ([Variant(op, i, m, o) for op in OPS for i in IN_DTYPES for m in MODES for o in OUT_DTYPES]
            + [Variant("dswiglu", i, m, "bfloat16", stacked=True) for i in IN_DTYPES for m in MODES]
            + [Variant("dswiglu", i, m, "bfloat16", stacked=s, cols_fp8=True) for i in IN_DTYPES for m in MODES
               for s in (False, True)]
            + [Variant("dual", i, m, "bfloat16", cols_fp8=True) for i in IN_DTYPES for m in MODES]
            + [Variant("swiglu", i, m, o, forms=f) for i in IN_DTYPES for m in MODES for o in OUT_DTYPES
               for f in FORMS[1:]])


# A/B candidates of the SwiGLU ops (scripts/ab_kernels.py, families block-*): name -> fields that differ from the
# default. Compile-checked for every arch (compile_check) for both ops and both output kinds (rceil). Each names every
# field it changes, since Variant.replace keeps the default's resolved fields (lean, fused_grads among them).
# Measured on one H200 (2026-11-29, 3 interleaved rounds, NOTES.md): staged + fast_div (the default since) against
# the registers form (the default before) +1.1..+3.4 points of memcpy with bf16 outputs, +0.4..+2.5 with fp8;
# staged alone -4..-5 points. fast_div without staged is not a candidate: ptxas spills 16 bytes in swiglu's fp8
# variant, and its loads in flight fall (2026-11-28, NOTES.md: "Division without ptxas' per-element branch").
# lean (the default since 2026-12-02): the lean quantization and range check (the field's comment above). One H200
# (torch 2.11, 2026-12-02, `ab_kernels.py --family block-swiglu,block-dswiglu --candidates lean,fused-lean --rounds
# 3`, bf16 outputs, % of memcpy, median of 3 interleaved rounds, every candidate byte-exact), swiglu at 98304x1408 /
# 98304x2048 / 16384x2048 / 16384x7168: 62.1 / 62.6 / 65.6 / 64.7 (pre-lean, the default before) -> 64.0 / 64.4 /
# 67.9 / 66.5 (lean). "pre-lean" keeps the former default measurable.
# The fields the defaults of 2026-12-03 turned on, turned off: each former default's candidate names them, so that it
# compiles to the code it was measured as.
CW_SMEM = {"colwise_smem": True}  # the colwise tile written as whole lines (candidates cw-smem, cw-smem-bf16, ...)
# The staged inputs' layout before the swizzled default of 2026-12-03 (evening), named by every former default.
PRE_STAGE = {"stage_order": "thread", "tiles_per_cta": 1}
PRE_1203 = {"round_bf16": False, "signed_residual": False, "flat_scales": False, **PRE_STAGE}
# The staged inputs' layout (stage_order): "pre-stage" (the former default's, "thread") and "srow" (the 8 slots of a
# token adjacent without the swizzle), both output kinds. One H200 (2026-12-03, `ab_kernels.py --family block-swiglu,
# block-dswiglu,block-swiglu-fp8,block-dswiglu-fp8 --candidates default,srow,sswz --rounds 3`, the default then
# "thread"), % of memcpy at 98304x1408 / 98304x2048 / 16384x2048 / 16384x7168: swiglu bf16 66.9 / 67.1 / 71.8 / 68.7
# ("thread") -> 89.3 / 89.8 / 94.7 / 92.9 (row) -> 89.7 / 90.2 / 94.6 / 92.9 (swizzled); dswiglu bf16 68.1 / 68.3 /
# 74.1 / 69.6 -> 84.4 / 85.6 / 91.6 / 89.4 -> 88.0 / 88.0 / 95.5 / 91.0; swiglu fp8 54.6 / 54.7 / 56.8 / 56.3 -> 71.4 /
# 71.6 / 74.8 / 75.6 -> 73.1 / 73.4 / 77.1 / 77.3; dswiglu fp8 55.7 / 56.0 / 61.4 / 58.7 -> 63.3 / 63.6 / 67.3 / 66.3
# -> 76.6 / 76.3 / 82.5 / 80.6.
STAGE_CANDIDATES = {"pre-stage": PRE_STAGE, "srow": {"stage_order": "row"}}
CANDIDATES = {"default": {},
              "registers": {"staged": False, "fast_div": False, "lean": False, "fused_grads": False, **PRE_1203},
              "staged-plain-div": {"fast_div": False, "lean": False, "fused_grads": False, **PRE_1203},
              "pre-lean": {"lean": False, "fused_grads": False, **PRE_1203},
              # the default with 2 / 4 column tiles per CTA, the next tile's inputs in flight during this tile's math
              # and stores (tiles_per_cta; measured 2026-12-03 evening, NOTES.md; t4 swiglu fp8's default since)
              "t2": {"tiles_per_cta": 2}, "t4": {"tiles_per_cta": 4}}

# dswiglu's own. fused_grads with lean (the default since 2026-12-02: one CTA for both outputs), the same H200 run
# and shapes: 52.4 / 52.3 / 58.9 / 54.7 (pre-lean) -> 54.8 / 54.7 / 61.5 / 56.9 (lean-unfused: lean, two CTAs) ->
# 66.4 / 66.5 / 73.4 / 68.8 (the default). The stacked variant (bf16 outputs of a concatenated gate-up weight) of each
# candidate with the default's staged inputs and fast division is compile-checked and byte-tested too.
DSWIGLU_CANDIDATES = {**CANDIDATES, "lean-unfused": {"fused_grads": False, **PRE_1203}}

# The defaults since 2026-12-03 (the fields' comments above; NOTES.md "2026-12-03"): bf16 outputs round_bf16 with
# signed_residual, fp8 outputs flat_scales with signed_residual. Main path per element of the op's input (static SASS,
# sm_90a, rceil): swiglu bf16 43.0 -> 31.5, dswiglu bf16 71.5 -> ~50.2, swiglu fp8 39.2 -> 34.9. One H200 (torch 2.11,
# 2026-12-03, `ab_kernels.py --family block-swiglu,block-dswiglu --candidates default,pre-round,round,sres --rounds 3`,
# then the -fp8 families with default,pre-flat,flat,sres; % of memcpy, median of 3 interleaved rounds at 98304x1408 /
# 98304x2048 / 16384x2048 / 16384x7168, every candidate byte-exact): swiglu bf16 64.1 / 64.4 / 69.7 / 67.1
# (pre-round, the default before) -> 66.8 / 66.9 / 73.5 / 68.8, dswiglu bf16 66.8 / 66.6 / 72.8 / 68.9 -> 68.5 /
# 68.1 / 74.4 / 69.1 (round alone the same, sres alone the same as pre-round); swiglu fp8 52.1 / 52.1 / 55.1 / 54.3
# (pre-flat) -> 54.6 / 54.5 / 58.2 / 56.7 (flat alone 0.1-0.5 below), dswiglu fp8 55.7 / 54.7 / 59.8 / 56.7 -> 56.2 /
# 56.2 / 60.6 / 58.5. "round", "flat" and "sres" are each field alone, against today's default (its swizzled stage
# included; they were measured with the "thread" stage).
# "cw-smem-bf16" (measured 2026-12-03 night: level): the default with its colwise bf16 tile written as whole lines
# (colwise_smem).
SWIGLU_BF16_CANDIDATES = {"pre-round": PRE_1203, "round": {"signed_residual": False}, "sres": {"round_bf16": False},
                          "cw-smem-bf16": CW_SMEM}
# "gather": the default with its scale bytes gathered in shared memory (gather_scales). "cw-smem" (measured with
# "cw-gather" on 2026-12-03 night, NOTES.md: 1-4 points slower): the default with its colwise e4m3 tile written as whole
# lines (colwise_smem; swiglu's default takes 4 tiles a CTA: its tile in 16 KB more shared memory); "cw-gather" with the
# scale bytes gathered too (their 16-byte rows written after the barrier the colwise tile already waits on: gather's own
# barrier saved).
SWIGLU_FP8_CANDIDATES = {"pre-flat": PRE_1203, "flat": {"signed_residual": False}, "sres": {"flat_scales": False},
                         "gather": {"gather_scales": True}, "cw-smem": CW_SMEM,
                         "cw-gather": {"gather_scales": True, **CW_SMEM}}
# swiglu with fp8 outputs: 4 column tiles per CTA (tiles_per_cta) the default since 2026-12-03 night; "pre-t4" the
# default before (one tile a CTA). One H200 (torch 2.11, 2026-12-03 evening, `ab_kernels.py --family block-swiglu-fp8
# --candidates default,t2,t4,gather --rounds 3`, the swizzled stage, every candidate byte-exact), % of memcpy at
# 98304x1408 / 98304x2048 / 16384x2048 / 16384x7168: 73.2 / 73.5 / 78.8 / 78.0 (one tile) -> 82.5 / 80.6 / 78.2 / 86.4
# (t4); t2 and t4 lost 1-11 points on the other ops and outputs (NOTES.md). memcheck and racecheck over
# `scripts/sanitize_block.py --quick --candidate t4`: 0 errors, 0 hazards (2026-12-03 night). "pre-t4-cw-smem"
# (2026-12-03 night: 72.7 / 72.7 / 78.1 / 76.9): colwise_smem on one tile a CTA (cw-smem is on t4).
SWIGLU_T4 = {"pre-t4": {"tiles_per_cta": 1}, "pre-t4-cw-smem": {"tiles_per_cta": 1, **CW_SMEM}}


# A/B candidates of ``dual`` with bf16 outputs (scripts/ab_kernels.py, family block-dual). The packed amax alone
# made dual 4-11% slower on one H200 (2026-11-29, NOTES.md): ptxas gave it 108-110 registers, two CTAs per SM
# instead of the default's three (80 registers); "packed-c3" caps it at three: level with the default within the
# spread (+0.0..+0.4 points of memcpy, one H200, 2026-11-29 evening, NOTES.md). With fp8 outputs that cap spills
# 8 bytes (ptxas, sm_90a), so those have no such candidate. "lean-c3" (2026-12-02, not yet measured): the lean
# quantization under the 3-CTA cap (80 registers, no spills, both outputs; uncapped ptxas takes 96-102: two CTAs).
# round_bf16 (the default with bf16 outputs since 2026-12-03): main path per element 28.3 -> 11.9 instructions at 128
# registers, so two CTAs per SM instead of three (under the 3-CTA cap it spills 96 bytes: the -c3 candidates keep the
# former rounding); one H200 (2026-12-03, `ab_kernels.py --family block-dual --candidates default,round --rounds 3`,
# byte-exact) 85.4 / 85.4 / 89.9 / 88.5 (pre-round) -> 86.7 / 86.5 / 91.6 / 89.2% of memcpy.
# dual's staged candidates (issue 57, 2026-12-03; dstage, dreread, dreread-c4 measured that night, level or slower,
# the others not yet; NOTES.md): x copied to shared memory by cp.async in
# the SwiGLU ops' swizzled layout (32 KB a CTA), one commit group per row. "dstage": the default plus the stage (bf16
# outputs: round_bf16), the rows read back into registers as they land; "dstage-t2" / "dstage-t4" with 2 / 4 column
# tiles a CTA (the next tile's copies in flight during this tile's stores); "dstage-c3" / "dstage-t2-c3" under the
# 3-CTA cap (with bf16 outputs the former rounding: round_bf16 spills 160 bytes there). "dreread*" (field reread): the
# words read from the stage again where each form uses them, not held across the forms: bf16 (round_bf16) 77
# registers uncapped, so three CTAs a SM; "-c3", "-c4" cap at 3 / 4 CTAs (80 / 64 registers). ptxas (sm_90a / sm_100a,
# rceil, no spills): bf16 dstage 125 / 125 (default 128 / 127), t2 123 / 118, t4 124 / 126, dreread 77 / 76; fp8
# dstage 114 / 112 (default 80 / 79: three CTAs a SM fit already), t2 123 / 124, t4 128 / 128, dreread 113 / 112;
# every c3 77-80, c4 64.
DSTAGE = {"staged": True, "stage_order": "swizzled"}
DUAL_STAGE_CANDIDATES = {"dstage": DSTAGE, "dstage-t2": {**DSTAGE, "tiles_per_cta": 2},
                         "dstage-t4": {**DSTAGE, "tiles_per_cta": 4}}
_C3 = {"dstage-c3": {**DSTAGE, "ctas_per_sm": 3}, "dstage-t2-c3": {**DSTAGE, "tiles_per_cta": 2, "ctas_per_sm": 3}}
DREREAD = {**DSTAGE, "reread": True}
_REREAD = {"dreread": DREREAD, "dreread-c3": {**DREREAD, "ctas_per_sm": 3}, "dreread-c4": {**DREREAD, "ctas_per_sm": 4}}
DUAL_CANDIDATES = {"default": {}, "packed-c3": {"packed_amax": True, "ctas_per_sm": 3, **PRE_1203},
                   "lean-c3": {"lean": True, "ctas_per_sm": 3, **PRE_1203}, "pre-round": PRE_1203,
                   "cw-smem-bf16": CW_SMEM, **DUAL_STAGE_CANDIDATES, **{k: {**PRE_1203, **v} for k, v in _C3.items()},
                   **_REREAD}
DUAL_FP8_CANDIDATES = {"default": {}, "lean-c3": {"lean": True, "ctas_per_sm": 3}, "cw-smem": CW_SMEM,
                       "cw-smem-c3": {"ctas_per_sm": 3, **CW_SMEM}, **DUAL_STAGE_CANDIDATES, **_C3, **_REREAD}


def candidates(op: str, out_dtype: str) -> dict:
    """The A/B candidates of ``op`` writing ``out_dtype``: name -> fields that differ from its default."""
    if op == "dual":
        return DUAL_CANDIDATES if out_dtype == "bfloat16" else DUAL_FP8_CANDIDATES
    own = DSWIGLU_CANDIDATES if op == "dswiglu" else CANDIDATES
    if op == "swiglu" and out_dtype != "bfloat16":  # t4 is its default: pre-t4 instead
        return {**{k: kw for k, kw in own.items() if k != "t4"}, **SWIGLU_FP8_CANDIDATES, **SWIGLU_T4,
                **STAGE_CANDIDATES}
    return {**own, **(SWIGLU_BF16_CANDIDATES if out_dtype == "bfloat16" else SWIGLU_FP8_CANDIDATES), **STAGE_CANDIDATES}


def candidates_any_output(op: str, outs: tuple = OUT_DTYPES) -> dict:
    """The A/B candidates of ``op`` writing any of ``outs``, by name (a name of one kind only, e.g. pre-round, is the
    default in the others). A name's fields may differ between kinds (``sres``: the other field of its kind off):
    these are the last kind's, so take a kind's own from :func:`candidates`."""
    return {name: kw for o in outs for name, kw in candidates(op, o).items()}


def candidate_variants() -> list[Variant]:
    """The candidates' variants other than the defaults (rceil): every op and output kind, and the stacked dswiglu
    variant of each candidate with the default's staged inputs and fast division (the former defaults' stacked code:
    pre-lean, lean-unfused, pre-round; and round, sres)."""
    out = [Variant(op, "bfloat16", "rceil", o, **kw) for op in OPS for o in OUT_DTYPES
           for kw in candidates(op, o).values() if kw]
    return out + [Variant("dswiglu", "bfloat16", "rceil", "bfloat16", stacked=True, **kw)
                  for kw in candidates("dswiglu", "bfloat16").values()
                  if kw and kw.get("staged", True) and kw.get("fast_div", True)]
