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
from typing import Callable

import torch


class QuantizedWeightCache:
    """Last quantized operands of one weight, by kind (``("fwd", mode)``, ``("dgrad", mode)``, ...)."""

    def __init__(self):
        self._entries: dict = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _tag(w: torch.Tensor):
        try:
            version = w._version
        except RuntimeError:  # inference tensors have no version counter
            return None
        return (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w.device,
                version)

    def get(self, w: torch.Tensor, kind, compute: Callable[[], object]):
        """``compute()``'s result for ``(w, kind)``, reused while ``w`` is unchanged."""
        if type(w) is not torch.Tensor or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return compute()  # traced (fake/functional tensors), compiled or inference: no state
        tag = self._tag(w)
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

    # a cache is per-process state: copies and pickles of a model start empty
    def __deepcopy__(self, memo):
        return QuantizedWeightCache()

    def __reduce__(self):
        return (QuantizedWeightCache, ())
