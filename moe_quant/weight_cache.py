"""Opt-in reuse of a weight's quantized operands while the weight does not change.

Expert weights change once per optimizer step, but with gradient accumulation every micro-batch's
forward quantizes them along K and every backward along N again. A :class:`QuantizedWeightCache`
keeps the last result of each kind and hands it back while the weight is the same tensor at the same
version: same storage, shape, strides and dtype, and the same autograd version counter, which every
in-place update bumps (``optimizer.step()`` in all its forms, ``copy_``, ``load_state_dict``).

Cost: the cached operands stay allocated between uses -- for the emulated GEMM two dequantized bf16
copies of the weight (along K and along N), for the scaled GEMM two fp8 copies plus scales.

Not seen by the version counter, so the cache must be cleared (:meth:`QuantizedWeightCache.clear`)
by hand after them: writes through ``weight.data`` / ``weight.detach()`` views, and writes by another
framework that bypasses autograd's version counter. Under ``torch.compile`` and ``inference_mode``
the cache is bypassed (every call quantizes), so a compiled graph never captures a stale value.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary


class QuantizedWeightCache:
    """Last quantized operands of one weight (its *source*: the parameter's data), by kind."""

    def __init__(self, source: torch.Tensor):
        self._source = weakref.ref(source)
        self._entries: dict = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _tag(self):
        src = self._source()
        if src is None:
            return None
        try:
            version = src._version
        except RuntimeError:  # inference tensors have no version counter
            return None
        return (src.untyped_storage().data_ptr(), src.storage_offset(), tuple(src.shape), src.stride(), src.dtype,
                version)

    def get(self, kind, compute: Callable[[], object]):
        """``compute()``'s result for ``kind``, reused while the source weight is unchanged."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return compute()  # compiled or inference: no state
        tag = self._tag()
        if tag is None:
            return compute()
        with self._lock:
            hit = self._entries.get(kind)
            if hit is not None and hit[0] == tag:
                self.hits += 1
                return hit[1]
        value = compute()
        with self._lock:
            self._entries[kind] = (tag, value)
            self.misses += 1
        return value

    def clear(self) -> None:
        """Drop every cached operand (after an update the version counter cannot see)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"QuantizedWeightCache(entries={len(self)}, hits={self.hits}, misses={self.misses})"


_CACHES = WeakIdKeyDictionary()  # base tensor (by identity, held weakly) -> its cache
_CACHES_LOCK = threading.Lock()


def cache_for(weight_data: torch.Tensor) -> QuantizedWeightCache | None:
    """The cache of the weight whose data ``weight_data`` is (or views): one per base tensor, alive as long
    as that tensor is. ``None`` for tensors that cannot hold one (traced, functional, inference)."""
    if type(weight_data) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    root = weight_data._base if weight_data._base is not None else weight_data
    with _CACHES_LOCK:
        cache = _CACHES.get(root)
        if cache is None:
            cache = _CACHES[root] = QuantizedWeightCache(root)
    return cache


def clear_all() -> None:
    """Drop every cached quantized weight of the process."""
    with _CACHES_LOCK:
        for cache in list(_CACHES.values()):
            cache.clear()
