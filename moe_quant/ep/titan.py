"""torchtitan components (torchtitan is imported only when one of these is asked for; it stays optional).

* :func:`dispatcher_class` -> ``TitanMXFP8TokenDispatcher``: :class:`MXFP8TokenDispatcher` as a torchtitan
  ``Configurable``; its ``Config(num_experts=..., top_k=..., wire="mxfp8", scale_mode="rceil")`` goes
  where torchtitan takes a dispatcher config: ``RoutedExperts.Config(token_dispatcher=...)``. It starts
  without an EP group (local dispatch) and follows torchtitan's ``wire_meshes(ep_mesh=...)``:
  ``ep_mesh=None`` (EP off) keeps dispatch local, an EP mesh makes it exchange tokens over it.
* :func:`converter_class` -> ``MXFP8MoEConverter``: a torchtitan model converter (``ModelConfigConverter``,
  the mechanism of its float8 / mx converters): in every ``RoutedExperts.Config`` it puts the MXFP8
  dispatcher and a ``GroupedExperts`` whose weights are converted with
  ``quantize_(experts, MXFP8MoEConfig(scale_mode=...))`` when built. In a torchtitan config::

      from moe_quant.ep.titan import converter_config
      model_spec = model_registry("16B", converters=[converter_config()])
"""

from __future__ import annotations

import functools


@functools.cache
def dispatcher_class():
    """``TitanMXFP8TokenDispatcher`` (defined on first use; imports torchtitan)."""
    from dataclasses import dataclass

    import torch
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    from torchtitan.ops.scatter_add import deterministic_scatter_add

    from .dispatcher import _LOCAL, MXFP8TokenDispatcher

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
                self.handshake(torch.device(getattr(ep_mesh, "device_type", "cpu"), *(
                    [torch.cuda.current_device()] if getattr(ep_mesh, "device_type", "cpu") == "cuda" else [])))

    return TitanMXFP8TokenDispatcher


def dispatcher_config(*, num_experts: int, top_k: int, wire: str = "mxfp8", scale_mode: str = "rceil",
                      capacity_factor: float | None = None, overflow: str = "error", max_tokens: int | None = None):
    """``TitanMXFP8TokenDispatcher.Config(...)``, for ``RoutedExperts.Config(token_dispatcher=...)``."""
    return dispatcher_class().Config(num_experts=num_experts, top_k=top_k, wire=wire, scale_mode=scale_mode,
                                     capacity_factor=capacity_factor, overflow=overflow, max_tokens=max_tokens)


@functools.cache
def _experts_class(parent_cls):
    from dataclasses import dataclass

    from torchao.quantization import quantize_

    from ..conversion import MXFP8MoEConfig

    class MXFP8ConvertedExperts(parent_cls):
        """torchtitan's experts module, its weights converted by ``quantize_`` once built."""

        @dataclass(kw_only=True, slots=True)
        class Config(parent_cls.Config):
            scale_mode: str = "rceil"

        def __init__(self, config):
            super().__init__(config)
            quantize_(self, MXFP8MoEConfig(scale_mode=config.scale_mode), filter_fn=lambda mod, fqn: mod is self)

    MXFP8ConvertedExperts.__name__ = MXFP8ConvertedExperts.__qualname__ = f"MXFP8{parent_cls.__name__}"
    return MXFP8ConvertedExperts


@functools.cache
def converter_class():
    """``MXFP8MoEConverter``: torchtitan model converter (defined on first use; imports torchtitan)."""
    import dataclasses
    from dataclasses import dataclass

    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.protocols.model import ModelConfigConverter

    class MXFP8MoEConverter(ModelConfigConverter):
        """Routed experts to MXFP8 (moe_quant) and their dispatcher to :class:`MXFP8TokenDispatcher`."""

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

        def __init__(self, config):
            from .dispatcher import _LOCAL, MXFP8TokenDispatcher

            # the dispatcher's own argument checks, now rather than when the model is built
            MXFP8TokenDispatcher(1, 1, group=_LOCAL, wire=config.wire, scale_mode=config.scale_mode,
                                 capacity_factor=config.capacity_factor, overflow=config.overflow,
                                 max_tokens=config.max_tokens)
            self.config = config

        def convert(self, model_config):
            found = 0
            for _fqn, routed, _parent, _attr in model_config.traverse(RoutedExperts.Config):
                found += 1
                old = routed.token_dispatcher
                c = self.config
                routed.token_dispatcher = dispatcher_config(
                    num_experts=old.num_experts, top_k=old.top_k, wire=c.wire, scale_mode=c.scale_mode,
                    capacity_factor=c.capacity_factor, overflow=c.overflow, max_tokens=c.max_tokens)
                inner = routed.inner_experts
                if not isinstance(inner, GroupedExperts.Config):
                    raise TypeError(f"MXFP8MoEConverter converts GroupedExperts, got {type(inner).__name__}")
                cls = _experts_class(inner._owner)
                values = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner) if f.init}
                routed.inner_experts = cls.Config(**values, scale_mode=self.config.scale_mode)
            if not found:
                raise ValueError("MXFP8MoEConverter: the model config has no RoutedExperts.Config (no MoE layer)")
            return model_config

    return MXFP8MoEConverter


def converter_config(*, scale_mode: str = "rceil", wire: str = "mxfp8", capacity_factor: float | None = None,
                     overflow: str = "error", max_tokens: int | None = None):
    """``MXFP8MoEConverter.Config(...)``, for torchtitan's ``model_registry(..., converters=[...])``
    (``capacity_factor``, ``overflow``, ``max_tokens``: the dispatcher's sync-free mode)."""
    return converter_class().Config(scale_mode=scale_mode, wire=wire, capacity_factor=capacity_factor,
                                    overflow=overflow, max_tokens=max_tokens)


__all__ = ["dispatcher_class", "dispatcher_config", "converter_class", "converter_config"]
