"""A token dispatcher with the interface of torchtitan's ``BaseEPTokenDispatcher`` (0.3.0), MXFP8 on the wire.

``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)`` returns
``(routed_input, num_tokens_per_local_expert, metadata)`` and ``combine(routed_output, metadata, x_TD)``
returns ``out_TD``, so a torchtitan MoE can use it in place of its all-to-all dispatcher (torchtitan is
not imported). The token order and the score/sum arithmetic are :mod:`moe_quant.routing`'s, the same
as the single-process :class:`moe_quant.moe.MoE`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import validation as v
from ..numerics import ScaleMode
from ..routing import sort_tokens_by_expert, unsort_tokens
from .legs import Route, Wire, combine_rows, dispatch_rows, plan_route

_ACT_DTYPES = (torch.bfloat16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EPDispatchMetadata:
    """What :meth:`MXFP8TokenDispatcher.combine` needs from its ``dispatch``."""

    token_indices_experts_sorted_N: torch.Tensor  # (T*K,) token of each sorted row  # noqa: N815
    topk_scores_experts_sorted_N: torch.Tensor  # (T*K,) its routing score  # noqa: N815
    route: Route


def _group_of(ep_mesh):
    if ep_mesh is None or isinstance(ep_mesh, dist.ProcessGroup):
        return ep_mesh
    if hasattr(ep_mesh, "get_group"):  # a 1-D DeviceMesh
        return ep_mesh.get_group()
    raise TypeError(f"ep_mesh must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(ep_mesh).__name__}")


class MXFP8TokenDispatcher:
    """Expert-parallel token dispatcher over ``group`` (``None``: the default process group).

    Args:
        num_experts: experts of the whole model, a multiple of the group size; rank r holds experts
            ``[r * E_local, (r + 1) * E_local)``.
        top_k: experts per token.
        group: the EP process group (any backend: nccl, gloo); :meth:`wire_meshes` sets it later too.
        wire: ``"mxfp8"`` (dispatch forward and combine backward send MXFP8) or ``"bf16"`` (every leg
            sends the tensors' own dtype).
        scale_mode: scale rounding of the MXFP8 legs; use the converted experts' mode so their GEMMs
            reuse what was received (``"rceil"`` default, ``"floor"``).
    """

    def __init__(self, num_experts: int, top_k: int, *, group=None, wire: Wire | str = Wire.MXFP8,
                 scale_mode: ScaleMode | str = ScaleMode.RCEIL):
        self.num_experts = v.check_size("num_experts", num_experts)
        self.top_k = v.check_size("top_k", top_k)
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.wire = Wire.parse(wire)
        self.scale_mode = ScaleMode.parse(scale_mode)
        self.group = _group_of(group)

    def wire_meshes(self, *, ep_mesh=None, **_unused) -> None:
        """Install the EP group (a ProcessGroup or a 1-D DeviceMesh), as torchtitan's dispatchers do."""
        self.group = _group_of(ep_mesh)

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def _check(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
        v.check_tensor("x_TD", x_TD, dtypes=_ACT_DTYPES, ndim=2)
        v.check_last_dim_blocks("x_TD", x_TD)
        t = x_TD.shape[0]
        v.check_tensor("topk_scores_TK", topk_scores_TK, dtypes=(torch.float32, torch.bfloat16), ndim=2)
        v.check_shape("topk_scores_TK", topk_scores_TK, (t, self.top_k), "(T, top_k)")
        v.check_tensor("topk_expert_ids_TK", topk_expert_ids_TK, dtypes=_ID_DTYPES, ndim=2)
        v.check_shape("topk_expert_ids_TK", topk_expert_ids_TK, (t, self.top_k), "(T, top_k)")
        v.check_tensor("num_local_tokens_per_expert_E", counts, dtypes=_ID_DTYPES, ndim=1)
        v.check_shape("num_local_tokens_per_expert_E", counts, (self.num_experts,), "(num_experts,)")
        for name, tensor in (("topk_scores_TK", topk_scores_TK), ("topk_expert_ids_TK", topk_expert_ids_TK),
                             ("num_local_tokens_per_expert_E", counts)):
            v.check_same_device(name, tensor, "x_TD", x_TD)
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts = {self.num_experts} must be a multiple of the EP group size "
                             f"{self.ep_size}")

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """Sort this rank's token copies by expert and send them to the experts' ranks.

        Returns ``(routed_input (M_recv, D), num_tokens_per_local_expert (E_local,) int32, metadata)``:
        the rows for this rank's experts, expert-major (for each expert, each source rank's rows in
        that rank's token order). Synchronizes the host once (the split sizes).
        """
        self._check(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK)
        ids = topk_expert_ids_TK.reshape(-1)
        in_range = (ids >= 0) & (ids < self.num_experts)
        actual = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device).scatter_add(
            0, torch.where(in_range, ids, 0).to(torch.int64), in_range.to(torch.int64))
        mismatch = (~in_range).any() | (actual != num_local_tokens_per_expert_E.to(torch.int64)).any()
        route = plan_route(num_local_tokens_per_expert_E, ids.numel(), self.group, wire=self.wire,
                           mode=self.scale_mode, mismatch=mismatch)
        metadata = EPDispatchMetadata(token_indices_experts_sorted_N=token_idx,
                                      topk_scores_experts_sorted_N=scores_sorted, route=route)
        return dispatch_rows(x_sorted, route), route.num_tokens_per_local_expert, metadata

    def combine(self, routed_output, metadata: EPDispatchMetadata, x_TD, **_unused):
        """Send the expert outputs back, scale them by their routing scores and sum each token's rows.

        ``routed_output (M_recv, D)`` in the order :meth:`dispatch` returned; ``out_TD`` has ``x_TD``'s
        shape and dtype. (Keyword arguments of newer torchtitan signatures are accepted and ignored.)
        """
        if not isinstance(metadata, EPDispatchMetadata):
            raise TypeError(f"metadata must be the EPDispatchMetadata dispatch returned, got {type(metadata).__name__}")
        v.check_tensor("routed_output", routed_output, dtypes=_ACT_DTYPES, ndim=2)
        v.check_shape("routed_output", routed_output, (metadata.route.rows_received, x_TD.shape[1]),
                      "(rows dispatch returned, D)")
        y = combine_rows(routed_output, metadata.route)
        return unsort_tokens(y, metadata.topk_scores_experts_sorted_N, metadata.token_indices_experts_sorted_N, x_TD)


__all__ = ["MXFP8TokenDispatcher", "EPDispatchMetadata"]
