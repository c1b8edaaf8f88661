"""A reference Mixture-of-Experts block shaped like torchtitan's.

``MoE`` = ``TokenChoiceTopKRouter`` (softmax scores, top-k) -> token permutation (tokens
sorted by expert) -> ``GroupedExperts`` (3-D ``w1``/``w2``/``w3``, SwiGLU, three
``torch._grouped_mm`` calls with ``offs``) -> scores applied -> un-permutation (scatter-add
back to token order).

Every shape is static and nothing reads a device tensor on the host (no ``.item()``,
``.tolist()``, ``nonzero``, ``bincount``): group sizes come from a scatter-add into a
fixed ``(E,)`` buffer and ``offs`` from their cumulative sum, so the block compiles with
``fullgraph=True`` and routing changes never recompile. Groups are not padded: any group
size, 0 included, is valid for ``torch._grouped_mm`` and for ``mxfp8_grouped_mm``.

Converting the experts for MXFP8 training needs no change here::

    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts by softmax score over ``num_experts`` logits."""

    def __init__(self, dim: int, num_experts: int, top_k: int, route_norm: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.route_norm = route_norm

    def forward(self, x: torch.Tensor):
        """``x (T, dim)`` -> ``top_scores (T, k)`` fp32, ``selected (T, k)`` int64,
        ``num_tokens_per_expert (E,)`` int32."""
        scores = self.gate(x).float().softmax(dim=-1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=-1)
        if self.route_norm:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        flat = selected.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return top_scores, selected, counts


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts in three stacked weights, run with grouped GEMMs.

    ``w1``, ``w3``: ``(E, hidden, dim)``; ``w2``: ``(E, dim, hidden)`` (each ``(out, in)``
    per expert, like ``nn.Linear.weight``).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x (M, dim)``, tokens sorted by expert; ``num_tokens_per_expert (E,)`` sums to M."""
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        x = x.to(self.w1.dtype)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    """Router + permutation + grouped experts + un-permutation; ``(..., dim) -> (..., dim)``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, route_norm: bool = False):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, route_norm)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, selected, counts = self.router(x)
        # permutation: copies of each token, grouped by expert (stable: token order within a group)
        order = torch.argsort(selected.reshape(-1), stable=True)
        token_idx = order // self.top_k
        routed_out = self.experts(x[token_idx], counts)
        routed_out = routed_out * top_scores.reshape(-1)[order].unsqueeze(-1).to(routed_out.dtype)
        # un-permutation: sum the top_k expert outputs back into token order
        out = torch.zeros_like(x, dtype=routed_out.dtype).index_add(0, token_idx, routed_out)
        return out.to(x.dtype).reshape(shape)


class MoELayer(nn.Module):
    """Pre-norm residual MoE layer: ``x + moe(norm(x))``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.moe = MoE(dim, hidden_dim, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TinyMoEModel(nn.Module):
    """``in_proj -> n_layers x MoELayer -> norm -> out_proj``: the demo / test model."""

    def __init__(
        self, in_dim: int, dim: int, hidden_dim: int, num_experts: int, top_k: int, n_layers: int, out_dim: int
    ):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(MoELayer(dim, hidden_dim, num_experts, top_k) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.out_proj = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.out_proj(self.norm(h))


__all__ = ["TokenChoiceTopKRouter", "GroupedExperts", "MoE", "MoELayer", "TinyMoEModel"]
