"""torchtitan components (torchtitan is imported only when one of these is asked for; it stays optional).

* :func:`dispatcher_class` -> ``TitanMXFP8TokenDispatcher``: :class:`MXFP8TokenDispatcher` as a torchtitan
  ``Configurable``; its ``Config(num_experts=..., top_k=..., wire="mxfp8", scale_mode="rceil")`` goes
  where torchtitan takes a dispatcher config: ``RoutedExperts.Config(token_dispatcher=...)``. It starts
  without an EP group (local dispatch) and follows torchtitan's ``wire_meshes(ep_mesh=...)``:
  ``ep_mesh=None`` (EP off) keeps dispatch local, an EP mesh makes it exchange tokens over it.
* :func:`converter_class` -> ``MXFP8MoEConverter``: a torchtitan model converter (``ModelConfigConverter``,
  the mechanism of its float8 / mx converters): in every ``RoutedExperts.Config`` it puts the MXFP8
  dispatcher (unless ``dispatcher=False``) and an experts ``Config`` whose ``build()`` converts the
  experts with ``quantize_(experts, MXFP8MoEConfig(scale_mode=...))``. In a torchtitan config::

      from moe_quant.ep.titan import converter_config
      model_spec = model_registry("16B", converters=[converter_config()])

  Converting an already converted config re-configures it (idempotent with the same settings).

The classes live in :mod:`moe_quant.ep.titan_classes` (module-level names: converted configs and the
models built from them pickle).
"""

from __future__ import annotations


def _classes():
    from . import titan_classes

    return titan_classes


def dispatcher_class():
    """``TitanMXFP8TokenDispatcher`` (imports torchtitan)."""
    return _classes().TitanMXFP8TokenDispatcher


def dispatcher_config(*, num_experts: int, top_k: int, wire: str = "mxfp8", scale_mode: str = "rceil",
                      capacity_factor: float | None = None, overflow: str = "error", max_tokens: int | None = None):
    """``TitanMXFP8TokenDispatcher.Config(...)``, for ``RoutedExperts.Config(token_dispatcher=...)``."""
    return dispatcher_class().Config(num_experts=num_experts, top_k=top_k, wire=wire, scale_mode=scale_mode,
                                     capacity_factor=capacity_factor, overflow=overflow, max_tokens=max_tokens)


def dispatcher_config_class():
    """``TitanMXFP8TokenDispatcher.Config`` (imports torchtitan)."""
    return dispatcher_class().Config


def converter_class():
    """``MXFP8MoEConverter``: torchtitan model converter (imports torchtitan)."""
    return _classes().MXFP8MoEConverter


def converter_config(*, scale_mode: str = "rceil", wire: str = "mxfp8", capacity_factor: float | None = None,
                     overflow: str = "error", max_tokens: int | None = None, dispatcher: bool = True,
                     dswiglu_cols_fp8: bool = False):
    """``MXFP8MoEConverter.Config(...)``, for torchtitan's ``model_registry(..., converters=[...])``
    (``capacity_factor``, ``overflow``, ``max_tokens``: the dispatcher's sync-free mode; ``dispatcher=False``:
    convert the experts only, keep the model's token dispatcher; ``dswiglu_cols_fp8``: the experts'
    ``MXFP8MoEConfig`` switch of that name)."""
    return converter_class().Config(scale_mode=scale_mode, wire=wire, capacity_factor=capacity_factor,
                                    overflow=overflow, max_tokens=max_tokens, dispatcher=dispatcher,
                                    dswiglu_cols_fp8=dswiglu_cols_fp8)


__all__ = ["dispatcher_class", "dispatcher_config", "dispatcher_config_class", "converter_class", "converter_config"]
