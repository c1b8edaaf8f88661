"""The generated classes of converted modules.

Converting a module makes its own class ``converted_class(own)``: a subclass whose forward (or
``_grouped_mm`` seam) runs the expert GEMMs in MXFP8 and which changes nothing else. The module keeps its
``__dict__``, its parameters (the same ``nn.Parameter`` objects), buffers and hooks, so autograd,
optimizers, ``state_dict``, FSDP2 and ``torch.func`` see the module they saw before; ``torch.compile``
traces the converted forward itself, MXFP8 calls included. Classes PyTorch layered over the module's own
class stay on top (:mod:`.layers`).

What the converted class overrides, by the class it converts:

* a class whose forward conversion knows (``moe_quant.moe.GroupedExperts``, torchtitan's ``GroupedExperts``,
  transformers' experts modules), not overridden by a subclass: ``forward`` (the fused SwiGLU block where
  it serves);
* a class with a ``_grouped_mm(self, *, A, B_t, offs)`` seam (torchtitan's subclasses with their own forward
  included): the seam; the forward is the class's own;
* any other class with a forward (a user's experts module, a subclass of a known class with its own
  forward): that forward, its ``torch._grouped_mm`` / ``F.grouped_mm`` calls routed to MXFP8
  (:mod:`.own_forward`);
* ``nn.Linear`` (an expert's projection in a per-expert experts list): ``forward``, one MXFP8 GEMM of one group
  (:mod:`.linear`).

A torchtitan module (one with a nested ``Config``) also gets a ``Config`` subclass (building from it makes a
converted module) and ``parallelize``: torchtitan's own, after the ranks that parallelize the module agree on
its settings (:mod:`.ranks`; ranks that differ all raise the same ``ValueError``).

One converted class per class, cached by the class object (weakly: a class nothing uses any more is
collected, and a second class of the same name -- a factory, a notebook cell run again,
``importlib.reload`` -- gets its own). A converted module pickles as its own class plus a marker
(``torch.save``, ``copy.deepcopy``, multiprocessing): unpickling converts it again in any process, and a
class pickle cannot find raises pickle's own error. A converted class reads ``MXFP8<Name>`` (its ``__name__``: module reprs, error messages, FSDP2's ``FSDPMXFP8<Name>``);
pickle finds it by its ``__qualname__``, a key this module resolves on demand (``MXFP8_<Name>_<hex of
"module:qualname">``), which is how a converted class itself, or an instance of its ``Config``, pickles.
"""

from __future__ import annotations

import copyreg
import dataclasses
import importlib
import weakref
from typing import Optional

from torch import nn

from . import experts, hf, linear, own_forward, ranks
from .config import MXFP8MoEConfig

_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> weak reference to its converted class
_PREFIX = "MXFP8_"
_BASE = "_mxfp8_base"  # a converted class's own attribute: the class it converts

_KNOWN = {
    "moe_quant.moe.GroupedExperts": {"forward": experts.moe_quant_forward},
    "torchtitan.models.common.moe.GroupedExperts": {"forward": experts.torchtitan_forward,
                                                    "_grouped_mm": experts.grouped_mm_seam},
    # one expert's projection in a per-expert experts list (the handler converts only Linear layers a user matched)
    "torch.nn.modules.linear.Linear": {"forward": linear.linear_forward},
}


def _known(cls: type):
    """``(K, methods)``: the first class ``K`` in ``cls``'s MRO whose forward conversion knows, and the methods
    that convert it; None if there is none."""
    for c in cls.__mro__:
        methods = _KNOWN.get(f"{c.__module__}.{c.__qualname__}")
        if methods is not None:
            return c, methods
    found = hf.known_class(cls)
    if found is not None:
        return found[0], {"forward": found[1]}
    return None


def _converted_methods(cls: type) -> Optional[dict]:
    """The methods the converted subclass of ``cls`` overrides, or None if ``cls`` has no forward."""
    known = _known(cls)
    if known is not None and cls.forward is known[0].forward:  # a subclass with its own forward keeps it
        return known[1]
    if experts.is_seam(getattr(cls, "_grouped_mm", None)):  # by signature: a helper of that name is no seam
        return {"_grouped_mm": experts.grouped_mm_seam}
    if cls.forward is nn.Module.forward or cls.__module__.startswith("torch.nn."):
        return None
    return {"forward": own_forward.routed_forward(cls)}


SUPPORTED = (
    "moe_quant.moe.GroupedExperts, torchtitan's GroupedExperts, Hugging Face transformers' experts modules "
    "(the experts interface's, Llama4TextExperts), a module whose forward calls a method "
    f"{own_forward.SEAM} -> A @ B_t grouped by offs (conversion overrides that seam), a module whose own "
    "forward calls torch._grouped_mm / F.grouped_mm (conversion routes those calls), or experts as an "
    "nn.ModuleList of per-expert modules (nn.Linear layers, or modules whose parameters are all in nn.Linear "
    "layers: each Linear converts)"
)


def display_name(cls: type) -> str:
    """The ``__name__`` of ``cls``'s converted class: ``MXFP8<Name>``."""
    return f"MXFP8{cls.__name__}"


def _encode(cls: type) -> str:
    return f"{_PREFIX}{cls.__name__}_{f'{cls.__module__}:{cls.__qualname__}'.encode().hex()}"


def _decode(name: str) -> type:
    module, qualname = bytes.fromhex(name.rsplit("_", 1)[1]).decode().split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def is_converted(module: nn.Module) -> bool:
    return getattr(type(module), _BASE, None) is not None


def base_class(module: nn.Module) -> type:
    """The class a converted module had before conversion (the module's own class otherwise)."""
    return getattr(type(module), _BASE, None) or type(module)


def converted_class(cls: type) -> type:
    """The converted subclass of ``cls`` (cached; ``cls`` itself if it is one); ``TypeError`` if conversion
    cannot convert ``cls``."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    if _BASE in cls.__dict__:
        return cls
    ref = _CLASSES.get(cls)
    new = ref() if ref is not None else None
    if new is not None:
        return new
    methods = _converted_methods(cls)
    if methods is None:
        raise TypeError(f"MXFP8MoEConfig cannot convert {cls.__module__}.{cls.__qualname__}: supported are "
                        f"{SUPPORTED}.")
    name = _encode(cls)
    # the class holds the default config: a module built from the converted torchtitan Config has no own one
    namespace = dict(methods, __module__=__name__, __qualname__=name, _mxfp8_config=MXFP8MoEConfig(),
                     __reduce_ex__=_reduce_ex)
    namespace[_BASE] = cls
    namespace["__doc__"] = f"{cls.__qualname__} with its expert GEMMs in MXFP8 (moe_quant conversion)."
    config_cls = _torchtitan_config(cls)
    if config_cls is not None:
        namespace["Config"] = config_cls
        if callable(getattr(cls, "parallelize", None)):
            namespace["parallelize"] = _parallelize
    new = type(display_name(cls), (cls,), namespace)  # __name__ reads MXFP8<Name>; __qualname__ is the key
    _CLASSES[cls] = weakref.ref(new)
    return new


def _new_converted(cls: type):
    """Unpickling a converted module: a new instance of ``converted_class(cls)`` (its state follows)."""
    new = converted_class(cls)
    return new.__new__(new)


def _reduce_ex(self, protocol):
    """A converted module pickles as its own class and :func:`_new_converted`: the pickle names the user's class,
    as the plain module's does, and loads converted wherever that class can be imported."""
    converted = next(c for c in type(self).__mro__ if _BASE in c.__dict__)
    rv = super(converted, self).__reduce_ex__(protocol)
    if type(self) is converted and isinstance(rv, tuple) and rv[0] is copyreg.__newobj__ and rv[1][0] is converted:
        return (_new_converted, (converted.__dict__[_BASE],) + tuple(rv[1][1:])) + tuple(rv[2:])
    return rv  # layered (FSDP2, a parametrization): as the layer pickles


def _parallelize(self, parallel_dims, *args, **kwargs):
    """torchtitan's ``Module.parallelize`` of a converted module, after the ranks that parallelize it agree on
    its settings (:mod:`.ranks`: one exchange; ranks that differ all raise the same ``ValueError``)."""
    ranks.check(self, parallel_dims)
    converted = next(c for c in type(self).__mro__ if _BASE in c.__dict__)
    return super(converted, self).parallelize(parallel_dims, *args, **kwargs)


def _torchtitan_config(cls: type) -> Optional[type]:
    """torchtitan modules are built from a nested ``Config`` whose ``build()`` makes its owner class: the
    converted class gets a ``Config`` subclass of the base's, so building from it makes a converted
    module (with the default :class:`MXFP8MoEConfig`) and torchtitan's config machinery keeps working."""
    base = cls.__dict__.get("Config")
    if base is None or not dataclasses.is_dataclass(base) or not hasattr(base, "_owner"):
        return None
    sub = type("Config", (base,), {"__module__": __name__, "__qualname__": f"{_encode(cls)}.Config"})
    return dataclasses.dataclass(kw_only=True, slots=True)(sub)


def __getattr__(name: str):  # pickle looks converted classes up by name: make them on demand
    if name.startswith(_PREFIX):
        try:
            return converted_class(_decode(name))
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise AttributeError(f"{__name__} has no converted class {name!r} ({e})") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
