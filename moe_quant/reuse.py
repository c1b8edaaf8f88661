"""Reuse of quantized expert weights across the micro-batches of one optimizer step.

With gradient accumulation the expert weights do not change between micro-batches, yet every
forward quantizes them along K and every backward along N again. Inside::

    with reuse_quantized_weights(model):
        for micro_batch in micro_batches:
            loss_fn(model(micro_batch)).backward()
    optimizer.step()

each weight operand of the MXFP8 grouped GEMM is quantized once and reused by the later micro-batches,
bit for bit what quantizing every time gives.

What is served. A GEMM's weight view ``W_t`` is served when its root tensor (``W_t._base``, or ``W_t``
itself when it is no view) is the root of one of the scope's weights: a parameter and every view of it
(``w.transpose(-2, -1)``, ``w[:2]``), and weights that are views of one buffer (``buf[0]``, ``buf[1]``:
their root is ``buf``). Served only to the thread that entered the scope (scopes are per thread, the
innermost one holding the weight serves), and to the backward of a forward that ran there while the
scope is still open (the autograd Function carries the scopes from its forward to its backward, which
on CUDA runs on the engine's device thread). Never under ``torch.compile``, ``torch.inference_mode`` or
``torch.func`` transforms (every call quantizes, as outside a scope).

Checked at every use, on the host. Each use looks the view up by its state, read without touching the
device: the root's TensorImpl, the storage's identity (its StorageImpl) and data pointer, the view's
offset, shape, strides and dtype make the key, and the version counter (the root's, which the key's
TensorImpl names) must equal the one the operands were made at. So a weight given other bytes -- an
in-place write through it or any view of it (an optimizer step, ``copy_``, ``load_state_dict``,
``set_``) or new storage (``.data = ema``, ``vector_to_parameters``, ``torch.utils.swap_tensors``) -- is
quantized again at its next use, and a ``.data`` swap back finds the operands of the old storage again.
Until it exits the scope holds each source's storage, so no storage identity in a key passes to another
tensor meanwhile; it holds no reference to the root's TensorImpl (``swap_tensors`` refuses a tensor with
one), so the one state this key cannot tell apart is a swapped-out TensorImpl freed and its address
reused by another one over the same storage, swapped into the weight at the same version count.

Checked on exit. A write no version counter of the weight sees -- through an alias with its own counter
(``w.data.mul_()``, a NumPy or DLPack view, another process after ``share_memory()``) -- cannot be seen at
a use without reading the bytes. So the scope fingerprints each source's bytes at its first use
(:mod:`moe_quant.fingerprint`) and, on exit, those of every source whose operands were reused (a hit)
again, and raises ``RuntimeError`` where they differ (the comparison on the device, one host
synchronization per device). That also names a weight changed through its counter after a reuse (an
optimizer step inside the scope): those later uses were served right, but an unseen write before the
change cannot be told apart. Sources never reused need no check: each of their operands was made from
the bytes current at that use. A write no counter sees is missed by both checks where the bytes are
restored before the scope exits (``w.data.copy_(ema)`` ... ``w.data.copy_(backup)``, or an unseen write
that a ``copy_`` on the weight undoes): swap with ``.data =``, ``copy_`` on the weight or
``load_state_dict`` instead. Nothing inside forward or backward synchronizes with the host.

Costs: a fingerprint (one read of the bytes; on Hopper and newer a CuTe-DSL kernel) of each source at its
first use and of each reused one on exit, and a few microseconds of host time per lookup. What the scope holds
until it exits, per served weight view, with ``hold`` (:data:`HOLDS`; what it keeps of the emulated GEMM's
operands, Hopper and the CPU): ``"bf16-fwd"`` (the default) its forward operand (blocks along K) once, as the
bf16 values the GEMM reads (``2 E N K`` bytes), its dgrad operand (blocks along N) made at each backward as
outside a scope; ``"fp8"`` both operands once each as fp8 data and plain e8m0 scales (``E N K + E N K / 32``
bytes each), dequantized to bf16 when a GEMM reads them, into a copy freed after; ``"bf16"`` both as their bf16
values (``2 E N K`` bytes each, no pass per GEMM). ``"bf16-fwd"`` holds less than ``"fp8"`` and moves fewer
bytes for any number of micro-batches: a dequantization reads ``1 + 1/32`` bytes an element and writes 2, so
the fp8 forms' passes (making both, then one per GEMM) cost more than quantizing the dgrad operand anew (2 read,
2 written) and nothing for the forward (docs/performance.md, "Where the block's time goes"). The scaled GEMM
(SM100) reads fp8 and scales itself: every ``hold`` keeps both operands so. And the storage of each source (with
``.data`` swaps, also that of each storage swapped in).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch import nn

from .fingerprint import fingerprint

_LOCAL = threading.local()  # .scopes: the scopes entered on this thread, innermost last (a tuple)
_NOT_HERE = object()


def current() -> tuple:
    """The scopes that serve this thread's GEMMs now, innermost last (empty where none may serve: under
    ``torch.compile``, ``inference_mode`` and ``torch.func`` transforms). A forward passes them to
    :func:`serve` and keeps them for its backward."""
    if torch.compiler.is_compiling():  # first: dynamo never traces the thread-local read
        return ()
    scopes = getattr(_LOCAL, "scopes", ())
    if scopes and (torch.is_inference_mode_enabled() or torch._C._are_functorch_transforms_active()):
        return ()
    return scopes


AS_MADE = "as made"  # a scope of that hold keeps the operand itself (:func:`serve`'s ``held``)
NOT_HELD = "not held"  # a scope of that hold keeps nothing of the operand: it is made at each use


def serve(scopes: tuple, W_t: torch.Tensor, kind: tuple, compute: Callable[[], object], held: dict | None = None):
    """``compute()`` -- the quantized operand ``kind`` of the weight view ``W_t`` -- or the one the
    innermost of ``scopes`` (from :func:`current`) that holds ``W_t``'s weight made from the same bytes.

    ``held``: what a scope keeps of this operand, by the scope's ``hold`` (:data:`HOLDS`; absent: the operand as
    made, :data:`AS_MADE`): ``(make, read)`` where it keeps a narrower exact form (the emulated GEMM's fp8 data and
    scales for its bf16 values: it keeps ``make()`` and serves ``read(kept)``, made at each use and freed by the
    GEMM once read), :data:`NOT_HELD` where it keeps none (``compute()`` at each use)."""
    if not scopes or torch.compiler.is_compiling():  # compiled autograd traces an eager forward's backward
        return compute()
    for scope in reversed(scopes):
        how = held.get(scope.hold, AS_MADE) if held else AS_MADE
        if how == NOT_HELD:
            if scope.holds(W_t):
                return compute()
            continue
        if how == AS_MADE:
            value = scope.operand(W_t, kind, compute)
            if value is not _NOT_HERE:
                return value
            continue
        make, read = how
        value = scope.operand(W_t, kind + (scope.hold,), make)
        if value is not _NOT_HERE:
            return read(value)
    return compute()


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose TensorImpl ``t``'s views share: ``t._base`` (a view's base is never a view), else ``t``."""
    base = t._base
    return t if base is None else base


def _storage_state(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Source:
    """A served weight view's bytes as the scope saw them at first use: the operands made from them, by kind."""

    __slots__ = ("key", "view", "version", "storage", "fingerprint", "operands", "hits")

    def __init__(self, key: tuple, W_t: torch.Tensor, version: int):
        self.key = key
        # ``view`` holds the storage (its identity in the key stays unique while the scope holds the source) and
        # shares W_t's version counter: W_t's alias with its dims in memory order, whose row-major bytes are those
        # of a dense W_t without a copy (a transpose of a parameter). Not a view of the root: a reference to the
        # root's TensorImpl, strong or weak, makes torch.utils.swap_tensors refuse the weight.
        order = sorted(range(W_t.dim()), key=lambda d: -W_t.stride(d))
        self.view = W_t.detach().permute(order)
        self.version = version
        self.storage = _storage_state(W_t)
        self.fingerprint = fingerprint(self.view)
        self.operands: dict = {}
        self.hits = 0


HOLDS = ("bf16-fwd", "fp8", "bf16")  # what a scope keeps of the emulated GEMM's weight operands (module doc)
DEFAULT_HOLD = HOLDS[0]


class Scope:
    """The operands of one scope. :func:`reuse_quantized_weights` makes one; ``activate()`` serves from it
    on this thread without the exit check (benchmarks time the steady state with it). ``hold``: what it keeps of
    an emulated GEMM's weight operand (see :func:`reuse_quantized_weights`)."""

    def __init__(self, weights, hold: str = DEFAULT_HOLD):
        if hold not in HOLDS:
            raise ValueError(f"hold must be one of {list(HOLDS)}, got {hold!r}")
        self.hold = hold
        self.roots = {id(r): r for r in map(_root, weights)}
        self.served: dict = {}  # state key (all but the version) -> the _Source of its current version
        self.retired: list = []  # sources reused, then replaced at a use that saw a new version (checked on exit)
        self.hits = 0
        self.misses = 0
        self._active = 0
        self._lock = threading.Lock()  # backward device threads of one forward thread may share the scope

    def holds(self, W_t: torch.Tensor) -> bool:
        """Whether this scope is open and ``W_t`` is a view of one of its weights (it serves ``W_t``'s operands)."""
        return self.roots.get(id(_root(W_t))) is _root(W_t) and bool(self._active)

    def operand(self, W_t: torch.Tensor, kind: tuple, compute: Callable[[], object]):
        """The operand ``kind`` of ``W_t`` from this scope (made now unless made before from its current
        state), or ``_NOT_HERE`` where this scope does not hold ``W_t``'s weight or is closed."""
        root = W_t._base  # _root(W_t), inline: every use pays for this method
        if root is None:
            root = W_t
        if self.roots.get(id(root)) is not root or not self._active:
            return _NOT_HERE
        try:
            version = W_t._version
        except RuntimeError:  # an inference tensor: no version counter to check
            return _NOT_HERE
        storage = W_t.untyped_storage()
        key = (root._cdata, storage._cdata, storage.data_ptr(), W_t.storage_offset(), W_t.shape, W_t.stride(),
               W_t.dtype)
        with self._lock:
            source = self.served.get(key)
            if source is not None and source.version == version:
                value = source.operands.get(kind)
                if value is not None:
                    source.hits += 1
                    self.hits += 1
                    return value
        fresh = None if source is not None and source.version == version else _Source(key, W_t, version)
        value = compute()
        with self._lock:
            if fresh is not None:
                old = self.served.get(key)
                if old is not None and old.hits:
                    old.operands = {}
                    self.retired.append(old)
                self.served[key] = source = fresh
            source.operands[kind] = value
            self.misses += 1
        return value

    @contextlib.contextmanager
    def activate(self):
        _LOCAL.scopes = getattr(_LOCAL, "scopes", ()) + (self,)  # not current(): () under inference_mode
        self._active += 1
        try:
            yield self
        finally:
            self._active -= 1
            mine = _LOCAL.scopes
            i = len(mine) - 1 - mine[::-1].index(self)
            _LOCAL.scopes = mine[:i] + mine[i + 1:]

    def close(self, check: bool) -> None:
        """Free the operands and forget the sources; with ``check``, first raise ``RuntimeError`` where a
        source whose operands were reused does not hold the bytes it held at first use."""
        for source in self.served.values():
            source.operands = {}
        try:
            if check:
                self._check()
        finally:
            self.served.clear()
            self.retired.clear()

    def _check(self) -> None:
        by_key: dict = {}  # the reused sources of a state key: one storage, one view, one fingerprint now
        for source in [s for s in self.served.values() if s.hits] + self.retired:
            by_key.setdefault(source.key, []).append(source)
        changed, by_device = [], {}
        for sources in by_key.values():
            view = sources[0].view
            now = _storage_state(view)
            if any(s.storage != now for s in sources):  # reallocated (storage.resize_): not readable as then
                changed += sources
                continue
            by_device.setdefault(view.device, []).append((sources, fingerprint(view)))
        for items in by_device.values():  # one host synchronization per device
            old = torch.stack([s.fingerprint for sources, _ in items for s in sources])
            new = torch.stack([f for sources, f in items for _ in sources])
            changed += [s for s, d in zip([s for sources, _ in items for s in sources], (old != new).tolist()) if d]
        if changed:
            shapes = lambda sources: ", ".join(str(tuple(s.view.shape)) for s in sources)  # noqa: E731
            unseen = [s for s in changed if s.view._version == s.version]
            seen = [s for s in changed if s.view._version != s.version]
            how = ([f"through a write no version counter saw (.data, another alias: the operands reused after it "
                    f"were stale), shapes {shapes(unseen)}"] if unseen else []) + (
                   [f"by an in-place write its version counter saw (quantized again from then on, but an unseen "
                    f"write before it cannot be told apart), shapes {shapes(seen)}"] if seen else [])
            raise RuntimeError(
                f"reuse_quantized_weights: {len(changed)} weight(s) it served changed inside the scope after their "
                f"quantized operands had been reused: {'; '.join(how)}. Results computed inside the scope may have "
                f"used old quantized values. Step the optimizer (or write the weights) outside the scope: one scope "
                f"per optimizer step's micro-batches."
            )


@contextlib.contextmanager
def reuse_quantized_weights(model, *, hold: str = DEFAULT_HOLD):
    """Quantize each expert weight of ``model`` (an ``nn.Module``, or an iterable of weight tensors for
    direct :func:`moe_quant.mxfp8_grouped_mm` calls on their views) once for all micro-batches run
    inside, on this thread; every use checks that the weight still holds the bytes its operands were
    made from (else quantizes again); on exit raise ``RuntimeError`` if a weight whose operands were
    reused changed (see the module doc). Yields the scope (its ``hits`` and ``misses`` count the weight
    operands reused and made).

    ``hold``: what the scope keeps of a weight's operands on the emulated GEMM (Hopper, the CPU):
    ``"bf16-fwd"`` (default) the forward operand as the bf16 values the GEMM reads (2 bytes a weight element, no
    pass per forward), the dgrad operand made at each backward as outside a scope; ``"fp8"`` both operands as fp8
    data and e8m0 scales (1 + 1/32 bytes an element each), each dequantized to bf16 when a GEMM reads it and freed
    after (more memory than the default and more bytes moved: the module doc); ``"bf16"`` both operands as bf16
    values (4 bytes a weight element, no pass per GEMM: the fastest). The scaled GEMM (SM100) reads fp8 and scales
    itself: every ``hold`` keeps both operands so."""
    if hold not in HOLDS:
        raise ValueError(f"hold must be one of {list(HOLDS)}, got {hold!r}")
    if isinstance(model, nn.Module):
        weights = list(model.parameters())
    elif isinstance(model, torch.Tensor):
        raise TypeError("model must be an nn.Module or an iterable of tensors, got a tensor: pass [tensor]")
    else:
        try:
            weights = list(model)
        except TypeError:
            raise TypeError(f"model must be an nn.Module or an iterable of tensors, got {type(model).__name__}") from None
        if not all(isinstance(w, torch.Tensor) for w in weights):
            raise TypeError("model must be an nn.Module or an iterable of tensors: found a non-tensor")
    scope = Scope(weights, hold)
    try:
        with scope.activate():
            yield scope
    except BaseException:  # the user's error wins: no check
        scope.close(check=False)
        raise
    scope.close(check=True)
