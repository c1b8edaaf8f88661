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
from ..choices import Choice
from ..numerics import ScaleMode
from ..routing import sort_tokens_by_expert, unsort_tokens
from . import agree, blocks, capacity, pipeline
from .legs import (HostRead, Route, Wire, combine_rows, constant as legs_constant, dispatch_rows, exchange_counts,
                   read_counts, received_counts, route_from_counts)
from .wire import all_to_all_rows, quantize_rows

_ACT_DTYPES = (torch.bfloat16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EPDispatchMetadata:
    """What :meth:`MXFP8TokenDispatcher.combine` needs from its ``dispatch``."""

    token_indices_experts_sorted_N: torch.Tensor  # (T*K,) token of each sorted row  # noqa: N815
    topk_scores_experts_sorted_N: torch.Tensor  # (T*K,) its routing score  # noqa: N815
    route: Route | capacity.CapacityRoute | blocks.BlockExchange | None  # None: local dispatch (no EP group)


class Transport(Choice):
    ALL_TO_ALL = "all_to_all"  # all_to_all_single per leg (MXFP8: data, then scales), rows permuted; compiles
    P2P = "p2p"  # point-to-point blocks placed where they are used (moe_quant.ep.blocks); eager, synced mode
    __argname__ = "transport"


_LOCAL = "local"  # group sentinel: no EP group, dispatch on this rank only (torchtitan's ep_mesh=None)


def _group_of(ep_mesh):
    if ep_mesh is None or isinstance(ep_mesh, str) and ep_mesh == _LOCAL or isinstance(ep_mesh, dist.ProcessGroup):
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
        group: the EP process group (any backend: nccl, gloo), a 1-D DeviceMesh, ``None`` (the default
            process group) or ``"local"`` (no EP: dispatch on this rank only, all experts local).
            :meth:`wire_meshes` sets it later with torchtitan's meaning (``ep_mesh=None``: local).
        wire: ``"mxfp8"`` (dispatch forward and combine backward send MXFP8) or ``"bf16"`` (every leg
            sends the tensors' own dtype).
        scale_mode: scale rounding of the MXFP8 legs; use the converted experts' mode so their GEMMs
            reuse what was received (``"rceil"`` default, ``"floor"``).
        capacity_factor: ``None`` (synced mode: one host read per dispatch) or a positive number: the
            sync-free mode of :mod:`moe_quant.ep.capacity` (fixed capacity, static sizes, no host read).
        overflow: sync-free mode: ``"error"`` (default: NaN outputs, :meth:`check_overflow` raises) or
            ``"drop"`` (copies past capacity contribute zero, counted in ``dropped_rows``).
        max_tokens: sync-free mode: the token bound ``T_max`` (tokens per rank per dispatch) that fixes the
            capacity of every rank alike. ``None`` (default): the largest T of the ranks at the first
            dispatch, agreed in the one-time handshake (its host read). A later dispatch with more tokens
            on a rank than the bound overflows (counted, never mismatched sizes).
        transport: synced mode: ``"all_to_all"`` (default: ``all_to_all_single`` per leg, MXFP8 data
            and scales as two exchanges, the rows permuted; compiles) or ``"p2p"``
            (:mod:`moe_quant.ep.blocks`: each (rank, expert) block sent point to point straight into the
            order it is used in, no permutation passes;
            eager; under ``torch.compile`` the all-to-all transport runs, the same bits). The sync-free
            mode always uses the all-to-all.
        chunks: :meth:`dispatch_combine` (as :class:`moe_quant.moe.EPMoE` runs it), eager, with the ``"p2p"``
            transport or in the sync-free mode: the local experts in this many ranges, each range's experts
            running while the later ranges travel, each range's combine travelling while the next range
            computes (:mod:`moe_quant.ep.pipeline`); default 1 (no overlap). Synced: the same bits for any
            value. Sync-free: each range has its own slots per peer (its share of the capacity,
            :func:`moe_quant.ep.capacity.slots_per_rank`), so overflow is per range; nothing
            overflowing, the same bits as one range. :meth:`dispatch` / :meth:`combine` alone, and
            compiled calls, run one range.
        sm_carveout: with ``chunks`` > 1, the number of SMs torch's GEMMs leave free while each range's experts
            run (forward and backward), so that they are not slowed by the NCCL kernels that overlap them
            (:class:`moe_quant.ep.pipeline.SmWindow`); default None (every SM). A setting of this rank alone:
            the ranks need not agree, and the bits do not change.

    ``experts_dtype`` (an attribute, default None): the dtype the experts quantize their input rows and output
    gradients in, where it is narrower than the rows' (fp32 activations into experts that cast them to bf16): the
    MXFP8 legs then quantize the rows' rounding to it, so that what arrives is what the experts would quantize
    (:class:`moe_quant.moe.EPMoE` sets its experts' dtype; torchtitan's dispatcher bf16, the dtype torchtitan's
    experts cast to). None: the rows as they are.

    ``compared_experts`` (an attribute, default None): the experts module the dispatcher feeds. Where set, the
    one-time handshake also compares its conversion (converted or not, its ``MXFP8MoEConfig``) across the ranks, as a
    digest, and ranks whose experts differ all raise one ``ValueError`` naming the settings
    (:mod:`moe_quant.conversion.ranks`); :class:`moe_quant.moe.EPMoE` sets its own.

    Ranks that disagree (on num_experts, top_k, wire, scale mode, capacity_factor, overflow, max_tokens,
    transport, chunks: checked by a one-time handshake per group before the first dispatch; on the hidden size and the
    activation dtype: carried with every counts exchange) or whose arguments are invalid on one rank
    only all raise one ``ValueError`` naming the setting and the ranks, before any token is sent
    (:mod:`moe_quant.ep.agree`).

    The count steps have the names of torchtitan's ``AllToAllTokenDispatcher`` methods:
    :meth:`_token_count_exchange` (the counts all-to-all) and :meth:`_sync_token_count_exchange` (its one
    host read). torchtitan's graph passes (its graph_trainer experiment) do not tag them here: they wrap
    torchtitan's own class attributes, which this class does not inherit, and expect bare tagged
    all-to-all nodes, while the token exchanges here run inside the differentiable legs of
    :mod:`moe_quant.ep.legs` (quantize, all-to-all, permute); docs/torchtitan.md ("torchtitan's graph
    passes") says what that means for them.
    """

    def __init__(self, num_experts: int, top_k: int, *, group=None, wire: Wire | str = Wire.MXFP8,
                 scale_mode: ScaleMode | str = ScaleMode.RCEIL, capacity_factor: float | None = None,
                 overflow: str = "error", max_tokens: int | None = None,
                 transport: Transport | str = Transport.ALL_TO_ALL, chunks: int = 1,
                 sm_carveout: int | None = None):
        self.num_experts = v.check_size("num_experts", num_experts)
        self.top_k = v.check_size("top_k", top_k)
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.wire = Wire.parse(wire)
        self.scale_mode = ScaleMode.parse(scale_mode)
        self.group = _group_of(group)
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                                and not isinstance(capacity_factor, bool) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None (synced mode) or a positive number, got {capacity_factor!r}")
        if overflow not in capacity.OVERFLOW:
            raise ValueError(f"overflow must be one of {list(capacity.OVERFLOW)}, got {overflow!r}")
        if max_tokens is not None:
            if capacity_factor is None:
                raise ValueError("max_tokens is the token bound of the sync-free mode: pass capacity_factor too "
                                 "(the synced mode sizes every exchange from the counts)")
            if v.check_size("max_tokens", max_tokens) < 1:
                raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.transport = Transport.parse(transport)
        if v.check_size("chunks", chunks) < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        if chunks > 1 and self.transport is not Transport.P2P and capacity_factor is None:
            raise ValueError(f"chunks={chunks} overlaps the experts with the exchange of the point-to-point transport "
                             f"or of the sync-free mode: pass transport='p2p' or a capacity_factor (got transport="
                             f"{self.transport.value!r}, capacity_factor=None)")
        self.chunks = chunks
        if sm_carveout is not None and v.check_size("sm_carveout", sm_carveout) < 0:
            raise ValueError(f"sm_carveout must be None or a number of SMs >= 0, got {sm_carveout}")
        self.sm_carveout = sm_carveout
        self.capacity_factor = capacity_factor
        self.overflow = overflow
        self.max_tokens = max_tokens
        self.dropped_rows = None  # sync-free mode: device int64 counter of token copies past capacity
        self.experts_dtype = None  # the dtype the experts quantize their rows in (None: the rows' own); see the doc
        self._agreed = ()  # (group,): the group the one-time handshake passed on
        self._bound = None  # sync-free mode: the token bound agreed on that group

    # combine's sum, ``scatter_add(out, index, src)`` (see moe_quant.routing.unsort_tokens); None: Tensor.scatter_add
    _scatter_add = None
    compared_experts = None  # the experts module whose conversion the handshake compares (see the class doc)

    def wire_meshes(self, *, ep_mesh=None, **_unused) -> None:
        """Install the EP group (a ProcessGroup or a 1-D DeviceMesh), as torchtitan's dispatchers do:
        ``ep_mesh=None`` means no expert parallelism (local dispatch)."""
        self.group = _LOCAL if ep_mesh is None else _group_of(ep_mesh)

    @property
    def is_local(self) -> bool:
        return isinstance(self.group, str)

    @property
    def ep_size(self) -> int:
        return 1 if self.is_local else dist.get_world_size(self.group)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def _check(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts) -> None:
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

    def _settings(self, x_TD) -> list:
        hidden = x_TD.shape[1] if isinstance(x_TD, torch.Tensor) and x_TD.ndim == 2 else -1
        dtype = x_TD.dtype if isinstance(x_TD, torch.Tensor) else None
        return agree.header(hidden=hidden, num_experts=self.num_experts, top_k=self.top_k, dtype=dtype,
                            wire=self.wire, mode=self.scale_mode)

    def _handshake_due(self, tokens) -> bool:
        """The next :meth:`handshake` with ``tokens`` exchanges (a collective with a host read on every rank)."""
        if self.is_local:
            return False
        return self._agreed != (self.group,) or (self.capacity_factor is not None and self._bound is None
                                                 and tokens is not None)

    def handshake(self, device, tokens: int | None = None, *, bad_args: bool = False) -> None:
        """Check once per group that every rank built the dispatcher alike (num_experts, top_k, wire, scale
        mode, capacity factor, overflow, max_tokens), before the counts exchange (whose size depends on
        num_experts). One small all-to-all and a host read; :meth:`dispatch` calls it before its first
        exchange on a group (call it yourself before capturing a CUDA graph or compiling: skipped while
        tracing). ``tokens``: this rank's token count T of the coming dispatch; in the sync-free mode
        without ``max_tokens`` the largest T of the ranks becomes the token bound (:attr:`token_bound`),
        so that every rank sends and receives the same number of slots; until it is fixed (a handshake
        without ``tokens``, or T = 0 on every rank), the next dispatch runs the handshake again.
        ``bad_args``: this rank's dispatch arguments are invalid (every rank then raises)."""
        if not self._handshake_due(tokens):
            return
        agreed = self._agreed == (self.group,)
        if torch.compiler.is_compiling():
            # traced: the counts exchange checks top_k, wire and scale mode as runtime asserts, but a
            # num_experts mismatch changes its size: run this eagerly first (the torchtitan component does,
            # in wire_meshes)
            return
        if not agreed:
            self._bound = None
        world = dist.get_world_size(self.group)
        experts = None
        if self.compared_experts is not None:
            from ..conversion import is_converted, ranks

            experts = ranks.experts_settings(self.compared_experts, is_converted(self.compared_experts))
        mine = agree.handshake_row(self._settings(None), capacity_factor=self.capacity_factor,
                                   overflow=self.overflow, max_tokens=self.max_tokens, transport=self.transport,
                                   chunks=self.chunks, experts=agree.digest(experts), tokens=tokens)
        if bad_args:
            mine[0] = agree.BAD_ARGS
        msg = torch.tensor(mine, dtype=torch.int64).to(device).expand(world, len(mine)).contiguous()
        got = all_to_all_rows(msg, [1] * world, [1] * world, self.group, "counts").tolist()
        message = agree.diagnose(got, fields=agree.HANDSHAKE_FIELDS, skip=("hidden size", "dtype", "experts", "tokens"))
        column = agree.HANDSHAKE_FIELDS.index("experts")
        if message is None and len({row[column] for row in got}) > 1:  # every rank sees it: all gather the settings
            message = self._experts_disagree(experts)
        if message is None and self.num_experts % world:
            message = f"num_experts = {self.num_experts} must be a multiple of the EP group size {world}"
        if message is not None:
            raise ValueError(message)
        if self.capacity_factor is not None:
            self._bound = agree.token_bound(got)
            self._counter(device)  # made here, eagerly: a compiled dispatch finds it (no retrace for it)
        self._agreed = (self.group,)

    def _experts_disagree(self, experts: dict | None) -> str:
        """The ranks' experts settings differ (their digests did): the message every rank raises, naming them."""
        from ..conversion import ranks

        rows = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(rows, (dist.get_rank(), experts or {}), group=self.group)
        return ranks.diagnose(rows, checked="by the EP dispatcher's one-time handshake (EPMoE: its first dispatch)")

    @property
    def token_bound(self) -> int | None:
        """Sync-free mode: the tokens per rank the capacity is sized for, the same on every rank of the
        group (``max_tokens``, or the largest T of the ranks at the first dispatch); None before it is fixed."""
        return self._bound if self._agreed == (self.group,) else None

    def _token_count_exchange(self, counts, rows: int, settings: list, mismatch, bad_args: bool, **kwargs):
        """The counts all-to-all (with every rank's settings and problem code); no host read."""
        return exchange_counts(counts, rows, self.group, settings=settings, mismatch=mismatch, bad_args=bad_args,
                               **kwargs)

    def _sync_token_count_exchange(self, msg, recv, rows: int, pending: HostRead | None = None):
        """The one host synchronization (``pending``: started earlier): the :class:`moe_quant.ep.legs.Counts`,
        or the same error on every rank."""
        return read_counts(msg, recv, rows, self.group, pending)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """Sort this rank's token copies by expert and send them to the experts' ranks.

        Returns ``(routed_input (M_recv, D), num_tokens_per_local_expert (E_local,) int32, metadata)``:
        the rows for this rank's experts, expert-major (for each expert, each source rank's rows in
        that rank's token order). Synchronizes the host once (the split sizes). Without an EP group
        (``"local"``) the sorted rows and the counts come back as they are, nothing is exchanged.
        """
        if self.is_local:
            self._check(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK)
            metadata = EPDispatchMetadata(token_indices_experts_sorted_N=token_idx,
                                          topk_scores_experts_sorted_N=scores_sorted, route=None)
            return x_sorted, num_local_tokens_per_expert_E, metadata
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
        if self.capacity_factor is not None:
            self._sync_free_checks(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            return self._dispatch_sync_free(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        x_sorted, token_idx, scores_sorted, quantized, counts, recv = self._synced_exchange(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        if self._blocks_transport():
            ex = self._block_exchange(counts, recv, chunks=1)
            routed = pipeline.received(pipeline.send(x_sorted, ex, quantized)[0], ex, 0)
            route = ex
        else:
            route = route_from_counts(recv, counts, self.group, wire=self.wire, mode=self.scale_mode,
                                      cast=self.experts_dtype)
            routed = dispatch_rows(x_sorted, route, quantized)
        metadata = EPDispatchMetadata(token_indices_experts_sorted_N=token_idx,
                                      topk_scores_experts_sorted_N=scores_sorted, route=route)
        return routed, route.num_tokens_per_local_expert, metadata

    def _synced_exchange(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """The synced mode up to the token exchange: checks, the counts exchange, the sort and (MXFP8 wire)
        the quantization of the sorted rows, queued before the host reads the counts (so the device works
        while the host waits for the counts alone), then that read. Returns ``(x_sorted, token_idx,
        scores_sorted, quantized or None, Counts, recv)``."""
        try:
            self._check(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            local_error = None
        except (TypeError, ValueError) as exc:  # still take part in the exchange, so that peers raise too
            local_error = exc
        device = x_TD.device if isinstance(x_TD, torch.Tensor) else torch.device("cpu")
        self.handshake(device)
        settings = self._settings(x_TD)
        if local_error is not None:
            counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            msg, recv = self._token_count_exchange(counts, 0, settings, None, True)
            try:
                self._sync_token_count_exchange(msg, recv, 0)  # raises: this rank reported BAD_ARGS
            except ValueError as group_error:  # peers raise this one; this rank its own error
                raise local_error from group_error
            raise local_error  # traced: the check above runs when the graph does, this rank's error now
        mismatch = self._mismatch(topk_expert_ids_TK, num_local_tokens_per_expert_E)
        rows = topk_expert_ids_TK.numel()
        msg, recv = self._token_count_exchange(num_local_tokens_per_expert_E, rows, settings, mismatch, False)
        pending = HostRead(msg, recv)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK)
        # traced, nothing is read on the host (unbacked sizes): the leg quantizes inside its autograd function
        quantize = self.wire is Wire.MXFP8 and not torch.compiler.is_compiling()
        quantized = quantize_rows(x_sorted, self.scale_mode, self.experts_dtype) if quantize else None
        counts = self._sync_token_count_exchange(msg, recv, rows, pending)
        return x_sorted, token_idx, scores_sorted, quantized, counts, recv

    def _blocks_transport(self) -> bool:
        """The point-to-point transport runs (``"p2p"``, synced, eager)."""
        return (self.transport is Transport.P2P and self.capacity_factor is None and not self.is_local
                and not torch.compiler.is_compiling() and dist.is_available() and dist.is_initialized())

    def _block_exchange(self, counts, recv, chunks: int) -> blocks.BlockExchange:
        recv_counts = received_counts(recv)
        return blocks.BlockExchange(self.group, wire=self.wire, mode=self.scale_mode, cast=self.experts_dtype,
                                    sent=counts.sent,
                                    recv=counts.received,
                                    ranges=pipeline.expert_ranges(self.num_local_experts, chunks),
                                    num_tokens_per_local_expert=recv_counts.sum(0, dtype=torch.int32),
                                    recv_counts=recv_counts)

    def dispatch_combine(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E, experts,
                         split_experts=None):
        """:meth:`dispatch`, ``experts(routed_input, num_tokens_per_local_expert)``, :meth:`combine`: ``out_TD``.

        With ``chunks`` > 1 (eager; the ``"p2p"`` transport or the sync-free mode) the local experts run in
        ranges (:mod:`moe_quant.ep.pipeline`): ``split_experts(ranges)`` returns one callable per range
        ``(lo, hi)`` of local experts, taking that range's rows and counts like ``experts``
        (:class:`moe_quant.moe.EPMoE` splits its weights); range c's experts start once range c has arrived
        while the later ranges travel, and its outputs travel back while range c + 1 computes. Outputs and
        every gradient are the same bits as unchunked (sync-free: where nothing overflows).
        """
        chunked_sync_free = (self.capacity_factor is not None and self.chunks > 1 and not self.is_local
                             and not torch.compiler.is_compiling())
        if not (self._blocks_transport() or chunked_sync_free) or self.chunks == 1 and split_experts is None:
            routed, num_tokens_per_local_expert, metadata = self.dispatch(
                x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            return self.combine(experts(routed, num_tokens_per_local_expert), metadata, x_TD)
        if self.chunks > 1 and split_experts is None:
            raise ValueError(f"chunks={self.chunks} runs the experts range by range: pass split_experts, a "
                             f"function of the ranges [(lo, hi), ...] that returns one experts callable per range")
        ranges = pipeline.expert_ranges(self.num_local_experts, self.chunks)
        runners = [experts] if len(ranges) == 1 else list(split_experts(ranges))
        carve = self._carveout(x_TD) if len(ranges) > 1 else None
        if chunked_sync_free:
            self._sync_free_checks(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            x_sorted, token_idx, scores_sorted, plans, receives, total_dropped = self._sync_free_plan(
                x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E, ranges)
            ex = capacity.SlotExchange(self.group, wire=self.wire, mode=self.scale_mode, cast=self.experts_dtype,
                                       world=self.ep_size,
                                       ranges=ranges, plans=plans, receives=receives, rows=token_idx.shape[0])
            y = pipeline.run_ranges(ex, x_sorted, runners, sm_carveout=carve)
            scores_sorted = self._poisoned_if_dropped(scores_sorted, total_dropped)
        else:
            x_sorted, token_idx, scores_sorted, quantized, counts, recv = self._synced_exchange(
                x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            y = pipeline.run_ranges(self._block_exchange(counts, recv, self.chunks), x_sorted, runners, quantized,
                                    sm_carveout=carve)
        return unsort_tokens(y, scores_sorted, token_idx, x_TD, scatter_add=self._scatter_add)

    def _carveout(self, x_TD) -> int | None:
        """``sm_carveout``, checked against the SMs of ``x_TD``'s device (what is left must run a GEMM)."""
        n = self.sm_carveout
        if n is not None and x_TD.is_cuda:
            sms = torch.cuda.get_device_properties(x_TD.device).multi_processor_count
            if n >= sms:
                raise ValueError(f"sm_carveout={n} leaves no SM of the {sms} of {x_TD.device} to the GEMMs")
        return n

    def _mismatch(self, topk_expert_ids_TK, counts):
        """0-d bool device tensor: an id outside [0, num_experts) or counts that are not the ids' histogram.
        Slot 0 counts the ids below 0, slot E + 1 those above E - 1 (both expected 0): eight small ops, on
        the path of every synced dispatch before its counts exchange, where the device waits for the host."""
        ids = topk_expert_ids_TK.reshape(-1)
        slots = (ids.clamp(-1, self.num_experts) + 1).to(torch.int64)
        seen = torch.zeros(self.num_experts + 2, dtype=torch.int64, device=ids.device).scatter_add_(
            0, slots, legs_constant((1,), ids.device).expand(ids.numel()))
        return (seen != torch.nn.functional.pad(counts.to(torch.int64), (1, 1))).any()

    def _dispatch_sync_free(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts):
        """Fixed capacity (:mod:`moe_quant.ep.capacity`): static sizes, nothing read on the host."""
        x_sorted, token_idx, scores_sorted, plans, receives, total_dropped = self._sync_free_plan(
            x_TD, topk_scores_TK, topk_expert_ids_TK, counts, [(0, self.num_local_experts)])
        (send_idx, send_valid, slot_of_row, slots, _), (src, valid, num_tokens_per_local_expert, blocks) = (
            plans[0], receives[0])
        route = capacity.CapacityRoute(group=self.group, wire=self.wire, mode=self.scale_mode,
                                       cast=self.experts_dtype, slots=slots,
                                       world=self.ep_size, send_idx=send_idx, send_valid=send_valid,
                                       slot_of_row=slot_of_row, src=src, valid=valid,
                                       slot_rows=capacity.slot_rows(src, valid),
                                       sent_rows=torch.where(send_valid, send_idx, slot_of_row.numel()),
                                       num_tokens_per_local_expert=num_tokens_per_local_expert, dropped=total_dropped,
                                       blocks=blocks)
        metadata = EPDispatchMetadata(token_indices_experts_sorted_N=token_idx,
                                      topk_scores_experts_sorted_N=scores_sorted, route=route)
        return capacity.dispatch_rows(x_sorted, route), num_tokens_per_local_expert, metadata

    def _sync_free_checks(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """The sync-free mode's argument checks and handshake."""
        # sync-free: peers read the host only in a handshake (the first dispatch on a group, until the
        # token bound is fixed): an argument error found then reaches every rank through it; later it
        # raises here only (dtypes and the shapes but T are the same on every rank of an SPMD
        # program; T may differ: the sizes come from the agreed token bound, not from T)
        try:
            self._check(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        except (TypeError, ValueError) as local_error:
            if self._handshake_due(-1) and not torch.compiler.is_compiling():
                device = x_TD.device if isinstance(x_TD, torch.Tensor) else torch.device("cpu")
                try:
                    self.handshake(device, tokens=-1, bad_args=True)  # raises on every rank
                except ValueError as group_error:  # peers raise this one; this rank its own error
                    raise local_error from group_error
            raise
        self.handshake(x_TD.device, tokens=x_TD.shape[0])

    def _sync_free_plan(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts, ranges):
        """The sync-free mode up to the token exchange, for ``ranges`` of local experts (each with its own
        slots): ``(x_sorted, token_idx, scores_sorted, plans, receives, total_dropped)``, per range
        ``plans[c] = (send_idx, send_valid, slot_of_row, slots, in_range)`` and ``receives[c] = (src, valid,
        num_tokens, blocks)``."""
        world, n_local = self.ep_size, self.num_local_experts
        bound = self.token_bound
        if bound is None:
            if torch.compiler.is_compiling():  # the same on every rank: nothing was exchanged yet
                raise ValueError(
                    "sync-free mode: the token bound is not fixed, and agreeing on it reads the host, which "
                    "cannot happen while tracing: pass max_tokens=..., or run one dispatch eagerly (or "
                    "handshake(device, tokens=T)) before torch.compile / CUDA graph capture")
            bound = 0  # every rank had T = 0 (the handshake saw it): nothing to send, bound still open
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK)
        rows = token_idx.shape[0]
        plans, kept, dropped = [], [], 0
        for r in ranges:
            slots = capacity.slots_per_rank(bound, self.top_k, world, n_local, self.capacity_factor, experts=r)
            send_idx, send_valid, slot_of_row, kept_r, dropped_r, in_range = capacity.plan_send(
                counts, rows, world, slots, experts=r)
            plans.append((send_idx, send_valid, slot_of_row, slots, in_range))
            kept.append(kept_r)
            dropped = dropped + dropped_r
        settings = self._settings(x_TD)
        msg, recv = self._token_count_exchange(counts, rows, settings, self._mismatch(topk_expert_ids_TK, counts),
                                               False, payload=torch.cat(kept, dim=1), extra=dropped.view(1))
        head = recv[:, n_local:n_local + agree.SIZE]
        bad = (head[:, 0] != 0).any() | (head[:, 1:] != msg[:1, n_local + 1:n_local + agree.SIZE]).any()
        total_dropped = recv[:, -1].sum() + bad.to(torch.int64)  # the same on every rank
        self._counter(x_TD.device).add_(total_dropped)
        receives = [capacity.plan_receive(recv[:, lo:hi], plan[3]) for (lo, hi), plan in zip(ranges, plans)]
        return x_sorted, token_idx, scores_sorted, plans, receives, total_dropped

    def _poisoned_if_dropped(self, scores_sorted: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """Sync-free combine: the routing scores the rows are weighted by, NaN where rows were dropped and
        ``overflow="error"`` (every combined row is then NaN, seen at the next host read: never a silently wrong
        step), else ``scores_sorted`` (the same values: the same bits of the output and every gradient). On the
        scores, ``T * top_k`` values, rather than on the combined rows: not a pass over ``(T * top_k, D)``."""
        if self.overflow == "error":
            return torch.where(dropped > 0, float("nan"), scores_sorted)
        return scores_sorted

    def _counter(self, device) -> torch.Tensor:
        """``dropped_rows`` on ``device`` (made on first use)."""
        device = torch.device(device)
        if self.dropped_rows is None or self.dropped_rows.device != device:
            self.dropped_rows = torch.zeros((), dtype=torch.int64, device=device)
        return self.dropped_rows

    def check_overflow(self) -> int:
        """Sync-free mode: read (one host sync) and reset the count of token copies that overflowed the
        capacity since the last call. ``overflow="error"``: raises a ``ValueError`` if any did (the steps
        since the last call produced NaN outputs); ``overflow="drop"``: returns the count. Every rank
        of the EP group holds the same count, so every rank raises together."""
        if self.dropped_rows is None:
            return 0
        n = int(self.dropped_rows.item())
        self.dropped_rows.zero_()
        if n and self.overflow == "error":
            raise ValueError(f"{n} token copies overflowed the EP receive capacity (capacity_factor="
                             f"{self.capacity_factor}, token bound {self.token_bound} per rank) or had invalid "
                             f"counts; the outputs of those steps are NaN. Raise capacity_factor (or max_tokens, "
                             f"if more tokens than the bound came), or pass overflow='drop' to drop them (counted)")
        return n

    def combine(self, routed_output, metadata: EPDispatchMetadata, x_TD, **_unused):
        """Send the expert outputs back, scale them by their routing scores and sum each token's rows.

        ``routed_output (M_recv, D)`` in the order :meth:`dispatch` returned; ``out_TD`` has ``x_TD``'s
        shape and dtype. (Keyword arguments of newer torchtitan signatures are accepted and ignored.)
        """
        if not isinstance(metadata, EPDispatchMetadata):
            raise TypeError(f"metadata must be the EPDispatchMetadata dispatch returned, got {type(metadata).__name__}")
        v.check_tensor("routed_output", routed_output, dtypes=_ACT_DTYPES, ndim=2)
        rows = metadata.token_indices_experts_sorted_N.shape[0] if metadata.route is None else \
            metadata.route.rows_received
        v.check_shape("routed_output", routed_output, (rows, x_TD.shape[1]), "(rows dispatch returned, D)")
        route = metadata.route
        scores = metadata.topk_scores_experts_sorted_N
        if isinstance(route, capacity.CapacityRoute):
            y = capacity.combine_rows(routed_output, route)
            scores = self._poisoned_if_dropped(scores, route.dropped)
        elif isinstance(route, blocks.BlockExchange):
            y = pipeline.gather(route, [pipeline.send_back(routed_output, route, 0)], routed_output)
        else:
            y = routed_output if route is None else combine_rows(routed_output, route)
        return unsort_tokens(y, scores, metadata.token_indices_experts_sorted_N, x_TD, scatter_add=self._scatter_add)


__all__ = ["MXFP8TokenDispatcher", "EPDispatchMetadata"]
