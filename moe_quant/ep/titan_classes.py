"""moe_quant's torchtitan classes (this module imports torchtitan; :mod:`moe_quant.ep.titan` loads it on first use).

Every class a torchtitan config or model can hold lives at a module-level name here, so a converted model
config, and a model built from it, pickle (``torch.save``, ``copy.deepcopy``, multiprocessing spawn) like
torchtitan's own: :class:`TitanMXFP8TokenDispatcher` (and its ``Config``), :class:`MXFP8MoEConverter` (and
its ``Config``). The experts of a converted config are a ``Config`` subclass of the experts' own
(:func:`experts_config_class`, one per experts ``Config`` class, cached) with two more fields, ``scale_mode``
and ``converter`` (the converter's other settings in effect); its ``build()`` builds the plain experts module
and converts it with ``quantize_``, so the built module is the same class ``quantize_`` makes of a plain model
(:func:`moe_quant.conversion.converted_class`), and ``unconvert`` gives back the plain class. Its instances
pickle as (experts ``Config`` class, field values).

Ranks launched with different converter settings: when torchtitan parallelizes the model (after
``init_distributed``, on every rank), each converted experts module's ``parallelize`` first compares its
settings (``scale_mode`` and ``converter``) across the ranks (:mod:`moe_quant.conversion.ranks`) and every rank
raises the same ``ValueError`` where they differ, with ``dispatcher=False`` too. The converter's ``convert``
cannot: torchtitan runs it when the config is made (``model_registry(..., converters=...)`` at command-line
parsing), before any process group exists.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
from torchtitan.ops.scatter_add import deterministic_scatter_add
from torchtitan.protocols.model import ModelConfigConverter

from .dispatcher import _LOCAL, MXFP8TokenDispatcher

logger = logging.getLogger("moe_quant.ep.titan")


class TitanMXFP8TokenDispatcher(MXFP8TokenDispatcher, LocalTokenDispatcher):
    """:class:`moe_quant.ep.MXFP8TokenDispatcher` built from a torchtitan ``Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(LocalTokenDispatcher.Config):
        wire: str = "mxfp8"
        scale_mode: str = "rceil"
        capacity_factor: float | None = None
        """None: synced mode; a number: the sync-free mode (see moe_quant.ep.capacity)."""
        overflow: str = "error"
        max_tokens: int | None = None
        """Sync-free mode: tokens per rank the capacity is sized for (torchtitan: local_batch_size *
        seq_len / (cp * tp)); None: the ranks' largest T at the first dispatch, which must then run
        eagerly (set it when the blocks are compiled before the first step, as torchtitan does)."""

    def __init__(self, config):
        MXFP8TokenDispatcher.__init__(self, config.num_experts, config.top_k, group=_LOCAL,
                                      wire=config.wire, scale_mode=config.scale_mode,
                                      capacity_factor=config.capacity_factor, overflow=config.overflow,
                                      max_tokens=config.max_tokens)

    dispatch = MXFP8TokenDispatcher.dispatch
    combine = MXFP8TokenDispatcher.combine
    # torchtitan's combine sum (deterministic on CUDA): its dispatchers' bits for any top-k
    _scatter_add = staticmethod(deterministic_scatter_add)

    def wire_meshes(self, *, ep_mesh=None, **_unused):
        """torchtitan's meaning (``None``: local dispatch); with an EP mesh, the one-time handshake
        runs here (every rank parallelizes the same modules in the same order), before torchtitan
        compiles the blocks."""
        MXFP8TokenDispatcher.wire_meshes(self, ep_mesh=ep_mesh)
        if ep_mesh is not None:
            device_type = getattr(ep_mesh, "device_type", "cpu")
            index = [torch.cuda.current_device()] if device_type == "cuda" else []
            self.handshake(torch.device(device_type, *index))


def _dispatcher_settings(c) -> dict:
    return {"wire": c.wire, "scale_mode": c.scale_mode, "capacity_factor": c.capacity_factor,
            "overflow": c.overflow, "max_tokens": c.max_tokens}


def _converter_settings(c) -> dict:
    """The converter's settings in effect besides ``scale_mode`` (the experts' field): the ranks compare them
    (``dispatcher=False`` leaves the dispatcher's unused: not compared)."""
    out = {"dispatcher": c.dispatcher}
    if c.dispatcher:
        out.update({k: v for k, v in _dispatcher_settings(c).items() if k != "scale_mode"})
    return out


def _rebuild_experts_config(parent: type, values: dict):
    """Unpickling: the converted experts ``Config`` of ``parent`` with ``values`` (see ``__reduce__``)."""
    return experts_config_class(parent)(**values)


def _build_converted(self, **kwargs):
    """``build()`` of a converted experts ``Config``: the plain experts module of the parent ``Config``
    (the same fields, torchtitan's own build: param_init, sharding config), converted in place."""
    from torchao.quantization import quantize_

    from ..conversion import MXFP8MoEConfig, is_converted, ranks

    parent = type(self)._mxfp8_parent
    plain = parent(**{f.name: getattr(self, f.name) for f in dataclasses.fields(parent) if f.init})
    module = plain.build(**kwargs)
    quantize_(module, MXFP8MoEConfig(scale_mode=self.scale_mode), filter_fn=lambda mod, fqn: mod is module)
    if not is_converted(module):  # e.g. experts without 3-D weights: conversion warned, nothing converted
        raise TypeError(f"MXFP8MoEConverter: {type(module).__name__} built from {parent.__qualname__} was not "
                        f"converted (see the warning above)")
    if self.converter is not None:
        ranks.attach(module, self.converter)
    return module


def _reduce(self):
    parent = type(self)._mxfp8_parent
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    return _rebuild_experts_config, (parent, values)


@functools.cache  # keyed by the class object: two classes of the same name get their own subclass
def experts_config_class(parent: type) -> type:
    """The converted experts ``Config`` of an experts ``Config`` class (a ``GroupedExperts.Config``
    subclass): a dataclass subclass with a ``scale_mode`` field and a ``converter`` field (the
    :class:`MXFP8MoEConverter` settings in effect besides ``scale_mode``, which the ranks compare when the model
    is parallelized; None: not made by the converter) whose ``build()`` makes the converted module. Given a
    converted one, returns it (conversion never stacks)."""
    if not (isinstance(parent, type) and issubclass(parent, GroupedExperts.Config)):
        raise TypeError(f"MXFP8MoEConverter converts GroupedExperts (a GroupedExperts.Config as inner_experts), got "
                        f"{getattr(parent, '__qualname__', parent)!r}")
    if getattr(parent, "_mxfp8_parent", None) is not None:
        return parent
    namespace = {
        "__module__": __name__, "__qualname__": f"MXFP8{parent.__qualname__.replace('.', '')}",
        "__doc__": f"{parent.__qualname__} whose build() converts the experts to MXFP8 (moe_quant).",
        "__annotations__": {"scale_mode": str, "converter": dict | None}, "scale_mode": "rceil", "converter": None,
        "_mxfp8_parent": parent, "build": _build_converted, "__reduce__": _reduce,
    }
    cls = type(namespace["__qualname__"], (parent,), namespace)
    return dataclass(kw_only=True, slots=True)(cls)


class MXFP8MoEConverter(ModelConfigConverter):
    """Routed experts to MXFP8 (moe_quant) and their dispatcher to :class:`TitanMXFP8TokenDispatcher`.

    Converting a config this converter (or another of its kind) already converted re-configures it: the
    experts and the dispatcher take this converter's settings (the same settings: nothing changes), as
    ``quantize_`` re-configures a converted module. The settings in effect travel with the experts ``Config``:
    ranks whose settings differ all raise the same ``ValueError`` when torchtitan parallelizes the model (see
    the module doc), ``dispatcher=False`` included."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        scale_mode: str = "rceil"
        wire: str = "mxfp8"
        """``"mxfp8"``: under EP, dispatch forward and combine backward send MXFP8; ``"bf16"``: no."""
        capacity_factor: float | None = None
        """None: the dispatcher's synced mode; a number: its sync-free mode (see moe_quant.ep.capacity)."""
        overflow: str = "error"
        max_tokens: int | None = None
        """Sync-free mode: the token bound per rank (see the dispatcher's ``Config``)."""
        dispatcher: bool = True
        """False: convert the experts only and keep the model's own token dispatcher (torchtitan's
        all-to-all under EP, bf16 on the wire); the dispatcher settings above are then unused."""

    def __init__(self, config):
        # the dispatcher's own argument checks, now rather than when the model is built
        MXFP8TokenDispatcher(1, 1, group=_LOCAL, **_dispatcher_settings(config))
        if not isinstance(config.dispatcher, bool):
            raise TypeError(f"dispatcher must be True or False, got {config.dispatcher!r}")
        self.config = config

    def convert(self, model_config):
        c = self.config
        routed = [cfg for _fqn, cfg, _parent, _attr in model_config.traverse(RoutedExperts.Config)]
        if not routed:
            raise ValueError("MXFP8MoEConverter: the model config has no RoutedExperts.Config (no MoE layer)")
        for cfg in routed:  # every check before any change: a failing conversion leaves the config as it was
            experts_config_class(type(cfg.inner_experts))
            if not c.dispatcher and isinstance(cfg.token_dispatcher, TitanMXFP8TokenDispatcher.Config):
                raise ValueError(
                    "MXFP8MoEConverter(dispatcher=False): this model config's token dispatcher is already "
                    "moe_quant's (an earlier conversion with dispatcher=True replaced torchtitan's, which cannot "
                    "be restored from it); build the model config again and convert it once")
        for cfg in routed:
            inner = cfg.inner_experts
            cls = experts_config_class(type(inner))
            values = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner) if f.init}
            values["scale_mode"] = c.scale_mode
            values["converter"] = _converter_settings(c)
            if type(inner) is cls and inner.scale_mode != c.scale_mode:
                logger.info("re-configured %s: scale_mode %s -> %s", cls.__qualname__, inner.scale_mode, c.scale_mode)
            cfg.inner_experts = cls(**values)
            if c.dispatcher:
                old = cfg.token_dispatcher
                cfg.token_dispatcher = TitanMXFP8TokenDispatcher.Config(num_experts=old.num_experts, top_k=old.top_k,
                                                                        **_dispatcher_settings(c))
        return model_config


__all__ = ["TitanMXFP8TokenDispatcher", "MXFP8MoEConverter", "experts_config_class"]
