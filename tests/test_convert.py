"""Conversion that does nothing says so (issue 56, "silent no-ops"): ``moe_quant.convert`` returns what it converted
and raises ``ValueError`` when nothing converted; ``quantize_`` without a ``filter_fn`` (torchao's default filter
matches every ``nn.Linear``) raises, naming what to pass."""

import copy

import pytest
import torch
from torch import nn
from torchao.quantization import quantize_

import moe_quant
from moe_quant import MXFP8MoEConfig
from moe_quant.conversion import is_converted
from moe_quant.moe import GroupedExperts, TinyMoEModel


def _model():
    torch.manual_seed(0)
    return TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)


class _Renamed(nn.Module):
    """A model whose experts module is called ``moe_experts``: ``fqn.endswith(".experts")`` matches nothing."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.block = nn.Module()
        self.block.moe_experts = GroupedExperts(32, 64, 4)
        self.block.shared = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))


def test_convert_returns_the_converted_modules_by_name():
    model = _model()
    params = dict(model.named_parameters())
    got = moe_quant.convert(model, MXFP8MoEConfig(scale_mode="floor"),
                            filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    assert list(got) == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert all(model.get_submodule(n) is m and is_converted(m) for n, m in got.items())
    assert all(model.get_parameter(n) is p for n, p in params.items())
    # a container match (torchao's MoE documentation's name filter) returns the experts inside it
    again = moe_quant.convert(model, filter_fn=lambda mod, fqn: "moe" in fqn)
    assert list(again) == list(got) and all(m._mxfp8_config == MXFP8MoEConfig() for m in again.values())
    # the model itself matched
    mod = GroupedExperts(32, 64, 4)
    assert moe_quant.convert(mod, filter_fn=lambda m, fqn: fqn == "") == {"": mod}


def test_filter_matching_nothing_raises_naming_the_experts_modules():
    model = _Renamed()
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"nothing converted.*matched no module.*'block.moe_experts' "
                                         r"\(GroupedExperts\).*isinstance\(mod, GroupedExperts\)"):
        moe_quant.convert(model, filter_fn=lambda mod, fqn: fqn.endswith(".experts"))
    assert not any(is_converted(m) for m in model.modules())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_filter_matching_only_modules_without_experts_raises_naming_them():
    with pytest.raises(ValueError, match=r"matched 'block.shared' \(Sequential\), holding no experts.*"
                                         r"'block.moe_experts'"):
        moe_quant.convert(_Renamed(), filter_fn=lambda mod, fqn: fqn == "block.shared")


def test_model_without_experts_raises_naming_what_converts():
    with pytest.raises(ValueError, match=r"No module of the model holds experts.*supported are"):
        moe_quant.convert(nn.Sequential(nn.Linear(32, 32)), filter_fn=lambda mod, fqn: False)


@pytest.mark.parametrize("filter_kw", [{}, {"filter_fn": None}])
def test_quantize_without_filter_fn_raises_naming_what_to_pass(filter_kw):
    """torchao's default filter matches every nn.Linear; the first match raises, before anything changes."""
    model = _Renamed()
    with pytest.raises(ValueError, match=r"without filter_fn.*every nn.Linear \(here 'proj'\).*filter_fn=lambda"):
        quantize_(model, MXFP8MoEConfig(), **filter_kw)
    assert not any(is_converted(m) for m in model.modules())


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(model=None, filter_fn=lambda m, f: True), TypeError, "model"),
    (dict(model=nn.Linear(2, 2), config="rceil", filter_fn=lambda m, f: True), TypeError, "config"),
    (dict(model=nn.Linear(2, 2), filter_fn="experts"), TypeError, "filter_fn"),
])
def test_convert_rejects_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        moe_quant.convert(**kwargs)
