"""Classes other code layers over a module's class at run time, and swapping one class under them.

PyTorch changes a module's class to a generated subclass of it, as conversion does: parametrizations
(``torch.nn.utils.parametrize``: ``Parametrized<Name>``, whose removal deletes its properties from
``type(module)`` and restores ``type(module).__bases__[0]``), FSDP2's ``fully_shard`` (``FSDP<Name>``) and
``replicate`` (``DDP<Name>``). Such a *layer* keeps working only if it stays on top of the class chain. So
conversion and unconversion swap only their own class, under the layers: :func:`split` finds the layers above a
module's own class, :func:`rebuild` stacks them again on another class.

A layer is recognized as a class PyTorch generated at run time: defined in a ``torch.`` module that does not
hold it under its name, subclassing the class it wraps as its last base, and defining no ``forward`` (a class
that does, such as ``torch.fx``'s per-instance ``GraphModule`` class, is the module's own class). Rebuilding a layer on another
class makes a class of the same bases (the last one replaced), namespace and name (the wrapped class's name in
it replaced); cached, one per layer and class. Rebuilding it on the class it was made from returns the layer
itself, so convert, then unconvert, restores the very classes the module had (FSDP2's cached ``FSDP<Name>``,
a parametrization's own class).
"""

from __future__ import annotations

import sys
import weakref

from torch import nn

# layer -> {class below: weak reference to the layer rebuilt on it}; a rebuilt layer lives while a module has it
_REBUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ORIGIN = "_mxfp8_layer_of"  # a rebuilt layer's attribute: the layer it was made from


def _defined_by_name(cls: type) -> bool:
    obj = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def is_layer(cls: type) -> bool:
    """``cls`` is a class PyTorch layered over a module's class at run time (see the module docstring)."""
    bases = cls.__bases__
    return (cls.__module__.startswith("torch.") and not _defined_by_name(cls) and "forward" not in cls.__dict__
            and isinstance(bases[-1], type) and issubclass(bases[-1], nn.Module))


def split(cls: type) -> tuple[list, type]:
    """``(layers, own)``: the layers above ``own``, top first, and the first class under them."""
    layers = []
    while is_layer(cls):
        layers.append(cls)
        cls = cls.__bases__[-1]
    return layers, cls


def rebuild(layers: list, bottom: type) -> type:
    """``layers`` (top first) stacked again on ``bottom``: the class a module gets when its own class becomes
    ``bottom`` under the same layers."""
    cls = bottom
    for layer in reversed(layers):
        cls = _rebased(layer, cls)
    return cls


def _rebased(layer: type, bottom: type) -> type:
    origin = layer.__dict__.get(_ORIGIN, layer)
    if origin.__bases__[-1] is bottom:
        return origin
    made = _REBUILT.setdefault(origin, {})
    rebuilt = made[bottom]() if bottom in made else None
    if rebuilt is None:
        namespace = {k: v for k, v in origin.__dict__.items() if k not in ("__dict__", "__weakref__")}
        for v in namespace.values():
            if "__class__" in getattr(getattr(v, "__code__", None), "co_freevars", ()):
                raise TypeError(f"cannot move {origin.__qualname__} onto {bottom.__qualname__}: its method "
                                f"{v.__qualname__} uses super() without arguments")
        namespace[_ORIGIN] = origin
        name, below = origin.__name__, origin.__bases__[-1].__name__  # FSDP<Name>: FSDP<name of bottom>
        name = name[: -len(below)] + bottom.__name__ if name.endswith(below) else name
        rebuilt = type(name, origin.__bases__[:-1] + (bottom,), namespace)
        made[bottom] = weakref.ref(rebuilt)
    return rebuilt
