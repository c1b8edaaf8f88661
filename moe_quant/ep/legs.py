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
    sent: list  # sent[r][e]: rows to rank r for r's local expert e
    received: list  # received[r][e]: rows from rank r for this rank's local expert e


class HostRead:
    """Both count messages on their way to the host: on CUDA a copy into pinned memory and an event, so that
    the host waits for the counts alone (:meth:`rows`) while the device goes on with the work queued after
    them (the sort and the wire quantization); elsewhere (and while tracing) read when asked."""

    def __init__(self, msg: torch.Tensor, recv: torch.Tensor):
        both = torch.stack([msg, recv])
        self._event = None
        if both.device.type == "cuda" and not torch.compiler.is_compiling():
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            both = host
        self._both = both

    def rows(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._both.tolist()


def read_counts(msg: torch.Tensor, recv: torch.Tensor, rows: int, group, pending: HostRead | None = None) -> Counts:
    """The one host synchronization of the synced mode: reads both messages (``pending``: started earlier),
    raises the same error on every rank where any rank disagrees or reported a problem, returns the
    :class:`Counts`."""
    n_local = msg.shape[1] - agree.SIZE
    host = (pending or HostRead(msg, recv)).rows()
    sent, got = host[0], host[1]
    if torch.compiler.is_compiling():  # values are unbacked SymInts: checked when the graph runs
        return _check_traced(sent, got, n_local)
    message = agree.diagnose([row[n_local:] for row in got])
    if message is not None:
        raise ValueError(message)
    rank = dist.get_rank(group)
    bad = {r: got[r][n_local] for r in range(len(got)) if got[r][n_local]}
    if bad:
        if rank in bad:
            raise ValueError(f"num_local_tokens_per_expert_E on rank {rank} has {', '.join(agree.problems(bad[rank]))}: "
                             f"{[c for row in sent for c in row[:n_local]]} for {rows} routed rows")
        raise ValueError(f"num_local_tokens_per_expert_E is invalid on rank(s) {sorted(bad)} of the EP group "
                         f"(see the error raised there); no tokens were exchanged")
    return _counts(sent, got, n_local)


def _counts(sent: list, got: list, n_local: int) -> Counts:
    return Counts([sum(row[:n_local]) for row in sent], [sum(row[:n_local]) for row in got],
                  [row[:n_local] for row in sent], [row[:n_local] for row in got])


def _check_traced(sent: list, got: list, n_local: int) -> tuple:
    """:func:`read_counts` under ``torch.compile``: the same conditions as runtime asserts of the graph
    (every rank checks every rank's header, so all raise together; a ``RuntimeError`` naming the setting).
    Messages are bound as default arguments: dynamo in torch 2.11 cannot read a message lambda's closure."""
    mine = sent[0][n_local:]
    for r, row in enumerate(got):
        for i, field in enumerate(agree.FIELDS[1:], start=1):
            what = f"EP ranks disagree on {field} (rank {r} differs from this rank); no tokens were exchanged"
            torch._check(row[n_local + i] == mine[i], lambda what=what: what)
        what = f"EP rank {r} reported invalid dispatch arguments or counts; no tokens were exchanged"
        torch._check(row[n_local] == 0, lambda what=what: what)
    for row in sent + got:
        for c in row[:n_local]:
            torch._check(c >= 0)
    return _counts(sent, got, n_local)


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


def _send_mxfp8(x: torch.Tensor, route: Route, leg: str, quantized: tuple | None = None) -> torch.Tensor:
    """Quantize the rows of ``x`` 1x32 along the last dim (``quantized``: that quantization, made earlier),
    send them (splits of the forward direction), and return the received rows dequantized in expert-major
    order, registered as known MXFP8."""
    data, scales = quantized if quantized is not None else quantize_rows(x, route.mode, route.cast)
    data_r, scales_r = all_to_all_mxfp8(data, scales, route.output_splits, route.input_splits, route.group, leg)
    if backends.supports_scaled_grouped_mm(x.device):  # the scaled GEMM reads the fp8 data and scales too
        data_p, scales_p, _ = permute.permute_received(data_r, scales_r, route.recv_counts, out="plain")
        values = permute.dequantize_rows(data_p, scales_p, x.dtype)
        pq.remember(values, route.mode, data_p, scales_p)
    else:
        values, _ = permute.permute_received(data_r, scales_r, route.recv_counts, out="dequant", out_dtype=x.dtype)
        pq.remember(values, route.mode)
    return values


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
           "route_from_counts", "dispatch_rows", "combine_rows"]
