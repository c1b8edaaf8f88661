"""The SwiGLU expert block in MXFP8: ``y = (silu(x W1^T) * (x W3^T)) W2^T`` per expert, forward and
backward, as one autograd function over its grouped GEMMs (docs/design.md, "The SwiGLU expert block").

Every GEMM has exactly the MXFP8 numerics of :func:`moe_quant.mxfp8_grouped_mm`; what changes is how
often and where the operands are quantized (:mod:`moe_quant.block_quantize`):

=============  ==========================================================================
forward        ``rowwise_and_kept(x)``: x's rowwise form (w1 and w3 fwd, quantized once) and its colwise
               form (w1 / w3 wgrad) in fp8, kept instead of x, in one read of x;
               ``a = x W1^T``, ``b = x W3^T``;
               ``swiglu_rowwise(a, b)``: h's rowwise form (w2 fwd); ``y = h W2^T``
backward       ``swiglu_colwise(a, b)``: h's colwise form (w2 wgrad), made again;
               ``dual(grad_y)``: rowwise (w2 dgrad) and colwise (w2 wgrad);
               ``dW2``; ``grad_h``; ``dswiglu(grad_h, a, b)``: both forms of ``grad_a`` and
               ``grad_b`` (emulated GEMM, ``dswiglu_cols_fp8``: the colwise ones in fp8);
               ``dx = grad_a W1 + grad_b W3``; ``colwise_operand``: x's form as the GEMM reads it;
               ``dW1``, ``dW3`` (each colwise form in fp8 read back by ``colwise_operand`` just before)
saved          ``a``, ``b`` (bf16) and x's colwise form in fp8 (``2H + 2H + D + D/32`` bytes a row):
               no ``x``, no ``h`` (the bf16 block keeps x, a, b, silu(a), h)
=============  ==========================================================================

The output and every gradient equal :func:`swiglu_experts_unfused` (three ``mxfp8_grouped_mm`` calls and
PyTorch's silu) bit for bit, on every backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import block_quantize as bq
from .. import layouts
from .. import reuse
from .. import quantize as q
from ..backends import GemmBackend, resolve_gemm_backend
from ..layouts import row_major, sanitize_offsets
from ..numerics import BLOCK_SIZE, ScaleMode
from ..validation import check_bool, check_swiglu_experts_args, check_swiglu_experts_w13_args
from .grouped_mm import _first_order_only, _mm_dgrad, _mm_fwd, _mm_wgrad, mxfp8_grouped_mm, weight_operand
from .revision import source_revision
from .saved import free_saved

# ----------------------------------------------------------------------------- weight operands (the GEMMs on
# quantized forms: :mod:`.grouped_mm`'s, shared with the per-GEMM path)


def _w_fwd(w: torch.Tensor, mode: ScaleMode, backend: GemmBackend, scopes: tuple):
    """Forward operand of an expert weight ``w (E, N, K)`` (blocks along K), as mxfp8_grouped_mm builds it."""
    return weight_operand(w.transpose(-2, -1), mode, backend, "fwd", scopes)


def _w_dgrad(w: torch.Tensor, mode: ScaleMode, backend: GemmBackend, scopes: tuple):
    """Dgrad operand of ``w (E, N, K)`` (blocks along N)."""
    return weight_operand(w.transpose(-2, -1), mode, backend, "dgrad", scopes)


# ----------------------------------------------------------------------------- forward and backward


def _one_gate_up_gemm(w3, backend: GemmBackend) -> bool:
    """Whether the gate-up projection is one GEMM whose output ``[a | b]`` the block keeps whole: a concatenated
    weight (``w3`` None) on the scaled GEMM (:func:`_gate_up_fwd`)."""
    return w3 is None and backend is not GemmBackend.EMULATED


def _split_ab(ab: torch.Tensor) -> tuple:
    """``(a, b)``: the halves of the one gate-up GEMM's output ``[a | b]`` (views)."""
    h = ab.shape[1] // 2
    return ab[:, :h], ab[:, h:]


def _gate_up_fwd(x_row: tuple, w1, w3, offs, mode, backend, scopes) -> tuple:
    """``(a, b)`` = ``(x W1^T, x W3^T)``, or ``([a | b],)`` where the gate-up projection is one GEMM
    (:func:`_one_gate_up_gemm`). With the gate and up weights concatenated (``w3`` None, ``w1`` the
    ``(E, 2H, D)`` weight ``[W1; W3]``) the weight is quantized once and, on the emulated GEMM, each half of its
    operand runs its own GEMM: every output element is the same dot product as in one GEMM over ``w13`` (its
    columns are independent; byte-checked on the H100), and ``a`` and ``b`` come out row-major, as the fused
    passes read them (halves of one output would be copied there). The scaled GEMM runs one GEMM."""
    if w3 is not None:
        return (_mm_fwd(x_row, _w_fwd(w1, mode, backend, scopes), offs),
                _mm_fwd(x_row, _w_fwd(w3, mode, backend, scopes), offs))
    w13 = _w_fwd(w1, mode, backend, scopes)
    if len(x_row) == 1:  # emulated: w13 (E, D, 2H) bf16
        h = w13.shape[-1] // 2
        return _mm_fwd(x_row, w13[..., :h], offs), _mm_fwd(x_row, w13[..., h:], offs)
    return (_mm_fwd(x_row, w13, offs),)


def _scaled_concat_wgrad(ga_col: tuple, gb_col: tuple, x_col: tuple, offs, backend, w_dtype) -> torch.Tensor:
    """``dW13 (E, 2H, D)`` on the scaled GEMM: two wgrad GEMMs whose rows are concatenated (the K-groups scale
    layout is group-major, so the rows of two scale buffers do not stack). The emulated GEMM runs one, over
    the stacked colwise form (:func:`moe_quant.block_quantize.dswiglu_stacked`); every row of dW13 is its own
    dot products either way."""
    return torch.cat([_mm_wgrad(ga_col, x_col, offs, backend, w_dtype),
                      _mm_wgrad(gb_col, x_col, offs, backend, w_dtype)], dim=1)


def block_forward(x, w1, w3, w2, offs, mode: ScaleMode, backend: GemmBackend, scopes: tuple, keep_x: bool):
    """The block's forward: ``(y, saved)``, ``saved`` the list of what its backward reads (:func:`block_backward`):
    ``a`` and ``b`` (or ``[a | b]``, :func:`_one_gate_up_gemm`), then x's colwise form in fp8 and scales where
    ``keep_x`` (w1's and w3's weight gradients are needed). The one home of the forward's math: the autograd
    function's forward and the compiled path's forward op (:mod:`.swiglu_block_ops`) call it."""
    fake = backend is GemmBackend.EMULATED
    # x's colwise form (w1's and w3's wgrad operand) in fp8 instead of x: x itself is not kept (its routed copy is
    # the caller's only for the forward); made in the same read of x as its rowwise form, nothing where no weight
    # gradient is needed
    x_row, x_kept = bq.rowwise_and_kept(x, mode, offs, fake) if keep_x else (bq.rowwise(x, mode, offs, fake), ())
    ab = _gate_up_fwd(x_row, w1, w3, offs, mode, backend, scopes)
    del x_row
    h_row = bq.swiglu_rowwise(*(_split_ab(*ab) if len(ab) == 1 else ab), mode, offs, fake)
    y = _mm_fwd(h_row, _w_fwd(w2, mode, backend, scopes), offs)
    del h_row
    return y, [*ab, *x_kept]


def _no_free(indices) -> None:
    """:func:`block_backward`'s ``free`` where nothing can be freed early (the compiled path)."""


def _per_weight(forms: list, concat: bool) -> list:
    """``forms`` (grad_a's and grad_b's forms of one kind, :func:`backward_dswiglu`) grouped by the gate-up weight
    whose GEMM reads them: ``[forms]`` for a concatenated weight (one GEMM over both, or over the stacked form),
    else ``[[grad_a's], [grad_b's]]``; none where none were made. Empties ``forms``."""
    groups = [] if not forms else [list(forms)] if concat else [[f] for f in forms]
    forms.clear()
    return groups


def backward_dswiglu(grad_y, w2, offs, ab: list, concat: bool, mode: ScaleMode, backend: GemmBackend, scopes: tuple,
                     need_w2: bool, need_rows: bool, need_cols: bool, cols_fp8: bool = False) -> tuple:
    """The backward's first stage, the last to read ``a`` and ``b`` (``ab``: the forward's saved ``[a, b]`` or
    ``[[a | b]]``, emptied): ``(dw2, rows, cols)``. ``dw2`` (None unless ``need_w2``) from h's colwise form, made
    again from ``a`` and ``b``; ``rows`` and ``cols``, the rowwise (dx's operands, where ``need_rows``) and colwise
    (dW1's and dW3's, where ``need_cols``) forms of grad_a and grad_b made by dSwiGLU: ``[grad_a's, grad_b's]``,
    or the one form of ``[grad_a | grad_b]`` (a concatenated weight on the emulated GEMM, written in place);
    ``cols_fp8`` (the emulated GEMM): the colwise forms in fp8 and scales (:func:`backward_cols_operand` reads each
    back for its GEMM)."""
    a, b = _split_ab(*ab) if len(ab) == 1 else ab
    ab.clear()
    with torch.no_grad():  # gradients of quantized operands: first order only (as mxfp8_grouped_mm)
        fake = backend is GemmBackend.EMULATED
        h_col = bq.swiglu_colwise(a, b, mode, offs, fake) if need_w2 else None  # made again from a and b
        g_row, g_col = bq.dual(row_major(grad_y), mode, offs, fake)
        dw2 = _mm_wgrad(g_col, h_col, offs, backend, w2.dtype) if need_w2 else None
        del g_col, h_col
        grad_h = _mm_dgrad(g_row, _w_dgrad(w2, mode, backend, scopes), offs)
        del g_row
        if concat and fake:  # [grad_a | grad_b]'s forms (dx's and dW13's operands) written in place, no copy
            rows, cols = (list(forms) for forms in zip(bq.dswiglu_stacked(grad_h, a, b, mode, offs, cols_fp8)))
        else:
            rows, cols = (list(forms) for forms in zip(*bq.dswiglu(grad_h, a, b, mode, offs, fake, cols_fp8)))
    return dw2, rows if need_rows else [], cols if need_cols else []


def backward_dgrad(rows: list, w, offs, mode: ScaleMode, backend: GemmBackend, scopes: tuple, x_dtype,
                   acc: torch.Tensor | None) -> torch.Tensor:
    """One of dx's GEMMs in x's dtype, plus ``acc`` (the other's, or None): ``grad_a W1`` or ``grad_b W3`` from one
    rowwise form (``rows``, emptied), or ``[grad_a | grad_b] W13`` from the stacked form or from both halves' (the
    scaled GEMM: their blocked scales concatenated tile by tile, the halves freed then). The sum is written into
    the new product (an addition is the same either way round), so no third ``(M, D)`` tensor is made."""
    with torch.no_grad():
        row = rows.pop() if len(rows) == 1 else bq.concat_rowwise(*rows)
        rows.clear()
        part = _mm_dgrad(row, _w_dgrad(w, mode, backend, scopes), offs).to(x_dtype)
        del row
        return part if acc is None else part.add_(acc)


def backward_x_operand(x_kept: list, fake: bool) -> tuple:
    """x's colwise form as the weight-gradient GEMMs read it, from the kept one (``x_kept``, emptied): the emulated
    GEMM's bf16 dequantization (the fp8 form freed then), the scaled GEMM's kept form itself."""
    with torch.no_grad():
        kept = tuple(x_kept)
        x_kept.clear()
        return bq.colwise_operand(kept, fake)


def backward_cols_operand(cols: list) -> list:
    """The emulated GEMM's colwise forms of grad_a or grad_b, or of both stacked, from dSwiGLU's fp8 ones
    (``cols``, emptied; :func:`backward_dswiglu` with ``cols_fp8``): each dequantized
    (:func:`moe_quant.block_quantize.colwise_operand`, the values of the bf16 form bit for bit) and its fp8 form
    dropped then, just before the weight gradient's GEMM reads it."""
    with torch.no_grad():
        fp8, out = list(cols), []
        cols.clear()
        while fp8:
            out.append(bq.colwise_operand(fp8.pop(0), True))
        return out


def backward_wgrad(cols: list, x_col: tuple, offs, backend: GemmBackend, w_dtype) -> torch.Tensor:
    """A gate-up weight's gradient in its dtype from grad_a's or grad_b's colwise form, or from the stacked form of
    both (``cols``, emptied), and x's (:func:`backward_x_operand`); ``dW13`` on the scaled GEMM from both halves'
    forms (:func:`_scaled_concat_wgrad`)."""
    with torch.no_grad():
        if len(cols) == 1:
            return _mm_wgrad(cols.pop(), x_col, offs, backend, w_dtype)
        ga_col, gb_col = cols
        cols.clear()
        return _scaled_concat_wgrad(ga_col, gb_col, x_col, offs, backend, w_dtype)


class BackwardStages:
    """:func:`block_backward`'s stages, each the last reader of some of what the earlier ones made: ``dswiglu``
    (of ``a`` and ``b``), ``dgrad`` (of a rowwise form), ``x_operand`` (of x's kept form), ``cols_operand`` (of a
    colwise form in fp8), ``wgrad`` (of a colwise form). Eager they run as they are; the compiled path runs each as
    a custom op (:mod:`.swiglu_block_ops`), so that the compiled backward graph frees each input after the op that
    reads it last."""

    dswiglu = staticmethod(backward_dswiglu)
    dgrad = staticmethod(backward_dgrad)
    x_operand = staticmethod(backward_x_operand)
    cols_operand = staticmethod(backward_cols_operand)
    wgrad = staticmethod(backward_wgrad)


def block_backward(grad_y, w1, w3, w2, offs, saved: list, mode: ScaleMode, backend: GemmBackend, scopes: tuple,
                   needs: tuple, x_dtype: torch.dtype, cols_fp8: bool, free=_no_free,
                   stages=BackwardStages) -> tuple:
    """The block's backward: ``(dx, dw1, dw3, dw2)`` (None where ``needs``, the four input-grad flags, is False)
    from ``grad_y`` and :func:`block_forward`'s ``saved``, which it empties (the caller keeps no reference, so
    each saved tensor is freed once read: ``a`` and ``b`` after dSwiGLU, x's kept form once read back; ``free(i)``
    is called with the indices into ``saved`` of those it is done with, for autograd to drop them too:
    :func:`.saved.free_saved`). dx runs before dW1 and dW3. ``cols_fp8`` (``dswiglu_cols_fp8``; the emulated GEMM
    only, the scaled one reads fp8 forms anyway): grad_a's and grad_b's colwise forms made in fp8 and each
    dequantized just before its weight gradient's GEMM. The one home of the backward's order; its math is in the
    ``stages`` (:class:`BackwardStages`, or the custom ops that run them under ``torch.compile``), each handed lists
    it empties, so every transient is freed once its last reader returns."""
    need_x, need_w1, need_w3, need_w2 = needs
    concat = w3 is None
    cols_fp8 = cols_fp8 and backend is GemmBackend.EMULATED
    n_ab = 1 if _one_gate_up_gemm(w3, backend) else 2
    ab, x_kept, n_saved = saved[:n_ab], saved[n_ab:], len(saved)
    saved.clear()
    # the saved a and b freed once dSwiGLU has read them, x's kept form once read back, and dx's two products
    # summed in place: the peak stays near the bf16 block's
    with torch.no_grad():  # gradients of quantized operands: first order only (as mxfp8_grouped_mm)
        dw2, rows, cols = stages.dswiglu(grad_y, w2, offs, ab, concat, mode, backend, scopes, need_w2, need_x,
                                         need_w1 or need_w3, cols_fp8)
        free(range(n_ab))
        weights = (w1,) if concat else (w1, w3)
        # dx first: its GEMMs (and their weight operands) run before dW1 and dW3 exist, and the rowwise forms
        # are freed before x's colwise form is read back for the weight gradients
        dx = None
        for w, forms in zip(weights, _per_weight(rows, concat)):
            dx = stages.dgrad(forms, w, offs, mode, backend, scopes, x_dtype, dx)
        dws = [None, None]
        if need_w1 or need_w3:
            x_col = stages.x_operand(x_kept, backend is GemmBackend.EMULATED)
            free(range(n_ab, n_saved))
            for i, (w, forms, need) in enumerate(zip(weights, _per_weight(cols, concat), (need_w1, need_w3))):
                if need and cols_fp8:  # the bf16 values made now (the fp8 form dropped), after the previous GEMM
                    forms = stages.cols_operand(forms)
                dws[i] = stages.wgrad(forms, x_col, offs, backend, w.dtype) if need else None
                forms.clear()
    return dx, dws[0], dws[1], dw2


def first_order_only(grads: tuple, grad_y, w1, w3, w2) -> tuple:
    """:func:`block_backward`'s ``(dx, dw1, dw3, dw2)``, made to raise if differentiated again
    (grouped_mm.DOUBLE_BACKWARD_ERROR), as for mxfp8_grouped_mm."""
    dx, dw1, dw3, dw2 = grads
    dx, dw1 = _first_order_only((dx, dw1), (grad_y, w1, w3))  # w3 None with w13
    dw3, dw2 = _first_order_only((dw3, dw2), (grad_y, w3, w2))
    return dx, dw1, dw3, dw2


class _SwiGLUExperts(torch.autograd.Function):
    """The block over ``(x, w1, w3, w2)``, or over ``(x, w13, None, w2)`` with the gate and up weights
    concatenated (``w13 = [W1; W3]``, (E, 2H, D)): then the gate-up projection is one GEMM in each direction
    (``x W13^T``; ``dx = [grad_a | grad_b] W13``; ``dW13``), as for a module that stores ``w13``.

    Kept for backward (docs/design.md, "The SwiGLU expert block"): ``a`` and ``b`` (bf16, what dSwiGLU reads) and
    x's colwise form in fp8 and scales (:func:`moe_quant.block_quantize.colwise_kept`); not ``x``, not ``h``:
    h's colwise form is made again from ``a`` and ``b`` in backward. In an eager backward ``a`` and ``b`` are
    freed once dSwiGLU has read them and x's kept form once read back for the weight gradients
    (:func:`.saved.free_saved`); dx runs before dW1 and dW3. Under ``torch.compile`` the block runs as custom ops
    instead (:mod:`.swiglu_block_ops`: the forward, and each stage of the backward), which keep the same tensors
    and free them at the same points."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, offs, mode: ScaleMode, backend: GemmBackend, cols_fp8: bool):
        scopes = reuse.current()  # the reuse scopes this forward runs in serve its backward too
        keep_x = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        y, saved = block_forward(x, w1, w3, w2, offs, mode, backend, scopes, keep_x)
        ctx.save_for_backward(w1, w3, w2, offs, *saved)
        ctx.mode, ctx.backend, ctx.x_dtype, ctx.reuse_scopes = mode, backend, x.dtype, scopes
        ctx.cols_fp8 = cols_fp8
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved = list(ctx.saved_tensors)
        w1, w3, w2, offs = saved[:4]
        del saved[:4]  # block_backward empties the rest as it reads it

        def free(indices):  # saved after the weights and offsets: indices 4, 5, ...
            free_saved(ctx, [4 + i for i in indices])

        grads = block_backward(grad_y, w1, w3, w2, offs, saved, ctx.mode, ctx.backend, ctx.reuse_scopes,
                               ctx.needs_input_grad[:4], ctx.x_dtype, ctx.cols_fp8, free)
        return (*first_order_only(grads, grad_y, w1, w3, w2), None, None, None, None)


# the compiled block's revision (:func:`.revision.source_revision`): its forward op's argument that nothing reads
COMPILED_REVISION = source_revision("swiglu_block.py", "swiglu_block_ops.py")


def _apply(x, w1, w3, w2, offs, mode: ScaleMode, backend: GemmBackend, cols_fp8: bool) -> torch.Tensor:
    """The block on checked arguments: the autograd function in eager; under ``torch.compile`` its custom ops
    (:mod:`.swiglu_block_ops`: AOTAutograd's partitioner would otherwise save x and the weights' backward
    operands instead of what the block keeps)."""
    if torch.compiler.is_compiling():
        # registered by .swiglu_block_ops when moe_quant.autograd is imported (called by name: no import cycle);
        # x's colwise form is kept where a weight gradient is to be computed
        keep_x = torch.is_grad_enabled() and (w1.requires_grad or (w3 is not None and w3.requires_grad))
        return torch.ops.moe_quant.swiglu_block_fwd.default(x, w1, w3, w2, offs, mode.value, backend.value,
                                                            keep_x, cols_fp8, COMPILED_REVISION)[0]
    return _SwiGLUExperts.apply(x, w1, w3, w2, offs, mode, backend, cols_fp8)


# ----------------------------------------------------------------------------- public entry points


def _degenerate(x, w1) -> bool:
    """D = 0 or H = 0: no GEMM to run (torch._grouped_mm rejects these shapes)."""
    return x.shape[1] == 0 or w1.shape[1] == 0


def swiglu_of_gemms(gemm, x, w1, w3, w2) -> torch.Tensor:
    """``(silu(x W1^T) * (x W3^T)) W2^T`` with ``gemm(A, W_t)`` for each grouped GEMM: the per-GEMM path
    (:func:`swiglu_experts_unfused`, and conversion's where the fused block does not serve). silu after both
    gate-up GEMMs: autograd runs the node made last first among those ready, so silu's backward (which frees a and
    silu's output gradient) runs before w3's GEMM's, not after it; the same values either way."""
    a = gemm(x, w1.transpose(-2, -1))
    b = gemm(x, w3.transpose(-2, -1))
    return gemm(F.silu(a) * b, w2.transpose(-2, -1))


def swiglu_w13_of_gemms(gemm, x, w13, w2) -> torch.Tensor:
    """:func:`swiglu_of_gemms` with the gate and up weights concatenated (``w13 (E, 2H, D)``): one gate-up GEMM,
    ``chunk`` and silu."""
    gate, up = gemm(x, w13.transpose(-2, -1)).chunk(2, dim=-1)
    return gemm(F.silu(gate) * up, w2.transpose(-2, -1))


def swiglu_experts_unfused(x, w1, w3, w2, offs, *, scale_mode: ScaleMode | str = ScaleMode.RCEIL,
                           backend: GemmBackend | str = GemmBackend.AUTO,
                           validate_offsets: bool | None = None) -> torch.Tensor:
    """The SwiGLU expert block as three :func:`moe_quant.mxfp8_grouped_mm` calls and PyTorch's silu: the
    per-GEMM path, and the oracle :func:`mxfp8_swiglu_experts` equals bit for bit."""
    kw = dict(scale_mode=scale_mode, backend=backend, validate_offsets=validate_offsets)
    return swiglu_of_gemms(lambda A, W_t: mxfp8_grouped_mm(A, W_t, offs, **kw), x, w1, w3, w2)


def mxfp8_swiglu_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    *,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    backend: GemmBackend | str = GemmBackend.AUTO,
    validate_offsets: bool | None = None,
    dswiglu_cols_fp8: bool = False,
) -> torch.Tensor:
    """A SwiGLU expert block in MXFP8: ``y = (silu(x W1^T) * (x W3^T)) W2^T`` per token group, differentiable.

    The computation of :class:`moe_quant.moe.GroupedExperts` (``F.silu(grouped_mm(x, w1^T)) *
    grouped_mm(x, w3^T)``, then ``grouped_mm(., w2^T)``) with every GEMM in MXFP8, its operands quantized
    in fused passes (:mod:`moe_quant.block_quantize`). Output and gradients equal
    :func:`swiglu_experts_unfused` with the same arguments bit for bit.

    Args:
        x: ``(M, D)`` bf16 or fp32, tokens grouped by expert; D a multiple of 32.
        w1, w3: ``(E, H, D)`` bf16 or fp32 (read as bf16; gradients in their dtype); H a multiple of 32.
        w2: ``(E, D, H)``.
        offs: ``(E,)`` int32 cumulative group ends (any sizes, 0 included); rows past ``offs[-1]`` are not
            computed (their output and input gradient are unspecified), as in ``torch._grouped_mm``.
        scale_mode, backend, validate_offsets: as in :func:`moe_quant.mxfp8_grouped_mm`.
        dswiglu_cols_fp8: on the emulated GEMM (Hopper), the backward makes grad_a's and grad_b's colwise forms (w1's
            and w3's weight-gradient operands) in fp8 and scales and dequantizes each just before its GEMM: the
            backward's peak (its second dx GEMM, where both are alive) ``2 (H - H/32)`` bytes a padded row lower,
            for two dequantization passes over ``H + H/32`` bytes a row (on one H200, DeepSeek-V3 16B's experts at
            98304 rows: peak 2.79 -> 2.54 GiB, the step 2-3.5% slower, 2026-12-03). False
            (default): both in bf16 from dSwiGLU on. The same bits either way; no effect on the scaled GEMM (its
            forms are fp8).

    Works under ``torch.compile(fullgraph=True)`` (the fused passes are ``torch.ops.moe_quant.block_*`` custom
    ops), activation checkpointing, ``no_grad`` and ``inference_mode``; double backward raises as for
    :func:`moe_quant.mxfp8_grouped_mm`. ``torch.func`` transforms (``vmap``, ``grad``) are not supported
    (the per-GEMM path supports them).

    Returns:
        ``(M, D)`` bf16.
    """
    mode = ScaleMode.parse(scale_mode)
    offs = check_swiglu_experts_args(x, w1, w3, w2, offs, validate_offsets)
    check_bool("dswiglu_cols_fp8", dswiglu_cols_fp8)
    gemm = resolve_gemm_backend(backend, x.device)
    if _degenerate(x, w1):
        return swiglu_experts_unfused(x, w1, w3, w2, offs, scale_mode=mode, backend=gemm, validate_offsets=False)
    offs = sanitize_offsets(offs, x.shape[0]).to(torch.int32)
    return _apply(row_major(x), w1, w3, w2, offs, mode, gemm, dswiglu_cols_fp8)


def swiglu_experts_w13_unfused(x, w13, w2, offs, *, scale_mode: ScaleMode | str = ScaleMode.RCEIL,
                               backend: GemmBackend | str = GemmBackend.AUTO,
                               validate_offsets: bool | None = None) -> torch.Tensor:
    """:func:`mxfp8_swiglu_experts_w13` as two :func:`moe_quant.mxfp8_grouped_mm` calls, ``chunk`` and PyTorch's
    silu (transformers' concatenated experts, converted per GEMM): the oracle it equals bit for bit."""
    kw = dict(scale_mode=scale_mode, backend=backend, validate_offsets=validate_offsets)
    return swiglu_w13_of_gemms(lambda A, W_t: mxfp8_grouped_mm(A, W_t, offs, **kw), x, w13, w2)


def mxfp8_swiglu_experts_w13(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    *,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    backend: GemmBackend | str = GemmBackend.AUTO,
    validate_offsets: bool | None = None,
    dswiglu_cols_fp8: bool = False,
) -> torch.Tensor:
    """:func:`mxfp8_swiglu_experts` with the gate and up weights concatenated, as transformers' experts store
    them (``gate_up_proj``): ``gate, up = (x W13^T).chunk(2, -1)``, ``y = (silu(gate) * up) W2^T`` per group.

    The gate-up projection is one GEMM in the forward and one for ``dx`` (``[grad_gate | grad_up] W13``, one
    fp32 accumulation, where the separate-weights block adds two bf16 products); output and gradients equal
    :func:`swiglu_experts_w13_unfused` (the per-GEMM form of the same module) bit for bit.

    Args:
        x: ``(M, D)`` bf16 or fp32, tokens grouped by expert; D a multiple of 32.
        w13: ``(E, 2H, D)``: rows ``[:H]`` the gate projection (silu's input), ``[H:]`` the up projection;
            H a multiple of 32. Any strides (a transposed ``(E, D, 2H)`` parameter's ``.transpose(-2, -1)``).
        w2: ``(E, D, H)``.
        offs, scale_mode, backend, validate_offsets, dswiglu_cols_fp8: as in :func:`mxfp8_swiglu_experts` (here
            the one colwise form of ``[grad_gate | grad_up]``, ``2 H`` rows, in fp8 until dW13's GEMM).

    Returns:
        ``(M, D)`` bf16.
    """
    mode = ScaleMode.parse(scale_mode)
    offs = check_swiglu_experts_w13_args(x, w13, w2, offs, validate_offsets)
    check_bool("dswiglu_cols_fp8", dswiglu_cols_fp8)
    gemm = resolve_gemm_backend(backend, x.device)
    h_scale_cols = w13.shape[1] // 2 // BLOCK_SIZE
    if _degenerate(x, w13) or (gemm is GemmBackend.SCALED and not layouts.whole_scale_tiles(h_scale_cols)):
        # the scaled dx GEMM takes [grad_gate | grad_up] with their blocked scales concatenated tile by tile,
        # which needs grad_gate's scale columns in whole tiles; otherwise the per-GEMM form (the same bits)
        return swiglu_experts_w13_unfused(x, w13, w2, offs, scale_mode=mode, backend=gemm, validate_offsets=False)
    offs = sanitize_offsets(offs, x.shape[0]).to(torch.int32)
    return _apply(row_major(x), w13, None, w2, offs, mode, gemm, dswiglu_cols_fp8)


__all__ = ["mxfp8_swiglu_experts", "mxfp8_swiglu_experts_w13", "swiglu_experts_unfused", "swiglu_experts_w13_unfused"]
