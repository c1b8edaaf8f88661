"""moe_quant's torchtitan classes (this module imports torchtitan; :mod:`moe_quant.ep.titan` loads it on first use).

Every class a torchtitan config or model can hold lives at a module-level name here, so a converted model
config, and a model built from it, pickle (``torch.save``, ``copy.deepcopy``, multiprocessing spawn) like
torchtitan's own: :class:`TitanMXFP8TokenDispatcher` (and its ``Config``), :class:`MXFP8MoEConverter` (and
its ``Config``). A converted config's routed experts are a ``Config`` subclass of the ``RoutedExperts.Config``
they were (:func:`routed_config_class`, one per class, cached) with two more fields, ``scale_mode`` and
``converter`` (the converter's other settings in effect); its ``build()`` builds the plain routed-experts module
(torchtitan's build, of whatever experts and dispatcher configs its fields hold then) and converts its experts with
``quantize_``, so the built experts are the class ``quantize_`` makes of a plain model
(:func:`moe_quant.conversion.converted_class`), and ``unconvert`` gives back the plain class. Its instances
pickle as (``RoutedExperts.Config`` class, field values).

**torchtitan's overrides** (``apply_overrides``, which its trainer runs after the converters) compose with the
conversion in either order: the experts and dispatcher configs stay torchtitan's own classes, so an override of
``GroupedExperts.Config`` (``fused_grouped_experts``, a user's experts) replaces the experts the converted config
builds and converts, and one of a dispatcher (``deepep_override``, ``hybridep_override``) finds the dispatcher the
model chose. moe_quant's dispatcher takes the place of torchtitan's local and all-to-all dispatchers only: DeepEP,
HybridEP, MinimalAsyncEP (and any other dispatcher) are kept, the experts converted, and the log says so once per
dispatcher class (``dispatcher=False`` asks for that without the message). Experts an override made that conversion
cannot convert raise ``TypeError`` when the model is built.

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
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
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
        self.experts_dtype = torch.bfloat16  # torchtitan's experts cast their input to bf16, and their output's
        # gradient (their output is type_as the input): fp32 activations go on the MXFP8 wire as that rounding

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


def _converter_settings(c, ours: bool) -> dict:
    """The converter's settings in effect besides ``scale_mode`` (a field of its own): the ranks compare them.
    ``ours``: moe_quant's dispatcher is in place (else its settings are unused: not compared)."""
    out = {"dispatcher": ours}
    if ours:
        out.update({k: v for k, v in _dispatcher_settings(c).items() if k != "scale_mode"})
    return out


def _rebuild_routed_config(parent: type, values: dict):
    """Unpickling: the converted ``RoutedExperts.Config`` of ``parent`` with ``values`` (see ``__reduce__``)."""
    return routed_config_class(parent)(**values)


def _build_converted(self, **kwargs):
    """``build()`` of a converted ``RoutedExperts.Config``: the plain routed-experts module of the parent ``Config``
    (torchtitan's own build, of the experts and dispatcher configs these fields hold now: an override's
    included), then its experts converted in place."""
    from torchao.quantization import quantize_

    from ..conversion import MXFP8MoEConfig, is_converted, ranks

    parent = type(self)._mxfp8_parent
    plain = parent(**{f.name: getattr(self, f.name) for f in dataclasses.fields(parent) if f.init})
    module = plain.build(**kwargs)
    experts = module.inner_experts
    config = MXFP8MoEConfig(scale_mode=self.scale_mode, dswiglu_cols_fp8=self.dswiglu_cols_fp8)
    quantize_(experts, config, filter_fn=lambda mod, fqn: mod is experts)
    if not is_converted(experts):  # e.g. experts without 3-D weights: conversion warned, nothing converted
        raise TypeError(f"MXFP8MoEConverter: {type(experts).__name__} built from "
                        f"{type(self.inner_experts).__qualname__} was not converted (see the warning above)")
    if self.converter is not None:
        ranks.attach(experts, self.converter)
    return module


def _reduce(self):
    parent = type(self)._mxfp8_parent
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    return _rebuild_routed_config, (parent, values)


@functools.cache  # keyed by the class object: two classes of the same name get their own subclass
def routed_config_class(parent: type) -> type:
    """The converted ``Config`` of a ``RoutedExperts.Config`` class: a dataclass subclass with ``scale_mode`` and
    ``dswiglu_cols_fp8`` fields (the experts' :class:`~moe_quant.MXFP8MoEConfig` settings) and a ``converter`` field
    (the :class:`MXFP8MoEConverter` settings in effect besides those, which the ranks compare when the model is
    parallelized; None: not made by the converter) whose ``build()`` builds the routed experts and converts their
    experts module. Its ``inner_experts`` and ``token_dispatcher`` stay the
    configs torchtitan and its overrides know. Given a converted one, returns it (conversion never stacks)."""
    if not (isinstance(parent, type) and issubclass(parent, RoutedExperts.Config)):
        raise TypeError(f"MXFP8MoEConverter converts RoutedExperts (a RoutedExperts.Config), got "
                        f"{getattr(parent, '__qualname__', parent)!r}")
    if getattr(parent, "_mxfp8_parent", None) is not None:
        return parent
    namespace = {
        "__module__": __name__, "__qualname__": f"MXFP8{parent.__qualname__.replace('.', '')}",
        "__doc__": f"{parent.__qualname__} whose build() converts the experts to MXFP8 (moe_quant).",
        "__annotations__": {"scale_mode": str, "dswiglu_cols_fp8": bool, "converter": dict | None},
        "scale_mode": "rceil", "dswiglu_cols_fp8": False, "converter": None,
        "_mxfp8_parent": parent, "build": _build_converted, "__reduce__": _reduce,
    }
    cls = type(namespace["__qualname__"], (parent,), namespace)
    return dataclass(kw_only=True, slots=True)(cls)


# torchtitan's dispatchers moe_quant's stands in for (the same interface and combine arithmetic: the local one,
# the all-to-all one); any other (DeepEP, HybridEP, MinimalAsyncEP, torchao's, a user's) is its own transport
_STANDS_IN_FOR = (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config)
_KEPT_NOTED: set = set()  # dispatcher config classes whose keeping was logged


def _replaces(dispatcher) -> bool:
    """moe_quant's dispatcher takes the place of ``dispatcher`` (a dispatcher config)."""
    return type(dispatcher) in _STANDS_IN_FOR or isinstance(dispatcher, TitanMXFP8TokenDispatcher.Config)


def _note_kept(dispatcher) -> None:
    cls = type(dispatcher)
    if cls in _KEPT_NOTED:
        return
    _KEPT_NOTED.add(cls)
    logger.warning("MXFP8MoEConverter: kept the model's %s (moe_quant's MXFP8 dispatcher stands in for torchtitan's "
                   "LocalTokenDispatcher and AllToAllTokenDispatcher only); the experts are converted, the tokens "
                   "travel as it sends them. MXFP8MoEConverter(dispatcher=False) asks for exactly this, without this "
                   "message. (Logged once per dispatcher class.)", cls.__qualname__)


class MXFP8MoEConverter(ModelConfigConverter):
    """Routed experts to MXFP8 (moe_quant) and their dispatcher to :class:`TitanMXFP8TokenDispatcher`.

    Converting a config this converter (or another of its kind) already converted re-configures it: the
    experts and the dispatcher take this converter's settings (the same settings: nothing changes), as
    ``quantize_`` re-configures a converted module. The settings in effect travel with the routed experts'
    ``Config``: ranks whose settings differ all raise the same ``ValueError`` when torchtitan parallelizes the model
    (see the module doc), ``dispatcher=False`` included. A dispatcher moe_quant's does not stand in for (DeepEP,
    HybridEP, MinimalAsyncEP, a user's) is kept, with a log message (see the module doc)."""

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
        """True: moe_quant's dispatcher in place of torchtitan's local and all-to-all ones (others are kept, said
        once in the log). False: convert the experts only and keep the model's own token dispatcher (torchtitan's
        all-to-all under EP, bf16 on the wire); the dispatcher settings above are then unused."""
        dswiglu_cols_fp8: bool = False
        """The experts' ``MXFP8MoEConfig(dswiglu_cols_fp8=...)``: on Hopper's emulated GEMM, the fused block's
        backward keeps w1's and w3's weight-gradient operands in fp8 until their GEMMs (less memory at the
        backward's peak, two dequantization passes more; the same bits)."""

    def __init__(self, config):
        # the dispatcher's own argument checks, now rather than when the model is built
        MXFP8TokenDispatcher(1, 1, group=_LOCAL, **_dispatcher_settings(config))
        for name in ("dispatcher", "dswiglu_cols_fp8"):
            if not isinstance(getattr(config, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(config, name)!r}")
        self.config = config

    def convert(self, model_config):
        c = self.config
        routed = list(model_config.traverse(RoutedExperts.Config))
        if not routed:
            raise ValueError("MXFP8MoEConverter: the model config has no RoutedExperts.Config (no MoE layer)")
        for _fqn, cfg, _parent, _attr in routed:  # every check before any change: a failing conversion changes nothing
            routed_config_class(type(cfg))
            if not isinstance(cfg.inner_experts, GroupedExperts.Config):
                raise TypeError(f"MXFP8MoEConverter converts GroupedExperts (a GroupedExperts.Config as inner_experts), "
                                f"got {type(cfg.inner_experts).__qualname__!r}")
            if not c.dispatcher and isinstance(cfg.token_dispatcher, TitanMXFP8TokenDispatcher.Config):
                raise ValueError(
                    "MXFP8MoEConverter(dispatcher=False): this model config's token dispatcher is already "
                    "moe_quant's (an earlier conversion with dispatcher=True replaced torchtitan's, which cannot "
                    "be restored from it); build the model config again and convert it once")
        for _fqn, cfg, parent, attr in routed:
            cls = routed_config_class(type(cfg))
            values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
            ours = c.dispatcher and _replaces(cfg.token_dispatcher)
            if ours:
                old = cfg.token_dispatcher
                values["token_dispatcher"] = TitanMXFP8TokenDispatcher.Config(
                    num_experts=old.num_experts, top_k=old.top_k, **_dispatcher_settings(c))
            elif c.dispatcher:
                _note_kept(cfg.token_dispatcher)
            values["scale_mode"] = c.scale_mode
            values["dswiglu_cols_fp8"] = c.dswiglu_cols_fp8
            values["converter"] = _converter_settings(c, ours)
            if type(cfg) is cls and cfg.scale_mode != c.scale_mode:
                logger.info("re-configured %s: scale_mode %s -> %s", cls.__qualname__, cfg.scale_mode, c.scale_mode)
            new = cls(**values)
            if parent is None:  # the model config is itself a RoutedExperts.Config
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


__all__ = ["TitanMXFP8TokenDispatcher", "MXFP8MoEConverter", "routed_config_class"]
