"""The generated classes of converted modules.

Converting a module swaps its class for ``converted_class(type(module))``: a subclass whose forward
(or ``_grouped_mm`` seam) runs the expert GEMMs in MXFP8 and which changes nothing else. The module
keeps its ``__dict__``, its parameters (the same ``nn.Parameter`` objects), buffers and hooks, so
autograd, optimizers, ``state_dict``, FSDP2 and ``torch.func`` see the module they saw before; and
``torch.compile`` traces the converted forward itself, MXFP8 calls included.

One class per base class, cached. Each lives in this module under a name that encodes its base
(``MXFP8_<base name>_<hex of "module:qualname">``), and this module resolves such names on demand,
so pickling a converted module (``torch.save``, ``copy.deepcopy``, multiprocessing) finds its class
in any process.
"""

from __future__ import annotations

import dataclasses
import importlib

from typing import Optional

from torch import nn

from . import experts, hf
from .config import MXFP8MoEConfig

_CLASSES: dict = {}
_PREFIX = "MXFP8_"


def _converted_methods(cls: type) -> Optional[dict]:
    """The methods the converted subclass of ``cls`` overrides, or None if conversion does not know it."""
    names = {c.__module__ + "." + c.__qualname__ for c in cls.__mro__}
    if "moe_quant.moe.GroupedExperts" in names:
        return {"forward": experts.moe_quant_forward}
    if "torchtitan.models.common.moe.GroupedExperts" in names:
        return {"forward": experts.torchtitan_forward, "_grouped_mm": experts.grouped_mm_seam}
    forward = hf.converted_forward(cls)
    if forward is not None:
        return {"forward": forward}
    if callable(getattr(cls, "_grouped_mm", None)):
        return {"_grouped_mm": experts.grouped_mm_seam}
    return None


SUPPORTED = (
    "moe_quant.moe.GroupedExperts, torchtitan's GroupedExperts, Hugging Face transformers' experts modules "
    "(the experts interface's, Llama4TextExperts), or any module whose forward calls a method "
    "_grouped_mm(self, *, A, B_t, offs) -> A @ B_t grouped by offs (conversion overrides that seam)"
)


def _encode(cls: type) -> str:
    return f"{_PREFIX}{cls.__name__}_{f'{cls.__module__}:{cls.__qualname__}'.encode().hex()}"


def _decode(name: str) -> type:
    module, qualname = bytes.fromhex(name.rsplit("_", 1)[1]).decode().split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def is_converted(module: nn.Module) -> bool:
    return getattr(type(module), "_mxfp8_base", None) is not None


def base_class(module: nn.Module) -> type:
    """The class a converted module had before conversion (the module's own class otherwise)."""
    return getattr(type(module), "_mxfp8_base", None) or type(module)


def converted_class(cls: type) -> type:
    """The converted subclass of ``cls`` (cached); ``TypeError`` if conversion does not know ``cls``."""
    name = _encode(cls)
    if name in _CLASSES:
        return _CLASSES[name]
    methods = _converted_methods(cls)
    if methods is None:
        raise TypeError(f"MXFP8MoEConfig cannot convert {cls.__module__}.{cls.__qualname__}: supported are "
                        f"{SUPPORTED}.")
    # the class holds the default config: a module built from the converted torchtitan Config has no own one
    namespace = dict(methods, __module__=__name__, __qualname__=name, _mxfp8_base=cls, _mxfp8_config=MXFP8MoEConfig())
    namespace["__doc__"] = f"{cls.__qualname__} with its expert GEMMs in MXFP8 (moe_quant conversion)."
    config_cls = _torchtitan_config(cls)
    if config_cls is not None:
        namespace["Config"] = config_cls
    new = type(name, (cls,), namespace)
    _CLASSES[name] = new
    return new


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


