"""The quantization passes of the SwiGLU expert block (:mod:`moe_quant.autograd.swiglu_block`).

Each pass reads its inputs once and writes every MXFP8 form the block's GEMMs need of one tensor at
that point:

* :func:`rowwise` -- ``x`` (forward): its rowwise 1x32 form (the fwd operand of w1 and w3, made once for
  both; where ``x`` arrived in MXFP8 -- expert parallelism's wire -- the received form, no pass);
  :func:`colwise_kept` -- its colwise 32x1 K-groups form (their wgrad operand) in fp8 and scales, which the block
  keeps for the backward instead of ``x`` (:func:`colwise_operand` reads it back into the GEMM's form there);
  :func:`rowwise_and_kept` -- both in one read of ``x`` (the forward, where a weight gradient is needed).
* :func:`dual` -- ``grad_out`` (backward): the rowwise 1x32 form (dgrad operand) and the colwise 32x1
  K-groups form (wgrad operand); where it arrived in MXFP8, the received rowwise form and one colwise pass.
* :func:`swiglu_rowwise` -- ``h = silu(a) * b`` computed and quantized in its rowwise form (w2's forward operand);
  ``h`` itself is never written. :func:`swiglu_colwise` -- the same in the backward, for w2's wgrad operand (the
  block keeps ``a`` and ``b``, not h's colwise form); :func:`swiglu` writes both forms in one pass.
* :func:`dswiglu` -- the SwiGLU backward: ``grad_a`` and ``grad_b`` from ``grad_h``, ``a``, ``b``, each in
  both forms (w1 / w3 dgrad and wgrad operands); for the emulated GEMM with ``cols_fp8`` the colwise forms in fp8
  and scales as :func:`colwise_kept` makes them (H + H/32 bytes a padded row instead of 2H while the backward holds
  them), each read back by :func:`colwise_operand` just before its GEMM.

A *form* is a tuple of tensors, as the GEMM backend takes it:

=========  ==========================================  ===============================================
backend    rowwise form                                colwise form
=========  ==========================================  ===============================================
emulated   ``(values (M, R) bf16,)``                    ``(values_t (R, Mp) bf16, padded_offs)``
scaled     ``(data (M, R) e4m3, M-groups scales)``      ``(data_t (R, Mp) e4m3, K-groups scales, poffs)``
=========  ==========================================  ===============================================

The values are exactly those of :mod:`moe_quant.quantize` (``fake_quantize_rowwise``,
``quantize_colwise_k_groups``, ...) of the same tensor, except that rows of the rowwise form past the
last group's end are zero (no GEMM reads them; the kernels do not read them either). Runs the
``block`` CuTe-DSL kernels on bf16 inputs where :func:`moe_quant.backends.use_quant_kernels` says so, and
otherwise the SwiGLU of :mod:`moe_quant.reference` followed by the separate quantizers of
:mod:`moe_quant.quantize`, bit-identical. ``offs`` must be sanitized already
(:func:`moe_quant.layouts.sanitize_offsets`).
"""

from __future__ import annotations

import torch

from . import backends, layouts, reference
from . import prequantized as pq
from . import quantize as q
from .numerics import BLOCK_SIZE, ScaleMode


def _kernels_serve(*tensors: torch.Tensor) -> bool:
    """The ``block`` kernels serve bf16 inputs on Hopper and newer (fp32 activations take the separate
    1x32 and 32x1 passes of :mod:`moe_quant.quantize`, kernels there too)."""
    return backends.use_quant_kernels(tensors[0]) and all(t.dtype == torch.bfloat16 for t in tensors)


def rows_in_groups(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t (M, R)`` with the rows past the last group's end (``offs[-1]``, sanitized) set to zero bytes."""
    m = t.shape[0]
    end = offs[-1:].to(torch.int64) if offs.numel() else offs.new_zeros(1, dtype=torch.int64)
    keep = (torch.arange(m, device=t.device) < end).unsqueeze(1)
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    return torch.where(keep, raw, torch.zeros((), dtype=raw.dtype, device=t.device)).view(t.dtype)


def _rowwise_form(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """The rowwise form by the per-GEMM 1x32 quantizer (the reference, or the kernel where it serves), its rows past
    the last group's end zero bytes as the fused kernels write them: the rowwise half of :func:`_separate_forms`."""
    if fake:
        return (rows_in_groups(q.fake_quantize_rowwise(x, mode), offs),)
    data, scales = q.quantize_rowwise(x, mode, offs)
    return rows_in_groups(data, offs), scales


def _separate_forms(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool, cols_fp8: bool = False):
    """Both forms by the per-GEMM quantizers (:mod:`moe_quant.quantize`: the reference, or the 1x32 and
    32x1 kernels where they serve): two reads of ``x``. The oracle of the fused kernels. ``cols_fp8`` (with
    ``fake``): the colwise form as :func:`colwise_kept` makes it (fp8, plain scales)."""
    row = _rowwise_form(x, mode, offs, fake)
    if fake and cols_fp8:  # colwise_kept's form
        return row, tuple(q.colwise_k_groups_plain(x, offs, mode))
    return row, _colwise_form(x, mode, offs, fake)


def _kernel_forms(outs: list, fake: bool, cols_fp8: bool = False):
    """The ops' outputs (per tensor ``[row_data, col_data]``, with scales ``[row_data, row_scales,
    col_data, col_scales]``, with ``cols_fp8`` ``[row_data, col_data, col_plain_scales]``; then ``poffs``) ->
    ``[(rowwise form, colwise form), ...]``, one per tensor (``cols_fp8``: the colwise form as :func:`colwise_kept`
    makes it)."""
    poffs, per = outs[-1], 3 if cols_fp8 else 2 if fake else 4
    forms = []
    for i in range(0, len(outs) - 1, per):
        t = outs[i:i + per]
        if cols_fp8:
            forms.append(((t[0],), (t[1], t[2], poffs)))
        else:
            forms.append(((t[0],), (t[1], poffs)) if fake else ((t[0], t[1]), (t[2], t[3], poffs)))
    return forms


def rowwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """``x``'s rowwise form alone (one 1x32 pass): the forward's operand of w1 and w3, and the per-GEMM path's
    (:func:`moe_quant.mxfp8_grouped_mm`) forward and dgrad operands. Rows past the last group's end are quantized
    values, not zeros (no GEMM reads them)."""
    return (pq.rowwise_values(x, mode),) if fake else tuple(pq.rowwise_operand(x, mode, offs))


def colwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """``x``'s colwise 32x1 K-groups form alone (one pass), as the GEMM takes it: the per-GEMM path's wgrad
    operands."""
    return _colwise_form(x, mode, offs, fake)


def colwise_kept(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """``x``'s colwise 32x1 K-groups form in its narrowest exact form (one pass; fp8 data and e8m0 scales,
    ``R + R/32`` bytes per padded row): what the block keeps of ``x`` from forward to backward for w1's and w3's
    weight gradients, instead of ``x`` itself (``2 R`` bytes a row, or 4 in fp32). The scaled GEMM's form
    ``(data_t (R, Mp) e4m3, K-groups blocked scales, poffs)``; for the emulated GEMM ``(data_t, plain scales
    (R, Mp/32), poffs)``, which :func:`colwise_operand` dequantizes when the GEMM runs."""
    return tuple((q.colwise_k_groups_plain if fake else q.colwise_k_groups)(x, offs, mode))


def rowwise_and_kept(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """``(rowwise form, kept colwise form)`` of ``x``: what the block's forward makes of ``x`` where a weight gradient
    will be needed, :func:`rowwise` (w1's and w3's forward operand) and :func:`colwise_kept` (what the block keeps),
    the same values; in one read of ``x`` where the ``block`` kernels serve (``dual``, on the emulated GEMM its
    ``cols_fp8`` variant) and ``x``'s rowwise form is not known already (expert parallelism's received MXFP8 rows:
    the known form and the colwise pass). The rowwise form's rows past the last group's end are zeros there (no GEMM
    reads them)."""
    if pq.lookup(x, mode) is None and _kernels_serve(x):
        from .kernels.block import ops as ops_block

        return _kernel_forms(ops_block.block_dual(x, mode, offs, fake, cols_fp8=fake), fake, fake)[0]
    return rowwise(x, mode, offs, fake), colwise_kept(x, mode, offs, fake)


def colwise_operand(kept: tuple, fake: bool) -> tuple:
    """The colwise form the GEMM takes, from :func:`colwise_kept`'s: the scaled GEMM's is the kept one; the emulated
    GEMM's ``(values_t (R, Mp) bf16, poffs)`` is its dequantization, made now (one pass over the fp8 bytes) and
    freed by the caller once the GEMMs read it: the same values as :func:`colwise` of ``x``, bit for bit."""
    if not fake:
        return kept
    data_t, scales, poffs = kept
    return q.dequantize_rows(data_t, scales, torch.bfloat16), poffs


def _colwise_form(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """The colwise form by the per-GEMM 32x1 quantizer (kernel or reference): :func:`colwise`, and the
    colwise half of :func:`_separate_forms`."""
    if fake:
        return tuple(q.fake_colwise_k_groups(x, offs, mode, torch.bfloat16))
    return tuple(q.colwise_k_groups(x, offs, mode))


def dual(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool):
    """``(rowwise form, colwise form)`` of ``x (M, R)`` (bf16 or fp32) in one read; ``fake``: the
    dequantized bf16 values the emulated GEMM takes, else fp8 data and blocked scales. Where ``x``'s
    rowwise form is known (a gradient that arrived in MXFP8: expert parallelism's combine backward,
    :mod:`moe_quant.prequantized`) only the colwise pass runs (one read, half the writes)."""
    if pq.lookup(x, mode) is not None:
        return rowwise(x, mode, offs, fake), colwise(x, mode, offs, fake)
    if _kernels_serve(x):
        from .kernels.block import ops as ops_block

        return _kernel_forms(ops_block.block_dual(x, mode, offs, fake), fake)[0]
    return _separate_forms(x, mode, offs, fake)


def swiglu(a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool):
    """Both forms of ``h = silu(a) * b`` (:func:`moe_quant.reference.swiglu`), without writing ``h``."""
    if _kernels_serve(a, b):
        from .kernels.block import ops as ops_block

        return _kernel_forms(ops_block.block_swiglu(a, b, mode, offs, fake), fake)[0]
    return _separate_forms(reference.swiglu(a, b), mode, offs, fake)


def swiglu_rowwise(a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """The rowwise form of ``h = silu(a) * b`` alone (w2's forward operand): the block's forward, which keeps ``a``
    and ``b`` rather than h's colwise form (:func:`swiglu_colwise` makes it again). One pass, writing that form only
    (``forms`` "rows")."""
    if _kernels_serve(a, b):
        from .kernels.block import ops as ops_block

        # [data, (scales,) poffs]: the rowwise form is the GEMM's without the padded offsets
        return tuple(ops_block.block_swiglu(a, b, mode, offs, fake, forms="rows")[:-1])
    return _rowwise_form(reference.swiglu(a, b), mode, offs, fake)


def swiglu_colwise(a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor, fake: bool) -> tuple:
    """The colwise form of ``h = silu(a) * b`` alone (w2's wgrad operand), made again in the backward from the kept
    ``a`` and ``b`` instead of kept from the forward. One pass, writing that form only (``forms`` "cols")."""
    if _kernels_serve(a, b):
        from .kernels.block import ops as ops_block

        return tuple(ops_block.block_swiglu(a, b, mode, offs, fake, forms="cols"))  # [data, (scales,) poffs]
    return _colwise_form(reference.swiglu(a, b), mode, offs, fake)


def dswiglu(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor,
            fake: bool, cols_fp8: bool = False):
    """``((rowwise, colwise) of grad_a, (rowwise, colwise) of grad_b)`` of the SwiGLU backward
    (:func:`moe_quant.reference.dswiglu`), without writing ``grad_a`` or ``grad_b``. ``cols_fp8`` (with ``fake``):
    the colwise forms as :func:`colwise_kept` makes them, ``(data_t (R, Mp) e4m3, plain scales (R, Mp/32), poffs)``
    (:func:`colwise_operand` gives the emulated GEMM's from it, the same values bit for bit), the rowwise forms
    the bf16 values as without it."""
    cols_fp8 = cols_fp8 and fake
    if _kernels_serve(grad_h, a, b):
        from .kernels.block import ops as ops_block

        return tuple(_kernel_forms(ops_block.block_dswiglu(grad_h, a, b, mode, offs, fake, cols_fp8=cols_fp8), fake,
                                   cols_fp8))
    grad_a, grad_b = reference.dswiglu(grad_h, a, b)
    return _separate_forms(grad_a, mode, offs, fake, cols_fp8), _separate_forms(grad_b, mode, offs, fake, cols_fp8)


def dswiglu_stacked(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: ScaleMode, offs: torch.Tensor,
                    cols_fp8: bool = False):
    """:func:`dswiglu` on the emulated GEMM for a concatenated gate-up weight: ``(rowwise form, colwise form)``
    of ``[grad_a | grad_b]`` (dx's and dW13's operands), equal to :func:`concat_rowwise` and
    :func:`concat_colwise` of grad_a's and grad_b's forms; the kernel writes each half in place (no
    concatenation copy). ``cols_fp8``: the colwise form ``(data_t (2R, Mp) e4m3, plain scales (2R, Mp/32),
    poffs)`` (the halves' scales stacked along rows as the data: 1/32 of the data's bytes; the kernel writes them in
    place too)."""
    if _kernels_serve(grad_h, a, b):
        from .kernels.block import ops as ops_block

        outs = ops_block.block_dswiglu(grad_h, a, b, mode, offs, True, stacked=True, cols_fp8=cols_fp8)
        if not cols_fp8:
            row, col, poffs = outs
            return (row,), (col, poffs)
        row, col, scales, poffs = outs
        return (row,), (col, scales, poffs)
    (row_a, col_a), (row_b, col_b) = dswiglu(grad_h, a, b, mode, offs, True, cols_fp8)
    return concat_rowwise(row_a, row_b), concat_colwise(col_a, col_b, cols_fp8)


def concat_rowwise(a: tuple, b: tuple) -> tuple:
    """The rowwise form of ``[A | B]`` (columns concatenated) from those of ``A`` and ``B``: the 1x32 blocks of
    each row are the two tensors' blocks side by side, so the values are exactly those of quantizing the
    concatenation. Scaled forms need ``A``'s scale columns in whole tiles (:func:`layouts.whole_scale_tiles`:
    its width a multiple of 128)."""
    if len(a) == 1:
        return (torch.cat([a[0], b[0]], dim=1),)
    return torch.cat([a[0], b[0]], dim=1), layouts.concat_blocked_cols(a[1], b[1], a[0].shape[1] // BLOCK_SIZE)


def concat_colwise(a: tuple, b: tuple, plain: bool = False) -> tuple | None:
    """The emulated colwise form of ``[A | B]`` from those of ``A`` and ``B`` (values stacked along rows, same
    padded offsets); ``plain``: of :func:`colwise_kept`'s forms (fp8 data and plain scales, each stacked along
    rows); None for scaled forms, whose K-groups scale buffer is group-major (no plain stacking)."""
    if plain:
        return torch.cat([a[0], b[0]], dim=0), torch.cat([a[1], b[1]], dim=0), a[2]
    if len(a) != 2:
        return None
    return torch.cat([a[0], b[0]], dim=0), a[1]
