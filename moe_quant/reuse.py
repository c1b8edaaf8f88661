"""Reuse of quantized expert weights across the micro-batches of one optimizer step.

With gradient accumulation the expert weights do not change between micro-batches, yet every
forward quantizes them along K and every backward along N again. Inside::

    with reuse_quantized_weights(model):
        for micro_batch in micro_batches:
            loss_fn(model(micro_batch)).backward()
    optimizer.step()

each weight operand of the MXFP8 grouped GEMM (a view of one of ``model``'s parameters) is
quantized once and reused by the later micro-batches. The contract is the user's statement that
the weights do not change inside the scope; on exit the scope checks it: for each weight it served,
the parameter's version counter, storage and shape, and a fingerprint of its bytes (which also sees
writes through ``.data`` or ``state_dict()`` tensors), and raises ``RuntimeError`` if one changed
(results computed inside the scope may then have used stale operands). The fingerprint
(:mod:`moe_quant.fingerprint`: a position-keyed, mixed sum of the weight's 64-bit words mod 2**64, which
any change of one word changes) costs one read of each served weight at its first use and one on exit,
on Hopper and newer one CuTe-DSL kernel that reads the bytes once; nothing inside forward or backward synchronizes with the
host, and the comparison on exit does once per device (all served weights' fingerprints at once).

Not served inside the scope (every call quantizes, as outside it): under ``torch.compile``,
``torch.inference_mode`` and ``torch.func`` transforms, and parameters that are not ``model``'s when
the scope is entered (FSDP2 gathers its unsharded weights anew for every forward). The cached
operands stay allocated until the scope exits: two bf16 copies of each served weight on the
emulated GEMM, two fp8 copies plus scales on the scaled one.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from .fingerprint import fingerprint

_ACTIVE: list["Scope"] = []


def _state(p: torch.Tensor) -> tuple:
    return (p._version, p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.stride(), p.dtype)


class Scope:
    """The operands of one scope. :func:`reuse_quantized_weights` makes one; ``activate()`` serves from it
    without the exit check (benchmarks time the steady state with it)."""

    def __init__(self, weights):
        self.params = {id(p): p for p in weights}
        self.entries: dict = {}
        self.served: dict = {}  # id -> (parameter, its state, its fingerprint) at first use
        self.hits = 0
        self.misses = 0

    def operand(self, W_t: torch.Tensor, kind: tuple, compute: Callable[[], object]):
        param = W_t if id(W_t) in self.params else W_t._base
        if param is None or self.params.get(id(param)) is not param:
            return compute()
        key = (id(param), kind, W_t.storage_offset(), tuple(W_t.shape), W_t.stride(), W_t.dtype)
        hit = self.entries.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        if id(param) not in self.served:
            self.served[id(param)] = (param, _state(param), fingerprint(param))
        value = self.entries[key] = compute()
        self.misses += 1
        return value

    @contextlib.contextmanager
    def activate(self):
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)

    def check(self) -> None:
        flags = {}  # id -> changed?, in the order the weights were served
        by_device: dict = {}  # weights of unchanged state: compared by fingerprint, all of a device at once
        for key, (param, state, fp) in self.served.items():
            flags[key] = _state(param) != state
            if not flags[key]:
                by_device.setdefault(fp.device, []).append((key, fp, fingerprint(param)))
        for items in by_device.values():  # one host synchronization per device
            differ = (torch.stack([old for _, old, _ in items]) != torch.stack([new for *_, new in items])).tolist()
            flags.update((key, d) for (key, _, _), d in zip(items, differ))
        changed = [self.served[key][0] for key, c in flags.items() if c]
        if changed:
            names = ", ".join(f"{tuple(p.shape)}" for p in changed)
            raise RuntimeError(
                f"reuse_quantized_weights: {len(changed)} weight(s) it served changed inside the scope (shapes "
                f"{names}); results computed inside it may have used their old quantized values. Step the "
                f"optimizer (or write the weights) outside the scope: one scope per optimizer step's micro-batches."
            )


def active_operand(W_t: torch.Tensor, kind: tuple, compute: Callable[[], object]):
    """``compute()`` -- the quantized operand ``kind`` of the weight view ``W_t`` -- or the one the
    innermost active :func:`reuse_quantized_weights` scope made before for the same view."""
    if (not _ACTIVE or torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return compute()
    return _ACTIVE[-1].operand(W_t, kind, compute)


@contextlib.contextmanager
def reuse_quantized_weights(model):
    """Quantize each expert weight of ``model`` (an ``nn.Module``, or an iterable of weight tensors for
    direct :func:`moe_quant.mxfp8_grouped_mm` calls on their views) once for all micro-batches run
    inside; on exit raise ``RuntimeError`` if a weight it served changed (see the module doc). Yields
    the scope (its ``hits`` and ``misses`` count the weight operands reused and made)."""
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
    scope = Scope(weights)
    try:
        with scope.activate():
            yield scope
    finally:
        scope.entries.clear()
    scope.check()
