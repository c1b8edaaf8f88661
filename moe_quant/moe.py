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

from .routing import sort_tokens_by_expert, unsort_tokens


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


class _RoutedBlock(nn.Module):
    """``(..., dim) -> (..., dim)``: the router, then ``forward_routed`` for its routing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, selected, counts = self.router(x)
        return self.forward_routed(x, top_scores, selected, counts).reshape(shape)


class MoE(_RoutedBlock):
    """Router + permutation + grouped experts + un-permutation; ``(..., dim) -> (..., dim)``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, route_norm: bool = False):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, route_norm)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.top_k = top_k

    def forward_routed(self, x_TD, top_scores_TK, expert_ids_TK, num_tokens_per_expert_E) -> torch.Tensor:
        """The block after the router, for a given routing: ``(T, D) -> (T, D)``."""
        # permutation: copies of each token, grouped by expert (stable: token order within a group)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x_TD, top_scores_TK, expert_ids_TK)
        routed_out = self.experts(x_sorted, num_tokens_per_expert_E)
        # un-permutation: scale by the scores, sum the top_k expert outputs back into token order
        return unsort_tokens(routed_out, scores_sorted, token_idx, x_TD)


class EPMoE(_RoutedBlock):
    """:class:`MoE` with its experts sharded over an expert-parallel process group.

    Every rank holds the router (replicated) and ``num_experts / world`` experts: rank r the experts
    ``[r * E_local, (r + 1) * E_local)``. Tokens go to their experts' ranks and back through
    :class:`moe_quant.ep.MXFP8TokenDispatcher` (``wire="mxfp8"``: MXFP8 dispatch and combine backward).
    With the experts converted (``quantize_(..., MXFP8MoEConfig(scale_mode=...))``, the same scale mode),
    the forward output and the input gradient equal the single-process converted :class:`MoE` bit for bit
    for the same routing, global token order rank-major (``tests/test_ep.py``). ``transport="p2p"`` with
    ``chunks`` > 1 runs the local experts in that many ranges, each overlapping the exchange of the others
    (:mod:`moe_quant.ep.blocks`; the same bits, weight gradients included); ``sm_carveout`` leaves that many
    SMs to the exchange while each range's experts run (:class:`moe_quant.ep.MXFP8TokenDispatcher`).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, group=None,
                 route_norm: bool = False, wire: str = "mxfp8", scale_mode: str = "rceil",
                 capacity_factor: float | None = None, overflow: str = "error", max_tokens: int | None = None,
                 transport: str = "all_to_all", chunks: int = 1, sm_carveout: int | None = None):
        super().__init__()
        from .ep import MXFP8TokenDispatcher

        self.dispatcher = MXFP8TokenDispatcher(num_experts, top_k, group=group, wire=wire, scale_mode=scale_mode,
                                               capacity_factor=capacity_factor, overflow=overflow,
                                               max_tokens=max_tokens, transport=transport, chunks=chunks,
                                               sm_carveout=sm_carveout)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, route_norm)
        self.experts = GroupedExperts(dim, hidden_dim, self.dispatcher.num_local_experts)
        self.dispatcher.compared_experts = self.experts  # the ranks' conversions compared in its handshake
        self.top_k = top_k

    @classmethod
    def from_moe(cls, moe: MoE, *, group=None, wire: str = "mxfp8", scale_mode: str = "rceil",
                 capacity_factor: float | None = None, overflow: str = "error",
                 max_tokens: int | None = None, transport: str = "all_to_all", chunks: int = 1,
                 sm_carveout: int | None = None) -> "EPMoE":
        """This rank's shard of an (unconverted) :class:`MoE`: its router and its slice of the experts
        (``capacity_factor``, ``overflow``, ``max_tokens``: the sync-free mode of
        :class:`moe_quant.ep.MXFP8TokenDispatcher`; ``transport``, ``chunks``, ``sm_carveout``: its transport)."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a moe_quant.moe.MoE, got {type(moe).__name__}")
        w1 = moe.experts.w1
        ep = cls(w1.shape[2], w1.shape[1], moe.experts.num_experts, moe.top_k, group=group,
                 route_norm=moe.router.route_norm, wire=wire, scale_mode=scale_mode,
                 capacity_factor=capacity_factor, overflow=overflow, max_tokens=max_tokens, transport=transport,
                 chunks=chunks, sm_carveout=sm_carveout).to(w1.device, w1.dtype)
        ep.router.to(moe.router.gate.weight.dtype)  # each part in its own dtype (fp32 router, bf16 experts)
        n, rank = ep.experts.num_experts, torch.distributed.get_rank(group)
        with torch.no_grad():
            ep.router.gate.weight.copy_(moe.router.gate.weight)
            for name in ("w1", "w2", "w3"):
                getattr(ep.experts, name).copy_(getattr(moe.experts, name)[rank * n:(rank + 1) * n])
        return ep

    def forward_routed(self, x_TD, top_scores_TK, expert_ids_TK, num_tokens_per_expert_E) -> torch.Tensor:
        """The block after the router, for this rank's tokens and their routing (global expert ids)."""
        self.dispatcher.experts_dtype = self.experts.w1.dtype  # GroupedExperts casts its input to its weights' dtype
        if not torch.compiler.is_compiling():
            self.dispatcher.compared_experts = self.experts  # (experts replaced since: these)
        return self.dispatcher.dispatch_combine(x_TD, top_scores_TK, expert_ids_TK, num_tokens_per_expert_E,
                                                self.experts, self._expert_ranges)

    def _expert_ranges(self, ranges):
        """One callable per range ``(lo, hi)`` of the local experts: ``self.experts`` (converted or not) on its
        weights' slices ``[lo, hi)`` (``torch.func.functional_call``). The weights are split once, so their
        gradients are the ranges' gradients concatenated (every bit)."""
        sizes = [hi - lo for lo, hi in ranges]
        parts = {name: p.split(sizes) for name, p in self.experts.named_parameters()}

        def run(i):
            return lambda x, counts: torch.func.functional_call(
                self.experts, {name: ws[i] for name, ws in parts.items()}, (x, counts))

        return [run(i) for i in range(len(ranges))]


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


__all__ = ["TokenChoiceTopKRouter", "GroupedExperts", "MoE", "EPMoE", "MoELayer", "TinyMoEModel"]
