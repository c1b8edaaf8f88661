"""Torch ops over the rowwise 1x32 CuTe-DSL kernel (``kernel.py``), and the 3D weights along K.

``quantize_1x32`` / ``fake_quantize_1x32`` validate their arguments, allocate the outputs and launch a
compiled kernel (:mod:`moe_quant.kernels.compile_cache`). They are registered as ``torch.library`` custom
ops (``torch.ops.moe_quant.*``) with fake implementations, so ``torch.compile(fullgraph=True)`` keeps them
in the graph; in eager mode on plain tensors the Python wrappers call the implementation directly (no
dispatcher round trip), which keeps the host overhead of a call small.
"""

from __future__ import annotations

import torch

from ... import layouts
from ...numerics import BLOCK_SIZE, ScaleMode
from .. import compile_cache as cc
from .config import Variant

IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
FAKE_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SCALE_LAYOUTS = ("blocked", "plain")

# ----------------------------------------------------------------------------- validation

def _check_x(x, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be 2D (M, K), got shape {tuple(x.shape)}")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"{fn}: x.shape[1] (K={x.shape[1]}) must be a multiple of {BLOCK_SIZE}")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: x must be contiguous (row-major), got strides {x.stride()}")


# the modes and their own spellings -> ScaleMode.parse's value, looked up (other spellings: parse)
_MODE_VALUES = {**{m.value: m.value for m in ScaleMode}, **{m: m.value for m in ScaleMode}}
_MODE_TYPES = (str, ScaleMode)  # the types looked up there (not every argument hashes: a list raises TypeError)


def _hot_path(x, offs, mode):
    """``(shape, dtype, device, mode's value)`` of ``x`` where the public ops' checks of ``mode``, ``x`` and ``offs``
    (``ScaleMode.parse``, :func:`_check_x`, :func:`_check_offs`, :func:`_check_device`) pass on the eager path (a
    mode spelled as its value or member, a plain tensor, not tracing), each property read once and no check function
    called; None for anything else: the caller then runs those checks (each failure its own error) and the custom op
    where it dispatches."""
    value = _MODE_VALUES.get(mode) if type(mode) in _MODE_TYPES else None
    if value is None or cc.via_dispatcher(x):
        return None
    shape, dtype, device = x.shape, x.dtype, x.device
    if (dtype in IN_DTYPES and len(shape) == 2 and not shape[1] % BLOCK_SIZE
            and (x.is_cuda or cc.CPU_STUBS and x.is_cpu) and x.is_contiguous()  # _on_kernel_device, inlined
            and (offs is None or (type(offs) is torch.Tensor and offs.dtype is torch.int32 and offs.dim() == 1
                                  and offs.device == device))):
        return shape, dtype, device, value
    return None


def _on_kernel_device(x: torch.Tensor) -> bool:
    return x.is_cuda or cc.CPU_STUBS and x.is_cpu


def _check_device(x, fn: str) -> None:
    if not _on_kernel_device(x):
        raise ValueError(f"{fn}: x must be on a CUDA device, got {x.device}")


def _check_offs(offs, x: torch.Tensor, fn: str) -> None:
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{fn}: offs must be a torch.Tensor or None, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{fn}: offs must be int32, got {offs.dtype}")
    if offs.dim() != 1:
        raise ValueError(f"{fn}: offs must be 1D (G,), got shape {tuple(offs.shape)}")
    if offs.device != x.device and _on_kernel_device(x):  # (x elsewhere: _check_device says so)
        raise ValueError(f"{fn}: offs must be on the same device as x ({x.device}), got {offs.device}")


def _scale_shape(m: int, k: int, g: int | None, scale_layout: str) -> tuple[int, int]:
    """Shape of the scale buffer of ``x (m, k)`` with ``g`` groups (None: no offs)."""
    kb = k // BLOCK_SIZE
    if g is not None:
        return layouts.m_groups_blocked_shape(m, kb, g)
    if scale_layout == "blocked":
        return layouts.blocked_shape(m, kb)
    return m, kb


# ----------------------------------------------------------------------------- implementations


def _spec(dtype: torch.dtype, mode: str, kind: str, out: str, as_bf16: bool) -> tuple:
    """``(key, make_variant)`` of the variant for an input of ``dtype`` (``compile_cache.kernel_for``): the one
    home of both."""
    as_bf16 = as_bf16 and dtype == torch.float32  # a bf16 input is its own rounding
    return ("q1x32", dtype, mode, kind, out, as_bf16), lambda: Variant(IN_DTYPES[dtype], mode, kind, out, as_bf16=as_bf16)


def _kernel_for(x: torch.Tensor, mode: str, kind: str, out: str, as_bf16: bool = False) -> cc.Compiled:
    return cc.kernel_for(*_spec(x.dtype, mode, kind, out, as_bf16), x.device)


# the eager calls' plans (compile_cache.plan): the key of _launch_quantize / _fake_impl -> _plan's answer
_PLANS: dict = cc.plan_table()


def _plan(shape, g, scale_layout, dtype, mode, as_bf16, out, device):
    """``(scale shape or None, the compiled kernel on ``device`` or None where nothing launches)`` of a call on ``x``
    of ``shape`` and ``dtype``; ``g``: offs' length or None; ``out``: "float8_e4m3fn" to quantize, the output dtype's
    name to fake-quantize."""
    m, k = shape
    if out == "float8_e4m3fn":
        kind = "mgroups" if g is not None else ("blocked" if scale_layout == "blocked" else "plain")
        scale_shape = _scale_shape(m, k, g, scale_layout)
        if scale_shape[0] * scale_shape[1] > cc.INT32_MAX:
            raise ValueError(f"quantize_1x32: scale buffer of {scale_shape[0] * scale_shape[1]} bytes exceeds the "
                             "int32 index range")
        launches = m * k or scale_shape[0] * scale_shape[1]
    else:
        kind, scale_shape, launches = "fake", None, m * k
    if not launches:
        return scale_shape, None
    key, make = _spec(dtype, mode, kind, out, as_bf16)
    return scale_shape, cc.kernel_for(key, make, device)


def _quantize_impl(x: torch.Tensor, mode: str, offs, scale_layout: str, as_bf16: bool = False):
    return _launch_quantize(x, x.shape, x.dtype, x.device, mode, offs, scale_layout, as_bf16)


def _launch_quantize(x, shape, dtype, device, mode: str, offs, scale_layout: str, as_bf16: bool):
    """:func:`_quantize_impl` of ``x``'s shape, dtype and device, read by the caller (the public op reads them once,
    for its checks and here)."""
    # the launch path of every eager call (host time): one dict lookup for everything that follows from the shapes
    key = (shape, None if offs is None else offs.shape[0], scale_layout, dtype, mode, as_bf16, "float8_e4m3fn", device)
    scale_shape, kernel = _PLANS.get(key) or cc.plan(_PLANS, key, _plan)
    data = torch.empty(size=shape, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(size=scale_shape, dtype=torch.float8_e8m0fnu, device=device)
    if cc.POISON_OUTPUTS:
        cc.poison(data, scales)
    if kernel is not None:
        kernel.call(cc.aligned(x), data, scales, offs)
    return data, scales


def _fake_impl(x: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False):
    shape = x.shape
    device = x.device
    key = (shape, None, None, x.dtype, mode, as_bf16, FAKE_OUT_DTYPES[out_dtype], device)
    _, kernel = _PLANS.get(key) or cc.plan(_PLANS, key, _plan)
    out = torch.empty(size=shape, dtype=out_dtype, device=device)
    if cc.POISON_OUTPUTS:
        cc.poison(out)
    if kernel is not None:
        kernel.call(cc.aligned(x), out, None, None)
    return out


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("moe_quant::quantize_1x32", mutates_args=(), device_types="cuda")
def _quantize_1x32_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor | None, scale_layout: str, as_bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, mode, offs, scale_layout, as_bf16)


@_quantize_1x32_op.register_fake
def _(x, mode, offs, scale_layout, as_bf16=False):
    m, k = x.shape
    srows, scols = _scale_shape(m, k, None if offs is None else offs.shape[0], scale_layout)
    data = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((srows, scols), dtype=torch.float8_e8m0fnu)
    return data, scales


@torch.library.custom_op("moe_quant::fake_quantize_1x32", mutates_args=(), device_types="cuda")
def _fake_quantize_1x32_op(x: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False) -> torch.Tensor:
    return _fake_impl(x, mode, out_dtype, as_bf16)


@_fake_quantize_1x32_op.register_fake
def _(x, mode, out_dtype, as_bf16=False):
    return x.new_empty(x.shape, dtype=out_dtype)


# ----------------------------------------------------------------------------- public API


def quantize_1x32(
    x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor | None = None, scale_layout: str = "blocked"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1x32 MXFP8: ``(data float8_e4m3fn (M, K), scales float8_e8m0fnu)``.

    Scales: with ``offs`` the M-groups blocked buffer ``layouts.m_groups_blocked_shape(M, K/32, G)``;
    without, ``scale_layout="blocked"`` gives ``layouts.to_blocked`` of the whole matrix and
    ``"plain"`` gives ``(M, K/32)``. Bit-identical to :func:`moe_quant.reference.quantize_rowwise`.
    """
    hot = _hot_path(x, offs, mode) if scale_layout in SCALE_LAYOUTS else None
    if hot is not None:
        shape, dtype, device, value = hot
        return _launch_quantize(x, shape, dtype, device, value, offs, scale_layout, False)
    # anything else (tracing, a subclass, another spelling of the mode, bad arguments): each check in turn, each
    # failure its own error
    fn = "quantize_1x32"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    if offs is not None:
        _check_offs(offs, x, fn)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{fn}: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    _check_device(x, fn)
    return run_quantize_1x32(x, mode.value, offs, scale_layout)


def run_quantize_1x32(x: torch.Tensor, mode: str, offs, scale_layout: str, as_bf16: bool = False):
    """:func:`quantize_1x32` of arguments its caller has checked (``mode`` a value string): the custom op
    while tracing or on a tensor subclass, else the launch itself (the autograd functions' hot path).
    ``as_bf16``: a float32 ``x`` is quantized as ``x.to(torch.bfloat16)`` (rounded in the kernel)."""
    if cc.via_dispatcher(x):
        return torch.ops.moe_quant.quantize_1x32(x, mode, offs, scale_layout, as_bf16)
    return _launch_quantize(x, x.shape, x.dtype, x.device, mode, offs, scale_layout, as_bf16)


def fake_quantize_1x32(x: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantized rowwise 1x32 MXFP8 of ``x`` as ``out_dtype`` (bf16 or fp32), in one pass.

    Bit-identical to :func:`moe_quant.reference.fake_quantize_rowwise` (NaN blocks are the
    canonical NaN: bf16 0x7FC0, fp32 0x7FC00000).
    """
    fn = "fake_quantize_1x32"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    if out_dtype not in FAKE_OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    _check_device(x, fn)
    return run_fake_quantize_1x32(x, mode.value, out_dtype)


def run_fake_quantize_1x32(x: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False) -> torch.Tensor:
    """:func:`fake_quantize_1x32` of checked arguments (see :func:`run_quantize_1x32`)."""
    if cc.via_dispatcher(x):
        return torch.ops.moe_quant.fake_quantize_1x32(x, mode, out_dtype, as_bf16)
    return _fake_impl(x, mode, out_dtype, as_bf16)


# ----------------------------------------------------------------------------- 3D along K: the 1x32 kernel


def _check_out_dtype(fn: str, out_dtype) -> None:
    if out_dtype not in FAKE_OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _check_w(w, fn: str, dims=((1, "N"), (2, "K"))) -> None:
    """``w (E, N, K)``: bf16/fp32, contiguous, on CUDA, ``dims`` multiples of 32."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 3:
        raise ValueError(f"{fn}: w must be 3D (E, N, K), got shape {tuple(w.shape)}")
    if w.dtype not in IN_DTYPES:
        raise TypeError(f"{fn}: w must be bfloat16 or float32, got {w.dtype}")
    for dim, name in dims:
        if w.shape[dim] % BLOCK_SIZE:
            raise ValueError(f"{fn}: w.shape[{dim}] ({name}={w.shape[dim]}) must be a multiple of {BLOCK_SIZE}")
    if not w.is_contiguous():
        raise ValueError(f"{fn}: w must be contiguous (E, N, K), got strides {w.stride()}")
    if not w.is_cuda:
        raise ValueError(f"{fn}: w must be on a CUDA device, got {w.device}")


def _uniform_offsets(e: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, e + 1, dtype=torch.int32, device=device) * n


def quantize_3d_along_k(w: torch.Tensor, mode: ScaleMode | str):
    """Expert weights ``w (E, N, K)`` in blocks of 32 along K: ``(data (E, N, K) e4m3, scales (E, blocked
    N x K/32) e8m0)``: the 1x32 kernel on ``(E*N, K)`` with E groups of N rows, whose M-groups layout is
    the per-expert blocked layout (the whole-matrix blocked layout when N % 128 == 0)."""
    fn = "quantize_3d_along_k"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn, dims=((2, "K"),))
    return run_3d_along_k(w, mode.value)


def run_3d_along_k(w: torch.Tensor, mode: str, as_bf16: bool = False):
    """:func:`quantize_3d_along_k` of checked arguments (``mode`` a value string; ``as_bf16``: a float32
    ``w`` quantized as ``w.to(torch.bfloat16)``, rounded in the kernel)."""
    e, n, k = w.shape
    rp, cp = layouts.blocked_shape(n, k // BLOCK_SIZE)
    x = w.view(e * n, k)
    if n % layouts.TILE_ROWS == 0:
        data, scales = run_quantize_1x32(x, mode, None, "blocked", as_bf16)
    else:
        data, scales = run_quantize_1x32(x, mode, _uniform_offsets(e, n, w.device), "blocked", as_bf16)
        scales = scales[: e * rp]
    return data.view(e, n, k), scales.reshape(e, rp * cp)


def fake_quantize_3d_along_k(w: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized ``w (E, N, K)`` in blocks of 32 along K (same shape), in one pass."""
    fn = "fake_quantize_3d_along_k"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn, dims=((2, "K"),))
    _check_out_dtype(fn, out_dtype)
    return run_fake_3d_along_k(w, mode.value, out_dtype)


def run_fake_3d_along_k(w: torch.Tensor, mode: str, out_dtype: torch.dtype, as_bf16: bool = False) -> torch.Tensor:
    """:func:`fake_quantize_3d_along_k` of checked arguments (``mode`` a value string; ``as_bf16`` as in
    :func:`run_3d_along_k`)."""
    e, n, k = w.shape
    return run_fake_quantize_1x32(w.view(e * n, k), mode, out_dtype, as_bf16).view(e, n, k)
