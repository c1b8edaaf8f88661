"""Activations whose rowwise (1x32) MXFP8 form is already known, so the grouped GEMM skips quantizing them.

Expert parallelism sends tokens (dispatch) and output gradients (combine backward) in MXFP8: the
receiving rank gets fp8 data and e8m0 scales and dequantizes them into the tensor the experts see.
:func:`remember` records that a tensor's values *are* such a dequantization (optionally with the fp8
data and plain scales, which the scaled GEMM reads); the grouped GEMM then takes its forward ``A`` /
dgrad ``grad_out`` operand from here (:func:`rowwise_values`, :func:`rowwise_operand`) instead of
quantizing again.

Entries are keyed weakly by the tensor object and hold only while it is unchanged: the same storage (by
identity: the entry holds it, so a replacement at the same address is another storage), data pointer,
offset, shape, strides, dtype and autograd version counter (an in-place write is a miss). A miss, a
different scale mode, ``inference_mode`` or code being traced by ``torch.compile`` (which records and looks up
nothing; the compiled per-GEMM custom ops run their stages at run time, where a lookup can hit) fall back to
quantizing, which gives the same values: re-quantizing the dequantized values of a 1x32 MXFP8 tensor with the same
mode and blocks reproduces them (``tests/test_ep_prequantized.py``), so a hit only saves the pass.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import layouts
from . import quantize as q
from .numerics import ScaleMode

_E8M0 = torch.float8_e8m0fnu


@dataclasses.dataclass(frozen=True)
class _Known:
    tag: tuple
    storage: torch.UntypedStorage  # held: no other storage can take its identity (or its memory) meanwhile
    mode: ScaleMode
    data: torch.Tensor | None  # (M, K) e4m3, or None where only the values are needed
    scales: torch.Tensor | None  # (M, K/32) plain e8m0


_KNOWN = WeakIdKeyDictionary()
_LOCK = threading.Lock()


def _tag(x: torch.Tensor):
    """What must not change for an entry to hold: the storage itself (its StorageImpl; the entry holds it, so a
    storage that replaced it -- ``.data =``, ``set_`` -- is another one even where the caching allocator placed it
    at the same address), the data pointer, view and dtype, and the autograd version counter."""
    try:
        version = x._version
    except RuntimeError:  # inference tensors have no version counter
        return None
    storage = x.untyped_storage()
    return (storage._cdata, storage.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, version)


def _stateless() -> bool:
    return torch.compiler.is_compiling() or torch.is_inference_mode_enabled()


def remember(x: torch.Tensor, mode: ScaleMode | str, data: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> None:
    """Record that ``x (M, K)`` holds exactly the dequantized values of a 1x32 MXFP8 quantization in
    ``mode`` (``data`` (M, K) e4m3 and plain ``scales`` (M, K/32), if given, are that quantization)."""
    mode = ScaleMode.parse(mode, "mode")
    if type(x) is not torch.Tensor or _stateless():
        return
    tag = _tag(x)
    if tag is None:
        return
    if (data is None) != (scales is None):
        raise ValueError("data and scales must be given together or not at all")
    with _LOCK:
        _KNOWN[x] = _Known(tag, x.untyped_storage(), mode, data, None if scales is None else scales.view(_E8M0))


def lookup(x: torch.Tensor, mode: ScaleMode) -> _Known | None:
    """The entry of ``x`` for ``mode`` while ``x`` is unchanged, else None."""
    # (the emptiness test last: dynamo cannot trace the weak dictionary's len, and returns at _stateless)
    if type(x) is not torch.Tensor or _stateless() or not _KNOWN:
        return None
    with _LOCK:
        known = _KNOWN.get(x)
    if known is None or known.mode is not mode or known.tag != _tag(x):
        return None
    return known


def rowwise_values(x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What the emulated GEMM sees of the rowwise operand ``x``: ``x`` itself (as ``out_dtype``) when its
    MXFP8 form is known, else :func:`moe_quant.quantize.fake_quantize_rowwise` (arguments checked by the caller)."""
    if lookup(x, mode) is not None:
        return x.to(out_dtype)
    return q.fake_rowwise(x, mode, out_dtype)  # x checked by the caller (the grouped GEMM)


def rowwise_operand(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor):
    """The scaled GEMM's rowwise operand ``(data, M-groups blocked scales)``: the known fp8 data and its
    scales re-laid out for ``offs``, else :func:`moe_quant.quantize.quantize_rowwise` (arguments checked by
    the caller)."""
    known = lookup(x, mode)
    if known is not None and known.data is not None:
        return known.data, layouts.to_blocked_m_groups(known.scales, offs)
    return q.rowwise(x, mode, offs)  # x and offs checked by the caller (the grouped GEMM)


__all__ = ["remember", "lookup", "rowwise_values", "rowwise_operand"]
