"""Differentiable MXFP8 grouped GEMM: ``out = A @ W_t`` per token group (docs/design.md section 4).

=======  ==========================================  ===========================================
GEMM     operand 1                                   operand 2
=======  ==========================================  ===========================================
fwd      A (M, K) rowwise 1x32 along K, M-groups      W along K, 3D per-expert scales
dgrad    grad_out (M, N) rowwise along N, M-groups    W along N, 3D per-expert scales
wgrad    grad_out colwise 32x1 along tokens, K-groups  A colwise 32x1 along tokens, K-groups
=======  ==========================================  ===========================================

Two GEMM backends with the same numerics (``backends.py`` picks one):

* ``scaled`` (SM100+): real fp8 operands and e8m0 blocked scales to ``torch._scaled_grouped_mm``.
* ``emulated`` (anywhere): the same quantization, dequantized to bf16 (exact), then
  ``torch._grouped_mm``. The dequantized operands are produced in one pass (fake quantization).

Both GEMMs accumulate in fp32 and round the result to bf16 (PyTorch's grouped GEMMs emit bf16);
``out_dtype=torch.float32`` widens that result.

Saved for backward: ``A`` where the weight's gradient is needed, ``W_t`` where ``A``'s is, the offsets; the backward
makes A's wgrad operand first and frees ``A`` then (:func:`input_grads`). Under ``torch.compile`` the same
functions run as custom ops (:mod:`.grouped_mm_ops`), which save the same.
"""

from __future__ import annotations

import torch

from .. import block_quantize as bq
from .. import layouts
from .. import quantize as q
from ..backends import GemmBackend, grouped_mm_zero_fills_empty_groups, resolve_gemm_backend
from ..layouts import row_major, sanitize_offsets
from ..numerics import BLOCK_SIZE, ScaleMode
from .. import reuse
from ..validation import check_grouped_mm_args
from .revision import source_revision
from .saved import free_saved

_GEMM_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- weight operands


# (backend, gemm) -> the weight operand's form, computed from W_t (E, K, N) bf16 or fp32; fp32 (master weights)
# is quantized as its bf16 rounding (``as_bf16``: on the kernels without a bf16 copy written and read back)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
_WEIGHT_FORMS = {
    (GemmBackend.EMULATED, "fwd"): lambda w, mode: q.fake_3d(w, mode, -2, _GEMM_DTYPE, True),  # blocks along K
    (GemmBackend.EMULATED, "dgrad"): lambda w, mode: q.fake_3d(w, mode, -1, _GEMM_DTYPE, True),  # along N
    # (E, N, K) with scales (E, N x K/32), and (E, K, N) with scales (E, K x N/32)
    (GemmBackend.SCALED, "fwd"): lambda w, mode: q.scaled_3d(w.transpose(-2, -1), mode, "k", True),
    (GemmBackend.SCALED, "dgrad"): lambda w, mode: q.scaled_3d(w.transpose(-2, -1), mode, "n", True),
}


def _kept_weight(w, mode: ScaleMode, gemm: str):
    """The emulated ``gemm`` operand of ``W_t`` (bf16/fp32) in fp8: ``(data, plain scales)`` of W along K
    (``(E, N, K)``, fwd) or along N (``(E, K, N)``, dgrad), what a reuse scope keeps (:func:`_read_kept`)."""
    data, blocked = q.scaled_3d(w.transpose(-2, -1), mode, "k" if gemm == "fwd" else "n", True)
    return data, layouts.from_blocked_3d(blocked, data.shape[1], data.shape[2] // BLOCK_SIZE)


def _read_kept(kept, gemm: str) -> torch.Tensor:
    """The emulated ``gemm`` operand ``(E, K, N)`` bf16 from :func:`_kept_weight`'s: one dequantization pass, the same
    values and strides as ``_WEIGHT_FORMS`` makes from the weight."""
    data, scales = kept
    e, r, c = data.shape
    w = q.dequantize_rows(data.view(e * r, c), scales.view(e * r, c // BLOCK_SIZE), _GEMM_DTYPE).view(e, r, c)
    return w.transpose(-2, -1) if gemm == "fwd" else w


def weight_operand(W_t, mode: ScaleMode, backend: GemmBackend, gemm: str, scopes: tuple):
    """The ``gemm`` ("fwd" or "dgrad") operand of the weight view ``W_t`` on ``backend``: made here, or
    reused from one of ``scopes`` (:func:`moe_quant.reuse.current` where the forward ran: the forward passes
    them, its backward the ones the forward kept in ``ctx``). The one place the GEMMs of
    :func:`mxfp8_grouped_mm` and of the SwiGLU expert block get their weight operands. What a scope keeps of
    an emulated operand depends on its ``hold`` (:func:`moe_quant.reuse_quantized_weights`): the bf16
    operand (``"bf16"``; ``"bf16-fwd"``, the forward's only), its fp8 form (``"fp8"``, read back per GEMM),
    or nothing (``"bf16-fwd"``'s dgrad operand, made here at each use)."""
    form = _WEIGHT_FORMS[backend, gemm]

    def weight():  # read as bf16 (fp32 master weights: their bf16 rounding, made by the kernels as they load)
        return W_t if W_t.dtype in _WEIGHT_DTYPES else W_t.to(_GEMM_DTYPE)

    def compute():
        return form(weight(), mode)

    held = None
    if backend is GemmBackend.EMULATED and scopes:
        held = {"fp8": (lambda: _kept_weight(weight(), mode, gemm), lambda kept: _read_kept(kept, gemm)),
                "bf16-fwd": reuse.AS_MADE if gemm == "fwd" else reuse.NOT_HELD}
    return reuse.serve(scopes, W_t, (backend.value, gemm, mode), compute, held)


# ----------------------------------------------------------------------------- GEMMs on quantized forms
# A form: the tuple of tensors the GEMM backend takes (:mod:`moe_quant.block_quantize`, whose ``rowwise`` and
# ``colwise`` make the per-GEMM path's): one tensor (bf16 values) in a rowwise form on the emulated GEMM, two (e4m3
# data, blocked scales) on the scaled one. The GEMMs of :func:`mxfp8_grouped_mm` and of the SwiGLU expert block.


def _mm_fwd(row: tuple, w_op, offs: torch.Tensor) -> torch.Tensor:
    """``A @ W_t`` per group from A's rowwise form and the weight's forward operand: ``(M, N)`` bf16."""
    if len(row) == 1:
        return torch._grouped_mm(row[0], w_op, offs=offs)
    (a, a_s), (w, w_s) = row, w_op
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), a_s, w_s, offs=offs, out_dtype=_GEMM_DTYPE)


def _mm_dgrad(row: tuple, w_op, offs: torch.Tensor) -> torch.Tensor:
    """``grad_out @ W`` per group from grad_out's rowwise form and the weight's dgrad operand."""
    if len(row) == 1:
        return torch._grouped_mm(row[0], w_op.transpose(-2, -1), offs=offs)
    (g, g_s), (w, w_s) = row, w_op
    return torch._scaled_grouped_mm(g, w.transpose(-2, -1), g_s, w_s, offs=offs, out_dtype=_GEMM_DTYPE)


def _wgrad_gemm(g_col: tuple, a_col: tuple) -> torch.Tensor:
    """``dW (E, N, K)`` bf16 per group from the colwise (K-groups) forms of grad_out and A, as the GEMM leaves it
    (an expert without tokens: see :func:`_weight_grad`)."""
    if len(g_col) == 2:
        return torch._grouped_mm(g_col[0], a_col[0].t(), offs=g_col[1])
    return torch._scaled_grouped_mm(g_col[0], a_col[0].t(), g_col[1], a_col[1], offs=g_col[2], out_dtype=_GEMM_DTYPE)


def _weight_grad(dW: torch.Tensor, offs, backend: GemmBackend, w_dtype: torch.dtype) -> torch.Tensor:
    """:func:`_wgrad_gemm`'s ``dW`` in ``w_dtype``, an expert without tokens exact zeros."""
    if not (backend is GemmBackend.EMULATED and grouped_mm_zero_fills_empty_groups(dW.device)):
        dW = _zero_empty_experts(dW, offs)  # a full pass over dW, where the GEMM leaves garbage
    return dW if dW.dtype == w_dtype else dW.to(w_dtype)


def _mm_wgrad(g_col: tuple, a_col: tuple, offs: torch.Tensor, backend: GemmBackend, w_dtype) -> torch.Tensor:
    """``dW (E, N, K)`` in the weight's dtype from the colwise forms of grad_out and A; empty experts zero."""
    return _weight_grad(_wgrad_gemm(g_col, a_col), offs, backend, w_dtype)


def _zero_empty_experts(dW: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """An expert without tokens gets an exact zero gradient, whatever the GEMM leaves there."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((sizes > 0).view(-1, 1, 1), dW, 0)


def _empty_contraction(A, W_t) -> bool:
    """K = 0 or N = 0: every product is an empty sum (or an empty matrix), no GEMM to run."""
    return A.shape[1] == 0 or W_t.shape[2] == 0


def output(A, W_t, offs, mode: ScaleMode, out_dtype: torch.dtype, backend: GemmBackend, scopes: tuple):
    if _empty_contraction(A, W_t):  # torch._grouped_mm rejects these shapes; the answer is exact zeros
        return A.new_zeros((A.shape[0], W_t.shape[2]), dtype=out_dtype)
    out = _mm_fwd(bq.rowwise(A, mode, offs, backend is GemmBackend.EMULATED),
                  weight_operand(W_t, mode, backend, "fwd", scopes), offs)
    # never ``out.to(out_dtype)`` when it is already that dtype: that returns ``out`` itself, and torch 2.11's
    # dynamo then traces this Function's backward with a zero output gradient (every gradient zero; fixed in
    # later torch; tests/test_grouped_mm.py::test_compiled_gradients_equal_eager)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _forward(A, W_t, offs, mode: ScaleMode, out_dtype: torch.dtype, backend: GemmBackend):
    """The transforms form's forward: it runs under ``torch.func`` transforms, where no reuse scope serves. (No
    ``scopes`` parameter with a default: ``apply`` would bind it as a seventh input.)"""
    return output(A, W_t, offs, mode, out_dtype, backend, ())


def save_for_backward(ctx, A, W_t, offs) -> None:
    """Save only what backward reads, as the plain op: A for wgrad (dW), W_t for dgrad (dA). A write to a saved
    tensor before backward raises autograd's "modified by an inplace operation" error. The eager forms'
    and the compiled forward op's (:mod:`.grouped_mm_ops`) ``setup_context``."""
    need_A, need_W = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(A if need_W else None, W_t if need_A else None, offs)
    ctx.shapes = (A.shape, A.dtype, W_t.shape, W_t.dtype)


def _setup_context(ctx, inputs, output):
    A, W_t, offs, mode, _, backend = inputs
    save_for_backward(ctx, A, W_t, offs)
    ctx.mode, ctx.backend = mode, backend
    ctx.reuse_scopes = ()  # the reuse scopes that serve dgrad: the eager form's forward sets its own


def backward(ctx, grad_out, stages=None):
    """``(dA, dW_t)`` from ``grad_out`` and what :func:`save_for_backward` saved in ``ctx`` (which also holds
    ``mode``, ``backend`` and ``reuse_scopes``): :func:`input_grads` with ``stages``, made first-order only.
    The one backward of the eager forms and of the compiled forward op."""
    A, W_t, offs = ctx.saved_tensors
    # autograd's reference to A dropped (where nothing can read it again: .saved.free_saved), so that A is freed
    # once input_grads has made its wgrad operand, its last reader
    free_saved(ctx, [0])
    args = (W_t, offs, ctx.mode, ctx.backend, ctx.reuse_scopes, ctx.needs_input_grad[:2], ctx.shapes,
            stages or BackwardStages)
    if not torch.is_grad_enabled():  # the usual backward (no create_graph): grad mode is off already
        held = [A]  # A's one reference here: input_grads drops it once A's wgrad operand is made
        del A
        return input_grads(grad_out, held, *args)
    with torch.no_grad():  # gradients of quantized operands: first order only, see _first_order_only
        grads = input_grads(grad_out, [A], *args)
    return _first_order_only(grads, (grad_out, A, W_t))


def _backward(ctx, grad_out):
    return (*backward(ctx, grad_out), None, None, None, None)


class _MXFP8GroupedMM(torch.autograd.Function):
    """The three GEMMs of one expert layer (eager form: ``forward(ctx, ...)``).

    ``torch.autograd.Function.apply`` binds every call's arguments with ``inspect.signature`` whenever
    the Function defines ``setup_context`` (whatever its defaults), which costs more host time than
    the rest of the call's Python; so eager calls outside ``torch.func`` transforms and ``torch.compile``
    take this form, which has none. :class:`_MXFP8GroupedMMTransforms` is the same function in the
    ``forward`` + ``setup_context`` form that transforms need; both share :func:`output`,
    ``_setup_context`` and ``_backward``.
    """

    @staticmethod
    def forward(ctx, A, W_t, offs, mode, out_dtype, backend):
        inputs = (A, W_t, offs, mode, out_dtype, backend)
        scopes = reuse.current()
        out = output(*inputs, scopes)
        _setup_context(ctx, inputs, out)
        ctx.reuse_scopes = scopes  # the scopes this forward ran in serve its dgrad, on whatever thread
        return out

    backward = staticmethod(_backward)


class _MXFP8GroupedMMTransforms(torch.autograd.Function):
    """:class:`_MXFP8GroupedMM` in the ``forward`` + ``setup_context`` form that ``torch.func`` transforms
    need (``vmap``, ``grad``).

    ``generate_vmap_rule``: under ``torch.vmap`` forward and backward run op by op on batched
    tensors, so a batch of ``A``, ``W_t`` and/or ``offs`` needs no rule of our own. Every op here
    has a batching rule except ``torch._grouped_mm``, which torch 2.13 runs once per batch element
    (with a performance warning), exactly as for a vmapped call of the plain op.
    """

    generate_vmap_rule = True
    forward = staticmethod(_forward)
    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def backward_a_operand(held: list, offs, mode: ScaleMode, backend: GemmBackend) -> tuple:
    """A's colwise form as the wgrad GEMM reads it, from ``held`` (``[A]``, emptied: this is A's last reader, so A
    is freed once it returns where nothing else holds it)."""
    return bq.colwise(held.pop(), mode, offs, backend is GemmBackend.EMULATED)


def backward_wgrad(grad_out, a_col: tuple, offs, mode: ScaleMode, backend: GemmBackend,
                   w_dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient ``dW (E, N, K)`` in ``w_dtype`` from ``grad_out`` (row-major) and A's colwise form
    (:func:`backward_a_operand`); an expert without tokens gets exact zeros."""
    # grad_out's colwise form made here, freed once the GEMM returns (before the zeroing pass)
    return _weight_grad(_wgrad_gemm(bq.colwise(grad_out, mode, offs, backend is GemmBackend.EMULATED), a_col), offs,
                        backend, w_dtype)


def backward_g_operand(grad_out, offs, mode: ScaleMode, backend: GemmBackend) -> tuple:
    """grad_out's (row-major) rowwise form as the dgrad GEMM reads it; the known form where it arrived in MXFP8
    (:mod:`moe_quant.prequantized`)."""
    return bq.rowwise(grad_out, mode, offs, backend is GemmBackend.EMULATED)


def backward_dgrad(g_row: tuple, W_t, offs, mode: ScaleMode, backend: GemmBackend, scopes: tuple,
                   a_dtype: torch.dtype) -> torch.Tensor:
    """The input gradient ``dA (M, K)`` in ``a_dtype`` from grad_out's rowwise form (:func:`backward_g_operand`) and
    the weight's dgrad operand, made here (or served by ``scopes``)."""
    grad_A = _mm_dgrad(g_row, weight_operand(W_t, mode, backend, "dgrad", scopes), offs)
    return grad_A if grad_A.dtype == a_dtype else grad_A.to(a_dtype)


class BackwardStages:
    """:func:`input_grads`' stages: ``a_operand`` (the last reader of ``A``), ``wgrad`` (of A's operand),
    ``g_operand`` (the last reader of ``grad_out``) and ``dgrad`` (of ``W_t``; it makes the weight's dgrad operand).
    Eager they run as they are; under ``torch.compile`` each runs as a custom op (:mod:`.grouped_mm_ops`), so that
    the weight's operand is made in the backward and the compiled backward graph frees ``A`` and ``grad_out``
    (where made in that graph) after the op that reads them last, before the GEMMs that do not read them."""

    a_operand = staticmethod(backward_a_operand)
    wgrad = staticmethod(backward_wgrad)
    g_operand = staticmethod(backward_g_operand)
    dgrad = staticmethod(backward_dgrad)


def input_grads(grad_out, held: list, W_t, offs, mode: ScaleMode, backend: GemmBackend, scopes: tuple, needs: tuple,
                shapes: tuple, stages=BackwardStages):
    """``(dA, dW_t)`` (each ``None`` where ``needs``, the two input-grad flags, is False): dgrad and wgrad of
    quantized operands; ``held``: ``[A]`` (emptied by the stage that reads A, so that A is freed once read where
    the caller keeps no other reference); ``shapes``: ``(A.shape, A.dtype, W_t.shape, W_t.dtype)``. The one home of
    the backward's order; its GEMMs are the ``stages`` (:class:`BackwardStages`, or the custom ops that run them
    under compile)."""
    grad_out = row_major(grad_out)  # an expanded (stride 0) gradient stays one with M = 0 under .contiguous()
    grad_A = grad_W_t = None
    a_shape, a_dtype, w_shape, w_dtype = shapes
    if a_shape[1] == 0 or w_shape[2] == 0:  # dA (M, K) sums over N = 0 terms; dW_t (E, K, N) is zero or empty
        grad_A = grad_out.new_zeros(a_shape, dtype=a_dtype) if needs[0] else None
        grad_W_t = grad_out.new_zeros(w_shape, dtype=w_dtype) if needs[1] else None
        return grad_A, grad_W_t
    # wgrad first: its two dequantized operands (the size of A and grad_out) are freed before dA (the size of A) is
    # allocated; A's operand before grad_out's, and A freed then (its last reader), so A, its operand and
    # grad_out's are never alive together, nor A beside the GEMMs
    if needs[1]:
        a_col = stages.a_operand(held, offs, mode, backend)
        grad_W_t = stages.wgrad(grad_out, a_col, offs, mode, backend, w_dtype).transpose(-2, -1)
        del a_col
    if needs[0]:
        g_row = stages.g_operand(grad_out, offs, mode, backend)
        grad_A = stages.dgrad(g_row, W_t, offs, mode, backend, scopes, a_dtype)
    return grad_A, grad_W_t


DOUBLE_BACKWARD_ERROR = (
    "mxfp8_grouped_mm (MXFP8 grouped GEMM) does not support double backward: its gradients come from "
    "MXFP8-quantized operands, and differentiating them again (create_graph=True followed by a backward "
    "through them: Hessian-vector products, gradient penalties, torch.func.hessian / grad of grad) would "
    "differentiate the unscaled fp8 cast, which is wrong. Take second-order gradients only through the "
    "rest of the model, or run these experts unconverted."
)


FORWARD_AD_ERROR = (
    "mxfp8_grouped_mm (MXFP8 grouped GEMM) does not support forward-mode AD (torch.func.jvp, jacfwd) nor "
    "double backward (torch.func.hessian, which differentiates a gradient forward-mode): its gradients come "
    "from MXFP8-quantized operands, whose derivative is not that of the GEMM. Take second-order or "
    "forward-mode derivatives only through the rest of the model, or run these experts unconverted."
)


class _NotDifferentiable(torch.autograd.Function):
    """``(dA, dW_t)`` unchanged, attached to the tensors they were computed from; differentiating
    them raises :data:`DOUBLE_BACKWARD_ERROR`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_A, grad_W_t, grad_out, A, W_t):
        return tuple(None if g is None else g.view_as(g) for g in (grad_A, grad_W_t))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _first_order_only(grads, inputs):
    """``grads`` as they are, unless backward records a graph (``create_graph=True``) that could reach
    back through them: then the same values with a ``grad_fn`` that raises :data:`DOUBLE_BACKWARD_ERROR`
    and whose edges lead to ``inputs`` (``grad_out``, ``A``, ``W_t``), so that a second-order gradient
    with respect to anything upstream reaches it. First-order use of the gradients is unchanged."""
    # A / W_t are None where backward did not need them (not saved)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return grads
    return _NotDifferentiable.apply(*grads, *inputs)


# the compiled path's revision (:func:`.revision.source_revision`): its forward op's argument that nothing reads
COMPILED_REVISION = source_revision("grouped_mm.py", "grouped_mm_ops.py")


def mxfp8_grouped_mm(
    A: torch.Tensor,
    W_t: torch.Tensor,
    offs: torch.Tensor,
    *,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: GemmBackend | str = GemmBackend.AUTO,
    validate_offsets: bool | None = None,
) -> torch.Tensor:
    """MXFP8 grouped GEMM, a differentiable drop-in for ``torch._grouped_mm(A, W_t, offs=offs)``.

    Args:
        A: ``(M, K)`` bf16 or fp32 activations, tokens grouped by expert; K a multiple of 32.
        W_t: ``(E, K, N)`` bf16 or fp32 (fp32 master weights are read as bf16; their gradient is
            returned in fp32), normally ``W.transpose(-2, -1)`` of an ``(E, N, K)`` expert parameter;
            N a multiple of 32. K = 0 or N = 0 give the exact answer (zeros of shape ``(M, N)``,
            zero or empty gradients) without running a GEMM, where ``torch._grouped_mm`` raises.
        offs: ``(E,)`` int32 cumulative end offsets of each expert's tokens (any sizes, 0 included).
            Rows past ``offs[-1]`` are not computed: their output and input gradient are
            unspecified, as in ``torch._grouped_mm``.
        scale_mode: ``"rceil"`` (default) or ``"floor"``.
        out_dtype: ``torch.bfloat16`` or ``torch.float32`` (the bf16 GEMM result, widened).
        backend: ``"auto"`` (scaled on SM100+, else emulated), ``"emulated"``, ``"scaled"``.
        validate_offsets: check ``offs`` values (non-negative, non-decreasing, ``offs[-1] <= M``)
            and raise ``ValueError`` otherwise. Default: only when ``offs`` is on the CPU, since
            reading a GPU tensor synchronizes. Bad values never cause out-of-bounds accesses either
            way: offsets are clamped to [0, M] and made monotone internally. Under
            ``torch.compile`` (``fullgraph``, ``dynamic`` included) the check is the custom op
            ``moe_quant::check_offsets`` in the graph and raises the same ``ValueError`` when the
            compiled code runs; with ``validate_offsets=True`` on CUDA it synchronizes there too, so
            leave it off inside CUDA graphs. Under ``torch.vmap`` a batched ``offs`` is checked for
            every batch element. See ``docs/public_api.md``.

    Inside :func:`moe_quant.reuse_quantized_weights` the quantized weight operands of fwd and dgrad
    (views of the scope's model's parameters) are made once and reused.

    ``torch.func`` transforms work: ``vmap`` over a batch of ``A``, ``W_t`` and/or ``offs``
    (forward and backward run batched; ``torch._grouped_mm`` has no batching rule in torch 2.13,
    so PyTorch loops over the batch inside it, with a performance warning) and ``grad``.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    mode = ScaleMode.parse(scale_mode)
    offs = check_grouped_mm_args(A, W_t, offs, out_dtype, validate_offsets)
    gemm = resolve_gemm_backend(backend, A.device)
    # unvalidated offsets must not reach the GEMMs' device-side asserts: clamp on the device
    offs = sanitize_offsets(offs, A.shape[0], torch.int32)
    compiling, transforms = torch.compiler.is_compiling(), torch._C._are_functorch_transforms_active()
    if compiling and not transforms:
        # the custom ops (.grouped_mm_ops, registered when moe_quant.autograd is imported; called by name: no import
        # cycle): AOTAutograd's partitioner would otherwise save the weights' dgrad operands, made in the forward.
        # Inside torch.func transforms the traced Function stays: custom ops' autograd does not serve functorch's
        return torch.ops.moe_quant.grouped_mm_fwd.default(row_major(A), W_t, offs, mode.value, out_dtype, gemm.value,
                                                          COMPILED_REVISION)
    if not compiling:
        _check_no_forward_ad(A, W_t)
    fn = _MXFP8GroupedMMTransforms if transforms else _MXFP8GroupedMM  # transforms need the setup_context form
    return fn.apply(row_major(A), W_t, offs, mode, out_dtype, gemm)


def _check_no_forward_ad(*tensors) -> None:
    """Raise :data:`FORWARD_AD_ERROR` under forward-mode AD (``torch.func.jvp`` / ``jacfwd`` / ``hessian``,
    or dual tensors of ``torch.autograd.forward_ad``), where PyTorch would ask for a jvp rule."""
    if torch._C._are_functorch_transforms_active():
        stack = torch._C._functorch.get_interpreter_stack() or ()
        if any(i.key() == torch._C._functorch.TransformType.Jvp for i in stack):
            raise RuntimeError(FORWARD_AD_ERROR)
    if torch.autograd.forward_ad._current_level >= 0:
        if any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors):
            raise RuntimeError(FORWARD_AD_ERROR)
