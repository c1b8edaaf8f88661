"""torchtitan's overrides of the experts and of the token dispatcher with moe_quant's model converter, in either
order (issue 55 item 6: torchtitan runs model converters when the config is made, ``model_registry(...,
converters=...)``, and overrides later, in the trainer, ``apply_overrides``): each composes with the conversion or
fails at build with moe_quant's words; a dispatcher moe_quant's cannot stand in for (DeepEP, HybridEP,
MinimalAsyncEP) is kept, the experts converted, and the log says so once. CPU, no process group; configs of
torchtitan's DeepSeek-V3 debug model cut to 2 blocks (one MoE layer)."""

import dataclasses
import logging

import pytest
import torch

from examples.titan.launch import stub_missing_fsdp_names

stub_missing_fsdp_names()  # torchtitan 0.3.0 imports a name torch 2.11 lacks (a placeholder; see the launcher)
pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan not importable")
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import (DeepEPTokenDispatcher, HybridEPTokenDispatcher,  # noqa: E402
                                                       MinimalAsyncEPTokenDispatcher)
from torchtitan.models.deepseek_v3 import model_registry  # noqa: E402

from moe_quant.conversion import is_converted  # noqa: E402
from moe_quant.ep.titan import converter_config, dispatcher_config_class  # noqa: E402

THEIRS = {"deepep": DeepEPTokenDispatcher.Config, "hybridep": HybridEPTokenDispatcher.Config,
          "minimal_async_ep": MinimalAsyncEPTokenDispatcher.Config}


def _config(backend="standard"):
    cfg = model_registry("debugmodel", moe_comm_backend=backend).model
    return dataclasses.replace(cfg, layers=cfg.layers[:2], mtp_layers=[])


def _routed(cfg):
    (routed,) = [c for _, c, _, _ in cfg.traverse(RoutedExperts.Config)]
    return routed


def _convert(cfg, **kw):
    return converter_config(**kw).build().convert(cfg)


def _override(cfg, *imports):
    return apply_overrides(OverrideConfig(imports=list(imports)), cfg)


def _in_order(order, cfg, *imports):
    """The converter and the overrides ``imports`` on ``cfg``, converter first or overrides first."""
    if order == "converter_first":
        _convert(cfg)
        _override(cfg, *imports)
    else:
        _override(cfg, *imports)
        _convert(cfg)
    return cfg


@pytest.mark.parametrize("backend", list(THEIRS))
def test_a_dispatcher_moe_quants_cannot_stand_in_for_is_kept(backend, caplog):
    """The converter keeps DeepEP / HybridEP / MinimalAsyncEP (moe_quant's dispatcher stands in for torchtitan's
    local and all-to-all dispatchers only), converts the experts, and logs it once per dispatcher class; the
    settings the ranks compare say moe_quant's dispatcher is not in use. (It replaced them, silently.)"""
    cfg = _config(backend)
    theirs = _routed(cfg).token_dispatcher
    settings = dataclasses.asdict(theirs)
    with caplog.at_level(logging.INFO, logger="moe_quant"):
        _convert(cfg)
        _convert(_config(backend))  # a second model: no second message
    routed = _routed(cfg)
    assert routed.token_dispatcher is theirs and dataclasses.asdict(theirs) == settings
    assert routed.converter == {"dispatcher": False} and type(routed.inner_experts) is GroupedExperts.Config
    notes = [r.getMessage() for r in caplog.records if THEIRS[backend].__qualname__.split(".")[0] in r.getMessage()]
    assert len(notes) == 1 and "dispatcher=False" in notes[0], notes
    assert isinstance(_routed(_convert(_config("standard"))).token_dispatcher, dispatcher_config_class())


@pytest.mark.parametrize("order", ["converter_first", "overrides_first"])
@pytest.mark.parametrize("backend, imports, field, value", [
    ("deepep", ("torchtitan.overrides.moe_token_dispatcher.deepep_override", {"cudagraphable": True}),
     "cudagraphable", True),
    ("hybridep", ("torchtitan.overrides.moe_token_dispatcher.hybridep_override", {"capacity_factor": 0.5}),
     "non_blocking_capacity_factor", 0.5),
])
def test_torchtitans_dispatcher_overrides_compose_in_either_order(order, backend, imports, field, value):
    """``deepep_override`` / ``hybridep_override`` before or after the converter: the model keeps the chosen
    transport with the override's setting, and its experts are converted (``deepep_override`` after the converter
    raised ``TypeError: ... 'cudagraphable'`` on moe_quant's dispatcher config, or found nothing to override)."""
    cfg = _in_order(order, _config(backend), imports)
    routed = _routed(cfg)
    assert type(routed.token_dispatcher) is THEIRS[backend] and getattr(routed.token_dispatcher, field) == value
    assert routed.scale_mode == "rceil" and type(routed).__name__.startswith("MXFP8")


@pytest.mark.parametrize("order", ["converter_first", "overrides_first"])
def test_torchtitans_fused_experts_override_composes_in_either_order(order):
    """torchtitan's ``fused_grouped_experts`` (and ``fused_swiglu`` for the dense FFN) before or after the
    converter: the built model has torchtitan's fused experts, converted (their forward is torchtitan's, its grouped
    GEMMs through the seam), and moe_quant's dispatcher (after the converter the override was a silent no-op: it
    replaces only an exact ``GroupedExperts.Config``)."""
    pytest.importorskip("triton")  # torchtitan's fused override module defines a Triton kernel
    from torchtitan.overrides.fused_swiglu import FusedGroupedExperts

    cfg = _in_order(order, _config(), "torchtitan.overrides.fused_swiglu.fused_swiglu",
                    "torchtitan.overrides.fused_swiglu.fused_grouped_experts")
    assert type(_routed(cfg).inner_experts) is FusedGroupedExperts.Config
    with torch.device("meta"):
        model = cfg.build()
    (experts,) = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert isinstance(experts, FusedGroupedExperts) and is_converted(experts)
    assert "_grouped_mm" in vars(type(experts)) and "forward" not in vars(type(experts))  # the seam, its forward
    (block,) = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert type(block.token_dispatcher).__name__ == "TitanMXFP8TokenDispatcher"


def _block_step(block, seed=0):
    """One forward and backward of a built RoutedExperts (its local dispatcher): output and the experts' grads."""
    g = torch.Generator().manual_seed(seed)
    experts = block.inner_experts
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    t, k, e, d = 24, block.token_dispatcher.top_k, experts.num_experts, experts.w1_EFD.shape[-1]
    x = torch.randn(1, t, d, generator=g).requires_grad_()
    scores, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k, dim=-1)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    out = block(x, scores.view(1, t, k), ids.view(1, t, k), counts)
    out.square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("order", ["converter_first", "overrides_first"])
def test_a_users_experts_override_trains_in_mxfp8_in_either_order(order, mxfp8_calls):
    """An override of the experts with a class of the user's own (a forward of its own through torchtitan's seam):
    the built experts are that class, converted, and their GEMMs run in MXFP8 -- the converter before the override
    included (it converted the experts config the override then replaced: the built experts were not converted)."""
    import titan_overrides

    cfg = _in_order(order, _config(), "titan_overrides.gelu_experts")
    model = cfg.build()
    (block,) = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert isinstance(block.inner_experts, titan_overrides.GeluExperts) and is_converted(block.inner_experts)
    block.token_dispatcher.wire_meshes(ep_mesh=None)
    out = _block_step(block)
    assert len(mxfp8_calls) == 2 and torch.isfinite(out).all()
    assert all(getattr(block.inner_experts, w).grad.abs().sum() > 0 for w in ("w1_EFD", "w2_EDF"))  # gelu: no w3


def test_an_override_conversion_cannot_convert_fails_at_build_with_moe_quants_words():
    """After the converter, an override that replaces the experts with a class conversion cannot convert: building
    the model raises ``TypeError`` naming it (before, the plain experts were built, silently unconverted)."""
    cfg = _in_order("converter_first", _config(), "titan_overrides.flat_experts")
    with pytest.raises(TypeError, match=r"MXFP8MoEConverter: FlatExperts built from .* was not converted"):
        with torch.device("meta"):
            cfg.build()


@pytest.mark.parametrize("order", ["converter_first", "overrides_first"])
def test_a_users_dispatcher_override_composes_in_either_order(order, caplog):
    """An override of the dispatcher with a class of the user's own: before the converter, the converter keeps it
    (moe_quant's cannot stand in for it) and says so; after, it replaces moe_quant's (the later choice wins, as
    torchtitan orders them). Either way the experts are converted."""
    import titan_overrides

    with caplog.at_level(logging.INFO, logger="moe_quant"):
        cfg = _in_order(order, _config(), "titan_overrides.counting_dispatcher")
    model = cfg.build()
    (block,) = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert type(block.token_dispatcher) is titan_overrides.CountingDispatcher and is_converted(block.inner_experts)
