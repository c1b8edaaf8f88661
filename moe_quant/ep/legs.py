"""The four all-to-all legs of expert parallelism, as differentiable functions over a process group.

=====================  ==================================  =============================================
leg                    sends                               numerics
=====================  ==================================  =============================================
dispatch (forward)     MXFP8 (``wire="mxfp8"``): K e4m3 +   tokens quantized 1x32 along the hidden dim
                       K/32 e8m0 bytes per token            before sending; the receiver dequantizes
                                                            (exact) and the expert GEMM reuses that form
combine (forward)      the expert outputs' dtype (bf16)     exact
combine backward       MXFP8 (``wire="mxfp8"``)             grad of the expert output, 1x32 along N:
                                                            exactly dgrad's operand, reused by it
dispatch backward      the activations' dtype (bf16)        exact
=====================  ==================================  =============================================

With ``wire="bf16"`` every leg sends the tensor's own dtype (the bf16 baseline). The rows a rank
receives come in (source rank, local expert) order; :func:`moe_quant.ep.permute.permute_received`
(MXFP8 legs) or one gather (others) puts them in expert-major order, and the reverse legs undo it.

Host synchronization: one, in :func:`read_counts` (the split sizes ``all_to_all_single`` needs); the
dispatcher starts it (:class:`HostRead`) before it sorts and quantizes the rows, so the host waits for the
counts while the device goes on with that work.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import backends
from ..choices import Choice
from .. import prequantized as pq
from ..numerics import ScaleMode
from . import agree, permute
from .wire import all_to_all_mxfp8, all_to_all_rows, quantize_rows, row_words


class Wire(Choice):
    MXFP8 = "mxfp8"  # dispatch forward and combine backward in MXFP8
    BF16 = "bf16"  # every leg in the tensors' own dtype
    __argname__ = "wire"


@dataclasses.dataclass(frozen=True, eq=False)
class Route:
    """Where this rank's sorted rows go and what it receives; built by :func:`plan_route`."""

    group: object
    wire: Wire
    mode: ScaleMode
    input_splits: list  # rows sent to each rank
    output_splits: list  # rows received from each rank
    recv_counts: torch.Tensor  # (R, E_local) int32: rows from rank r for local expert e
    num_tokens_per_local_expert: torch.Tensor  # (E_local,) int32
    cast: torch.dtype | None = None  # the MXFP8 legs quantize the rows' rounding to it (wire.quantize_rows)
    _src: torch.Tensor | None = None  # src, once made

    @property
    def rows_received(self) -> int:
        return sum(self.output_splits)

    @property
    def src(self) -> torch.Tensor:
        """``(M_recv,)`` int64: expert-major row j is received row ``src[j]``; made on first use. About 30 small
        index ops whose cost is the host's: made before the dispatch exchange, they kept the device idle
        between the counts and the tokens (a profiled step on 2 H200s, 2026-11-29). Made here, the bf16
        dispatch makes them after queueing its exchange, and the MXFP8 dispatch, whose permute kernel reads
        the counts, only in the combine, behind the experts' GEMMs."""
        if self._src is None:
            object.__setattr__(self, "_src", permute._source_rows(self.recv_counts, self.rows_received)[0])
        return self._src


_CONSTANTS: dict = {}


def constant(values: tuple, device) -> torch.Tensor:
    """An int64 device tensor of ``values``, made once (no host-to-device copy in later steps: CUDA graphs);
    traced, a constant of the graph."""
    return backends.cached_unless_tracing(_CONSTANTS, (values, str(device)), True,
                                          lambda: torch.tensor(values, dtype=torch.int64).to(device))


def exchange_counts(num_local_tokens_per_expert_E: torch.Tensor, rows: int, group, *, settings: list,
                    mismatch: torch.Tensor | None = None, bad_args: bool = False,
                    payload: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> tuple:
    """The token-count exchange: one small all-to-all of this rank's counts and its :mod:`.agree` header.

    Returns ``(sent, received)`` int64 ``(R, E_local + agree.SIZE [+ len(extra)])`` device tensors;
    nothing is read on the host. ``bad_args``: this rank's own arguments are invalid (it sends zero
    counts and the flag). ``payload (R, E_local)``: sent in place of the counts (the problem code is
    still the counts'); ``extra``: int64 values appended to every peer's row.
    """
    world = dist.get_world_size(group)
    send = num_local_tokens_per_expert_E.to(torch.int64).view(world, -1)
    if bad_args:
        code = constant((agree.BAD_ARGS,), send.device)
    else:  # the problem bits as one dot product (few ops: the device waits for the host here)
        flags = [(send < 0).any(), send.sum() != rows] + ([mismatch] if mismatch is not None else [])
        bits = constant((agree.NEGATIVE, agree.BAD_SUM, agree.MISMATCH)[:len(flags)], send.device)
        code = (torch.stack(flags).to(torch.int64) * bits).sum().view(1)
    head = torch.cat([code, constant(tuple(settings[1:]), send.device)])
    if extra is not None:
        head = torch.cat([head, extra.to(torch.int64).view(-1)])
    if payload is not None:
        send = payload.to(torch.int64).view(world, -1)
    msg = torch.cat([send, head.expand(world, head.numel())], dim=1).contiguous()
    recv = all_to_all_rows(msg, [1] * world, [1] * world, group, "counts")
    return msg, recv


@dataclasses.dataclass(frozen=True)
class Counts:
    """What the one host read of the synced mode gives: the split sizes and every block's size."""

    input_splits: list  # rows this rank sends to each rank
    output_splits: list  # rows it receives from each rank
    sent: list | None  # sent[r][e]: rows to rank r for r's local expert e (None where traced)
    received: list | None  # received[r][e]: rows from rank r for this rank's local expert e (None where traced)


class HostRead:
    """Both count messages on their way to the host, started right after the counts exchange: on CUDA a copy
    into pinned memory and an event, so that the host waits for the counts alone (:meth:`rows`) while the device
    goes on with the work queued after them (the sort and the wire quantization); elsewhere read when asked.
    While tracing (``torch.compile``) the graph's one copy to the host, a blocking one (a graph has no event to
    wait on): the host waits for the counts exchange, then queues the sort, whose kernels run while the host
    checks the copy (:func:`read_counts`)."""

    def __init__(self, msg: torch.Tensor, recv: torch.Tensor):
        self._event = None
        both = torch.stack([msg, recv])
        if torch.compiler.is_compiling():
            both = both.to("cpu")
        elif both.device.type == "cuda":
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            both = host
        self._both = both

    @property
    def host(self) -> torch.Tensor:
        """Both messages on the host, ``(2, R, C)`` (copied while tracing; eager: :meth:`rows`)."""
        return self._both

    def rows(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._both.tolist()


def read_counts(msg: torch.Tensor, recv: torch.Tensor, rows: int, group, pending: HostRead | None = None) -> Counts:
    """The one host synchronization of the synced mode: reads both messages (``pending``: started earlier),
    raises the same error on every rank where any rank disagrees or reported a problem, returns the
    :class:`Counts`. Traced (``torch.compile``): one device-to-host copy of both messages, checked on the host
    by an op of the graph (:func:`_read_traced`)."""
    n_local = msg.shape[1] - agree.SIZE
    rank = dist.get_rank(group)
    pending = pending or HostRead(msg, recv)
    if torch.compiler.is_compiling():
        return _read_traced(pending.host, rows, rank)
    host = pending.rows()
    sent, got = host[0], host[1]
    _raise_problems(sent, got, n_local, rows, rank)
    return _counts(sent, got, n_local)


def _raise_problems(sent: list, got: list, n_local: int, rows: int, rank: int) -> None:
    """The same ``ValueError`` on every rank where any rank disagrees on a setting or reported a problem;
    ``sent`` / ``got``: the two messages read on the host."""
    message = agree.diagnose([row[n_local:] for row in got])
    if message is not None:
        raise ValueError(message)
    bad = {r: got[r][n_local] for r in range(len(got)) if got[r][n_local]}
    if bad:
        if rank in bad:
            raise ValueError(f"num_local_tokens_per_expert_E on rank {rank} has "
                             f"{', '.join(agree.problems(bad[rank]))}: "
                             f"{[c for row in sent for c in row[:n_local]]} for {rows} routed rows")
        raise ValueError(f"num_local_tokens_per_expert_E is invalid on rank(s) {sorted(bad)} of the EP group "
                         f"(see the error raised there); no tokens were exchanged")


def _counts(sent: list, got: list, n_local: int) -> Counts:
    return Counts([sum(row[:n_local]) for row in sent], [sum(row[:n_local]) for row in got],
                  [row[:n_local] for row in sent], [row[:n_local] for row in got])


@torch.library.custom_op("moe_quant::ep_checked_splits", mutates_args=())
def _checked_splits_op(host: torch.Tensor, rows: int, rank: int) -> torch.Tensor:
    """:func:`read_counts`' checks inside a compiled graph, on the host copy ``host (2, R, C)`` of both messages
    (raises the eager mode's ``ValueError``); returns the split sizes ``(2, R)`` int64 (sent, received)."""
    sent, got = host.tolist()
    n_local = host.shape[2] - agree.SIZE
    _raise_problems(sent, got, n_local, rows, rank)
    counts = _counts(sent, got, n_local)
    return torch.tensor([counts.input_splits, counts.output_splits], dtype=torch.int64)


@_checked_splits_op.register_fake
def _(host, rows, rank):
    return host.new_empty((2, host.shape[1]))


def _read_traced(host: torch.Tensor, rows: int, rank: int) -> Counts:
    """:func:`read_counts` under ``torch.compile``: both messages reached the host in one copy
    (:class:`HostRead`: on CUDA the one synchronization, as in eager), an op of the graph checks them there
    (every rank raises the eager mode's ``ValueError`` where any rank disagrees or reported a problem) and sums
    each rank's counts; only the ``2 R`` split sizes become values of the graph (unbacked SymInts), read from
    that host tensor. The per-block counts stay on the device (the point-to-point transport, which needs them on
    the host, runs eager)."""
    input_splits, output_splits = torch.ops.moe_quant.ep_checked_splits(host, rows, rank).tolist()
    for s in input_splits + output_splits:
        torch._check(s >= 0)
    return Counts(input_splits, output_splits, None, None)


def received_counts(recv: torch.Tensor) -> torch.Tensor:
    """``(R, E_local)`` int32 device counts of the received rows, from the counts message."""
    return recv[:, :recv.shape[1] - agree.SIZE].to(torch.int32)


def route_from_counts(recv: torch.Tensor, counts: Counts, group, *, wire: Wire, mode: ScaleMode,
                      cast: torch.dtype | None = None) -> Route:
    """The :class:`Route` of the counts read on the host (checked there: no negative count, each rank's sum its
    rows, so the received counts sum to ``sum(output_splits)`` and each expert's total is their column sum).
    ``src`` waits for its first use, except while tracing (made here, inside the graph)."""
    recv_counts = received_counts(recv)
    rows = sum(counts.output_splits)
    traced = torch.compiler.is_compiling()  # no attribute set on a traced object: made here, in the graph
    return Route(group=group, wire=wire, mode=mode, cast=cast, input_splits=counts.input_splits,
                 output_splits=counts.output_splits, recv_counts=recv_counts,
                 num_tokens_per_local_expert=recv_counts.sum(0, dtype=torch.int32),
                 _src=permute._source_rows(recv_counts, rows)[0] if traced else None)


def plan_route(num_local_tokens_per_expert_E: torch.Tensor, rows: int, group, *, wire: Wire, mode: ScaleMode,
               mismatch: torch.Tensor | None = None, settings: list | None = None) -> Route:
    """Exchange the per-expert counts (one small all-to-all) and read the split sizes (one host sync).

    ``num_local_tokens_per_expert_E (E,)``: rows this rank sends to each global expert (experts are laid
    out rank-major: rank r holds experts ``[r * E_local, (r+1) * E_local)``); ``rows``: the number of sorted
    rows it sends; ``mismatch``: an optional 0-d bool device tensor, True where the caller found the counts
    inconsistent with the routing; ``settings``: the :func:`.agree.header` of the call (default: only
    num_experts, wire and scale mode). Every rank sends a problem code and its settings with its counts,
    so a bad value or a disagreement on one rank raises the same ``ValueError`` on all of them (naming
    the ranks) instead of leaving peers waiting or exchanging garbage.
    """
    if settings is None:
        settings = agree.header(hidden=0, num_experts=num_local_tokens_per_expert_E.numel(), top_k=0,
                                dtype=None, wire=wire, mode=mode)
    msg, recv = exchange_counts(num_local_tokens_per_expert_E, rows, group, settings=settings, mismatch=mismatch)
    return route_from_counts(recv, read_counts(msg, recv, rows, group), group, wire=wire, mode=mode)


def _expert_major(rows_received: torch.Tensor, route: Route) -> torch.Tensor:
    return rows_received[route.src]


def _received_order(rows_expert_major: torch.Tensor, route: Route) -> torch.Tensor:
    # the counts were checked in plan_route, so src is a permutation of the received rows; copied by whole words
    # (wire.row_words)
    w = row_words(rows_expert_major)
    return torch.empty_like(w).index_copy_(0, route.src, w).view(rows_expert_major.dtype)


def expert_major_values(data_r: torch.Tensor, scales_r: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype,
                        mode: ScaleMode) -> torch.Tensor:
    """Received MXFP8 rows (``counts (R, E)``: blocks in (source rank, expert) order) dequantized in expert-major
    order as ``dtype``, registered as known MXFP8 for the GEMMs: one pass of the permute kernel (the scaled GEMM,
    which reads the fp8 data and scales too: their expert-major copy, then the dequantization)."""
    if backends.supports_scaled_grouped_mm(data_r.device):
        data_p, scales_p, _ = permute.permute_received(data_r, scales_r, counts, out="plain")
        values = permute.dequantize_rows(data_p, scales_p, dtype)
        pq.remember(values, mode, data_p, scales_p)
    else:
        values, _ = permute.permute_received(data_r, scales_r, counts, out="dequant", out_dtype=dtype)
        pq.remember(values, mode)
    return values


def _send_mxfp8(x: torch.Tensor, route: Route, leg: str, quantized: tuple | None = None) -> torch.Tensor:
    """Quantize the rows of ``x`` 1x32 along the last dim (``quantized``: that quantization, made earlier),
    send them (splits of the forward direction), and return the received rows dequantized in expert-major
    order, registered as known MXFP8."""
    data, scales = quantized if quantized is not None else quantize_rows(x, route.mode, route.cast)
    data_r, scales_r = all_to_all_mxfp8(data, scales, route.output_splits, route.input_splits, route.group, leg)
    return expert_major_values(data_r, scales_r, route.recv_counts, x.dtype, route.mode)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sorted: torch.Tensor, route: Route, quantized: tuple | None = None):
        ctx.route = route
        if route.wire is Wire.MXFP8:
            return _send_mxfp8(x_sorted, route, "dispatch", quantized)
        recv = all_to_all_rows(x_sorted, route.output_splits, route.input_splits, route.group, "dispatch")
        return _expert_major(recv, route)

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        g = _received_order(grad.contiguous(), route)
        return all_to_all_rows(g, route.input_splits, route.output_splits, route.group, "dispatch backward"), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_expert_major: torch.Tensor, route: Route):
        ctx.route = route
        y = _received_order(y_expert_major.contiguous(), route)
        return all_to_all_rows(y, route.input_splits, route.output_splits, route.group, "combine")

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        grad = grad.contiguous()
        if route.wire is Wire.MXFP8:
            return _send_mxfp8(grad, route, "combine backward"), None
        recv = all_to_all_rows(grad, route.output_splits, route.input_splits, route.group, "combine backward")
        return _expert_major(recv, route), None


def dispatch_rows(x_sorted: torch.Tensor, route: Route, quantized: tuple | None = None) -> torch.Tensor:
    """Send this rank's rows (sorted by global expert) to the experts' ranks; returns the received rows in
    expert-major order ``(M_recv, D)``, differentiable (the backward sends the gradient back).
    ``quantized``: ``quantize_rowwise(x_sorted, route.mode)``, made earlier (MXFP8 wire)."""
    return _Dispatch.apply(x_sorted, route, quantized)


def combine_rows(y_expert_major: torch.Tensor, route: Route) -> torch.Tensor:
    """Send the expert outputs back to the ranks their tokens came from; returns this rank's rows in its
    sorted order ``(S, D)``, differentiable (the backward sends the output gradient, MXFP8 on that wire)."""
    return _Combine.apply(y_expert_major, route)


__all__ = ["Wire", "Route", "Counts", "HostRead", "plan_route", "exchange_counts", "read_counts", "received_counts",
           "route_from_counts", "dispatch_rows", "combine_rows", "expert_major_values"]
