"""torchtitan overrides of this repository's tests (``tests/test_torchtitan_overrides.py``): registered with
torchtitan's ``@override`` when this module is imported (``OverrideConfig(imports=["titan_overrides.NAME"])``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.config.override import derive, override
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher


class GeluExperts(GroupedExperts):
    """torchtitan's experts with a forward of their own (gelu, two GEMMs through torchtitan's seam)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD, num_tokens_per_expert_E):
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.gelu(self._grouped_mm(A=x_RD.bfloat16(), B_t=self.w1_EFD.bfloat16().transpose(-2, -1), offs=offs))
        return self._grouped_mm(A=h, B_t=self.w2_EDF.bfloat16().transpose(-2, -1), offs=offs).type_as(x_RD)


@override(target=GroupedExperts.Config, description="gelu experts (moe_quant's tests)")
def gelu_experts(cfg: GroupedExperts.Config) -> GeluExperts.Config:
    return derive(cfg, GeluExperts.Config)


class FlatExperts(GroupedExperts):
    """Experts without 3-D weights (a stand-in for anything conversion cannot convert)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def __init__(self, config):
        super().__init__(config)
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            setattr(self, name, torch.nn.Parameter(getattr(self, name).detach().flatten(1)))


@override(target=GroupedExperts.Config, description="flat experts (moe_quant's tests)")
def flat_experts(cfg: GroupedExperts.Config) -> FlatExperts.Config:
    return derive(cfg, FlatExperts.Config)


class CountingDispatcher(LocalTokenDispatcher):
    """torchtitan's local dispatcher, another class (a user's own dispatcher)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LocalTokenDispatcher.Config):
        pass


@override(target=LocalTokenDispatcher.Config, description="a user's dispatcher (moe_quant's tests)")
def counting_dispatcher(cfg: LocalTokenDispatcher.Config) -> CountingDispatcher.Config:
    return CountingDispatcher.Config(num_experts=cfg.num_experts, top_k=cfg.top_k)
