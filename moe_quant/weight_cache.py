"""Opt-in reuse of a weight's quantized operands while the weight does not change.

Expert weights change once per optimizer step, but with gradient accumulation every micro-batch's
forward quantizes them along K and every backward along N again. A :class:`QuantizedWeightCache`
keeps the quantized operands of one weight and hands one back only while it is provably the same:

* **the same tensor and view**: an entry is keyed by the exact operand the GEMM reads (storage
  offset, shape, strides, dtype) and by the kind of operand (fwd / dgrad, scale mode, backend), so
  ``W[4:]`` never gets ``W[:4]``'s operands; a cache only serves views of its own weight's storage
  (:meth:`QuantizedWeightCache.check_serves` raises otherwise);
* **the same values**: an entry is valid while nothing wrote to the weight. Two signals cover every
  write, and an entry is dropped when either moves:

  - the *generation*, which a converted weight (:class:`~moe_quant.conversion.MXFP8ExpertWeight`)
    bumps itself on every write it sees: every in-place or ``out=`` op on it or on any view of it
    (optimizer steps in for-loop, foreach and fused form, ``copy_``, ``load_state_dict``, writes
    through ``weight.data``), ``weight.data = t``, ``share_memory_()``, and each FSDP2 all-gather into
    it. A copy (``deepcopy``, ``clone``, ``.to()``, pickling) gets a new, empty cache;
  - the autograd *version counter* of the weight's storage tensor and of the operand, which PyTorch
    bumps on every in-place op on a plain tensor, e.g. on the tensors ``state_dict()`` returns.

  For a plain tensor weight (direct use of :func:`moe_quant.mxfp8_grouped_mm` with
  ``weight_cache=cache_for(W)``) only the version counter applies: writes through ``W.data`` (a
  detached alias with a version counter of its own) are not seen, and need :meth:`clear`.

Cost: the cached operands stay allocated between uses -- for the emulated GEMM two dequantized bf16
copies of the weight (along K and along N), for the scaled GEMM two fp8 copies plus scales. Stale
entries are dropped at the next use, :meth:`clear` drops all. Under ``torch.compile`` and
``inference_mode`` and inside ``torch.func`` transforms the cache is bypassed (every call quantizes), so
a compiled graph never captures a stale value and a transform's wrapped tensors never outlive it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary


_CACHES = WeakIdKeyDictionary()  # plain base tensor (by identity, held weakly) -> its cache
_ALL_CACHES: "weakref.WeakSet[QuantizedWeightCache]" = weakref.WeakSet()  # plain and converted weights' caches
_CACHES_LOCK = threading.RLock()  # cache_for creates caches, which register themselves, under it


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class QuantizedWeightCache:
    """Quantized operands of one weight (its *source*: the tensor holding the weight's storage)."""

    def __init__(self, source: torch.Tensor):
        self._source = weakref.ref(source)
        self._generation = 0
        self._entries: dict = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        with _CACHES_LOCK:
            _ALL_CACHES.add(self)

    def check_serves(self, operand: torch.Tensor, name: str = "W_t") -> None:
        """Raise ``ValueError`` unless ``operand`` is (a view of) this cache's weight."""
        src = self._source()
        if src is None or torch._C._are_functorch_transforms_active():
            return  # its weight is gone, or under torch.func: nothing is served (get() computes)
        if _storage_ptr(src) != _storage_ptr(operand) or src.device != operand.device:
            raise ValueError(
                f"weight_cache belongs to another weight: {name} must be (a view of) the tensor the cache was "
                f"made for (weight_cache.cache_for(W) with the W whose view {name} is)"
            )

    def _tag(self, operand: torch.Tensor):
        src = self._source()
        if src is None:
            return None
        try:
            versions = (src._version, operand._version)
        except RuntimeError:  # inference tensors have no version counter
            return None
        return (self._generation, versions, _storage_ptr(src))

    def get(self, operand: torch.Tensor, kind: tuple, compute: Callable[[], object]):
        """``compute()``'s result for quantizing ``operand`` (a view of the weight) as ``kind``, reused
        while the weight is unchanged."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or torch._C._are_functorch_transforms_active():
            return compute()  # compiled, inference or under torch.func: no state (a transform's tensors must not escape it)
        key = (kind, operand.storage_offset(), tuple(operand.shape), operand.stride(), operand.dtype)
        with self._lock:
            tag = self._tag(operand)
            if tag is None:
                return compute()
            hit = self._entries.get(key)
            if hit is not None and hit[0] == tag:
                self.hits += 1
                return hit[1]
        value = compute()
        with self._lock:
            if self._tag(operand) == tag:  # no write while computing
                # entries of an older state of the weight can never be hit again: free them now
                self._entries = {k: e for k, e in self._entries.items() if e[0] == tag}
                self._entries[key] = (tag, value)
            self.misses += 1
        return value

    def invalidate(self) -> None:
        """The weight was written: no entry made before may be used again (called by the weight wrapper)."""
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def clear(self) -> None:
        """Drop every cached operand (after a write neither signal can see)."""
        self.invalidate()

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"QuantizedWeightCache(entries={len(self)}, hits={self.hits}, misses={self.misses})"




def cache_for(weight: torch.Tensor) -> QuantizedWeightCache | None:
    """The cache of ``weight``: a converted weight's own cache (shared by its views), or for a plain
    tensor or ``nn.Parameter`` one cache per base tensor, alive as long as that tensor is. ``None`` for
    tensors that cannot hold one (traced, functional, other subclasses, inference tensors)."""
    own = getattr(weight, "_weight_cache", None)
    if isinstance(own, QuantizedWeightCache):
        return own
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    if weight.is_inference():
        return None
    root = weight._base if weight._base is not None else weight
    with _CACHES_LOCK:
        cache = _CACHES.get(root)
        if cache is None:
            cache = _CACHES[root] = QuantizedWeightCache(root)
    return cache


def clear_all() -> None:
    """Drop every cached quantized operand of the process (plain and converted weights)."""
    with _CACHES_LOCK:
        caches = list(_ALL_CACHES)
    for cache in caches:
        cache.clear()
