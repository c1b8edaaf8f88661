"""Torch ops over the SwiGLU expert block's fused quantization kernel (``kernel.py``).

Each op returns a list: per output tensor ``[row_data, row_scales, col_data, col_scales]`` (with ``fake``:
``[row_data, col_data]``, the dequantized bf16 values), then the padded group ends ``poffs`` (the colwise
layout's group offsets). ``block_dswiglu`` with ``stacked`` (``fake`` only) returns ``[row_data (M, 2R),
col_data (2R, Mp), poffs]`` instead: both forms of ``[grad_a | grad_b]``, which a weight concatenating the
gate and up projections takes (dx and dW13), the rowwise values of grad_a and grad_b side by side along
columns (the kernel's stacked variant: row pitch 2R) and their colwise values stacked along rows; the
kernel writes each half in place, no copy. ``block_swiglu`` with ``forms`` "rows" or "cols" returns that form
alone (then ``poffs``); ``block_dual`` with ``cols_fp8`` (``fake``) ``[row_data, col_data e4m3, col plain scales,
poffs]``. Rowwise data ``(M, R)``, M-groups blocked scales
``layouts.m_groups_blocked_shape(M, R/32, G)``, colwise data ``(R, Mp)``, K-groups blocked scales
``layouts.k_groups_blocked_shape(R, M, G)``. Registered as ``torch.ops.moe_quant.block_*`` custom ops with fake implementations
(``torch.compile(fullgraph=True)``); eager calls on plain tensors launch directly, as the other families.
Arguments are checked by the caller (:mod:`moe_quant.block_quantize`); ``offs`` is sanitized or not, the
kernel clamps it either way.
"""

from __future__ import annotations

import torch

from ... import layouts
from ...numerics import BLOCK_SIZE, ScaleMode
from .. import compile_cache as cc
from . import config
from .config import N_OUTPUTS, Variant

_FP8 = torch.float8_e4m3fn


def _key(op: str, mode: str, out: str, stacked: bool, cols_fp8: bool = False, forms: str = "both") -> tuple:
    """The ops' kernel key (``compile_cache.kernel_for``) of the default variant with these fields."""
    return (("block", op, mode, out, stacked) + (("cols_fp8",) if cols_fp8 else ())
            + ((forms,) if forms != "both" else ()))


def _kernel(op: str, mode: str, fake: bool, device: torch.device, stacked: bool = False,
            cols_fp8: bool = False, forms: str = "both") -> cc.Compiled:
    out = "bfloat16" if fake else "float8_e4m3fn"
    return cc.kernel_for(_key(op, mode, out, stacked, cols_fp8, forms),
                         lambda: Variant(op, "bfloat16", mode, out, stacked=stacked, cols_fp8=cols_fp8, forms=forms),
                         device)


def variant_in_place(variant: Variant, device: torch.device):
    """Context manager: within it, the op that launches the default variant with ``variant``'s op, mode, output,
    ``stacked``, ``cols_fp8`` and ``forms`` on ``device`` launches ``variant`` (an A/B candidate,
    ``config.CANDIDATES``) instead."""
    return cc.in_place_of(_key(variant.op, variant.mode, variant.out_dtype, variant.stacked, variant.cols_fp8,
                               variant.forms), variant, device)


def _compile_checked(v: Variant, fields: dict, checked: set) -> bool:
    """Whether ``v`` (rceil) with a candidate's ``fields`` is a compile-checked variant (``config.candidate_variants``;
    False where those fields do not combine with ``v``'s)."""
    try:
        return v.replace(mode="rceil", **fields) in checked
    except ValueError:
        return False


def candidate_in_place(stack, name: str, device: torch.device, ops=config.OPS) -> list[str]:
    """Enter (on the ``contextlib.ExitStack`` ``stack``) :func:`variant_in_place` of candidate ``name``
    (``config.candidates``) for every default variant of ``ops`` that has it: both modes and outputs, and the
    stacked (and ``cols_fp8``) dswiglu variants where the candidate's is compile-checked
    (``config.candidate_variants``).
    Returns the ops it was put in place for (how the GPU tests and ``scripts/sanitize_block.py`` run a candidate)."""
    checked = set(config.candidate_variants())
    served = []
    for v in config.all_variants():
        fields = config.candidates(v.op, v.out_dtype).get(name)
        if v.op not in ops or not fields or ((v.stacked or v.cols_fp8 or v.forms != "both")
                                             and not _compile_checked(v, fields, checked)):
            continue
        stack.enter_context(variant_in_place(v.replace(**fields), device))
        served.append(v.op)
    return sorted(set(served))


def _shapes(m: int, r: int, g: int):
    """(row data, row scales, col data, col scales) shapes of one output tensor."""
    return ((m, r), layouts.m_groups_blocked_shape(m, r // BLOCK_SIZE, g), (r, layouts.k_groups_padded_len(m, g)),
            layouts.k_groups_blocked_shape(r, m, g))


def _alloc(like: torch.Tensor, g: int, fake: bool, empty, stacked: bool = False, cols_fp8: bool = False,
           forms: str = "both"):
    """One output tensor's buffers; ``stacked``: no data buffers (the caller's stacked ones serve; with ``cols_fp8``
    no scale buffer either); ``cols_fp8`` (with ``fake``): the colwise data e4m3 with its plain K-groups scales
    ``(R, Mp/32)``; ``forms`` "rows" / "cols": the other form's buffers None."""
    m, r = like.shape
    rd, rs, cd, cs = _shapes(m, r, g)
    dt = torch.bfloat16 if fake else _FP8
    if cols_fp8:
        bufs = [None if stacked else empty(rd, dt), None, None if stacked else empty(cd, _FP8),
                None if stacked else empty(layouts.k_groups_plain_shape(r, m, g), torch.uint8)]
    else:
        bufs = [None if stacked else empty(rd, dt), None if fake else empty(rs, torch.uint8),
                None if stacked else empty(cd, dt), None if fake else empty(cs, torch.uint8)]
    return bufs[:2] + [None, None] if forms == "rows" else [None, None] + bufs[2:] if forms == "cols" else bufs


def _stacked_shapes(m: int, r: int, g: int):
    """(row data, col data, col plain scales) shapes of ``[grad_a | grad_b]``: ``(M, 2R)``, ``(2R, Mp)`` and (the
    ``cols_fp8`` variants') ``(2R, Mp/32)``."""
    return (m, 2 * r), (2 * r, layouts.k_groups_padded_len(m, g)), layouts.k_groups_plain_shape(2 * r, m, g)


def _impl(op: str, inputs: tuple, mode: str, offs: torch.Tensor, fake: bool, stacked: bool = False,
          cols_fp8: bool = False, forms: str = "both"):
    x = inputs[0]
    m, r = x.shape
    g = offs.shape[0]
    outs = []
    for _ in range(N_OUTPUTS[op]):
        outs += _alloc(x, g, fake, lambda s, d: cc.empty(s, d, x.device), stacked, cols_fp8, forms)
    if stacked:
        # one (M, 2R) rowwise buffer, grad_a's values in columns [:R], grad_b's in [R:] (the kernel's row pitch
        # 2R; passed once, as output 0's rowwise data), and one (2R, Mp) colwise buffer whose two row halves
        # (each contiguous) are the two outputs' colwise data; cols_fp8: likewise one (2R, Mp/32) plain scale buffer
        row_shape, col_shape, scale_shape = _stacked_shapes(m, r, g)
        row = cc.empty(row_shape, torch.bfloat16, x.device)
        col = cc.empty(col_shape, _FP8 if cols_fp8 else torch.bfloat16, x.device)
        outs[0], outs[2], outs[6] = row, col[:r], col[r:]
        if cols_fp8:
            col_scales = cc.empty(scale_shape, torch.uint8, x.device)
            outs[3], outs[7] = col_scales[:r], col_scales[r:]
    for t in outs:
        if t is not None and t.dtype == torch.uint8 and t.numel() > cc.INT32_MAX:
            raise ValueError(f"block_{op}: scale buffer of {t.numel()} bytes exceeds the int32 index range")
    poffs = cc.empty((g,), torch.int32, x.device)
    if m * r and g:
        args = [cc.aligned(t) for t in inputs] + [None] * (3 - len(inputs)) + outs + [None] * (8 - len(outs))
        cc.launch(_kernel(op, mode, fake, x.device, stacked, cols_fp8, forms), *args, offs, poffs)
    else:  # nothing to read: the padded offsets and all-zero outputs follow from the shapes
        poffs.copy_(layouts.padded_group_offsets(offs, m))
        for t in outs:
            if t is not None:
                t.view(torch.uint8).zero_()
    if stacked:
        return [row, col, col_scales.view(torch.float8_e8m0fnu), poffs] if cols_fp8 else [row, col, poffs]
    return [t.view(torch.float8_e8m0fnu) if t.dtype == torch.uint8 else t for t in outs if t is not None] + [poffs]


def _fake_outputs(op: str, x: torch.Tensor, offs: torch.Tensor, fake: bool, stacked: bool = False,
                  cols_fp8: bool = False, forms: str = "both"):
    outs = []
    for _ in range(N_OUTPUTS[op]):
        outs += _alloc(x, offs.shape[0], fake, lambda s, d: x.new_empty(s, dtype=torch.float8_e8m0fnu
                                                                      if d == torch.uint8 else d), stacked, cols_fp8,
                       forms)
    outs = [t for t in outs if t is not None]
    if stacked:  # [row data (M, 2R), col data (2R, Mp), (cols_fp8: col plain scales (2R, Mp/32),) poffs]
        row_shape, col_shape, scale_shape = _stacked_shapes(x.shape[0], x.shape[1], offs.shape[0])
        outs = [x.new_empty(row_shape), x.new_empty(col_shape, dtype=_FP8 if cols_fp8 else x.dtype)]
        outs += [x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu)] if cols_fp8 else []
    return outs + [offs.new_empty(offs.shape)]


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("moe_quant::block_dual", mutates_args=(), device_types="cuda")
def _block_dual_op(x: torch.Tensor, mode: str, offs: torch.Tensor, fake: bool, cols_fp8: bool) -> list[torch.Tensor]:
    return _impl("dual", (x,), mode, offs, fake, cols_fp8=cols_fp8)


@_block_dual_op.register_fake
def _(x, mode, offs, fake, cols_fp8):
    return _fake_outputs("dual", x, offs, fake, cols_fp8=cols_fp8)


@torch.library.custom_op("moe_quant::block_swiglu", mutates_args=(), device_types="cuda")
def _block_swiglu_op(a: torch.Tensor, b: torch.Tensor, mode: str, offs: torch.Tensor,
                     fake: bool, forms: str) -> list[torch.Tensor]:
    return _impl("swiglu", (a, b), mode, offs, fake, forms=forms)


@_block_swiglu_op.register_fake
def _(a, b, mode, offs, fake, forms):
    return _fake_outputs("swiglu", a, offs, fake, forms=forms)


@torch.library.custom_op("moe_quant::block_dswiglu", mutates_args=(), device_types="cuda")
def _block_dswiglu_op(
    grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: str, offs: torch.Tensor, fake: bool,
    stacked: bool, cols_fp8: bool
) -> list[torch.Tensor]:
    return _impl("dswiglu", (grad_h, a, b), mode, offs, fake, stacked, cols_fp8)


@_block_dswiglu_op.register_fake
def _(grad_h, a, b, mode, offs, fake, stacked, cols_fp8):
    return _fake_outputs("dswiglu", grad_h, offs, fake, stacked, cols_fp8)


# ----------------------------------------------------------------------------- public API


def _check(op: str, inputs: tuple, offs) -> None:
    x = inputs[0]
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
            raise TypeError(f"block_{op}: inputs must be 2D bfloat16 tensors, got {getattr(t, 'dtype', type(t))}")
        if t.shape != x.shape or t.device != x.device:
            raise ValueError(f"block_{op}: inputs must share shape and device, got {tuple(t.shape)} on {t.device}")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"block_{op}: R = {x.shape[1]} must be a multiple of {BLOCK_SIZE}")
    if not x.is_cuda:
        raise ValueError(f"block_{op}: inputs must be on a CUDA device, got {x.device}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device:
        raise TypeError(f"block_{op}: offs must be a 1D int32 tensor on {x.device}")


def _run(op: str, inputs: tuple, mode, offs, fake: bool, extra: dict):
    """``extra``: the op's own arguments by name, in its signature's order (passed by position to the custom op, to
    ``_impl`` by name)."""
    mode = ScaleMode.parse(mode, "mode")
    _check(op, inputs, offs)
    if cc.via_dispatcher(inputs[0]):
        return getattr(torch.ops.moe_quant, f"block_{op}")(*inputs, mode.value, offs, fake, *extra.values())
    return _impl(op, inputs, mode.value, offs, fake, **extra)


def block_dual(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor, fake: bool, cols_fp8: bool = False):
    """Both forms of ``x (M, R)`` bf16 in one read: ``[row_data, row_scales, col_data, col_scales, poffs]``
    (``[row_data, col_data, poffs]`` with ``fake``). ``cols_fp8`` (with ``fake``; config ``cols_fp8``): the colwise
    form in fp8 and plain K-groups scales ``(R, Mp/32)`` (what ``block_quantize.colwise_kept`` makes for the emulated
    GEMM) beside the rowwise bf16 values: ``[row_data, col_data, col_scales, poffs]``."""
    if cols_fp8 and not fake:
        raise ValueError("block_dual: cols_fp8 writes bf16 rowwise values beside fp8 colwise data: it needs fake=True "
                         "(with fake=False both forms are fp8 already)")
    return _run("dual", (x,), mode, offs, fake, dict(cols_fp8=cols_fp8))


def block_swiglu(a: torch.Tensor, b: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor, fake: bool,
                 forms: str = "both"):
    """The forms of ``h = silu(a) * b`` (PyTorch's CUDA numerics), as :func:`block_dual` writes them: ``forms``
    "both", or "rows" (``[row_data, (row_scales,) poffs]``) or "cols" (``[col_data, (col_scales,) poffs]``) alone."""
    if forms not in config.FORMS:
        raise ValueError(f"block_swiglu: forms must be one of {config.FORMS}, got {forms!r}")
    return _run("swiglu", (a, b), mode, offs, fake, dict(forms=forms))


def block_dswiglu(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: ScaleMode | str,
                  offs: torch.Tensor, fake: bool, stacked: bool = False, cols_fp8: bool = False):
    """Both forms of ``grad_a``, then of ``grad_b`` (the SwiGLU backward), then ``poffs``; ``stacked`` (with
    ``fake``): ``[row_data (M, 2R), col_data (2R, Mp), poffs]``, both forms of ``[grad_a | grad_b]`` (see the
    module doc). ``cols_fp8`` (with ``fake``; config ``cols_fp8``): the colwise forms in fp8 and plain K-groups
    scales ``(R, Mp/32)`` (``layouts.k_groups_plain_shape``: what ``block_quantize.colwise_kept`` makes for the
    emulated GEMM), the rowwise ones bf16 values: per output ``[row_data, col_data, col_scales]``; with ``stacked``
    ``[row_data (M, 2R), col_data (2R, Mp) e4m3, col_scales (2R, Mp/32), poffs]`` (grad_a's rows, then grad_b's)."""
    if stacked and not fake:
        raise ValueError("block_dswiglu: stacked colwise forms exist for fake=True (bf16 values) only: the "
                         "K-groups scale buffer is group-major, two of them do not stack")
    if cols_fp8 and not fake:
        raise ValueError("block_dswiglu: cols_fp8 writes bf16 rowwise forms beside fp8 colwise ones: it needs "
                         "fake=True (with fake=False both forms are fp8 already)")
    return _run("dswiglu", (grad_h, a, b), mode, offs, fake, dict(stacked=stacked, cols_fp8=cols_fp8))
