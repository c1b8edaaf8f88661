"""Sync-free expert parallelism: a fixed receive capacity per rank pair, static all-to-all sizes.

Each rank sends every peer exactly ``S`` row slots (``S = slots_per_rank(T_max, top_k, R, E_local,
capacity_factor)``), so every all-to-all has sizes known on the host before any device work: no
device-to-host synchronization in forward or backward, the same shapes every step (``torch.compile``
sees no data-dependent size, a CUDA graph can capture the step). A rank receives ``R * S`` rows, in
expert-major order first (the rows the grouped GEMM takes, ``num_tokens_per_local_expert`` summing to
the rows really received), zero rows after them.

``S`` must be the same on every rank of the group (each all-to-all pairs every rank's sends with its
peers' receives), so it comes from a token bound ``T_max`` every rank holds alike, never from this
rank's own T (ranks may have different T, e.g. a rank with none): the dispatcher's ``max_tokens``, or
else the largest T of the ranks at the first dispatch, agreed once in its handshake
(:meth:`moe_quant.ep.MXFP8TokenDispatcher.handshake`, the one host read). A dispatch with more tokens
than ``T_max`` on some rank keeps the same sizes: the copies past ``S`` overflow, as below.

The rows a rank sends to rank r are its sorted rows for r's experts, in order; those past the ``S``
slots overflow. Overflow is never silent: the number of overflowing token copies of the whole EP group
travels with the counts (every rank gets the same total, on the device) and is added to the
dispatcher's ``dropped_rows`` counter. With ``overflow="error"`` (default) the combined output of
every rank is NaN for that step, so the loss read at the next host read is NaN, and
:meth:`MXFP8TokenDispatcher.check_overflow` (a host read, call it where the step syncs anyway, e.g.
with the loss) raises a ``ValueError`` with the count. With ``overflow="drop"`` (explicit opt-in) the
overflowing copies contribute zero, like a capacity-factor MoE, and ``dropped_rows`` counts them.
Counts that are invalid on some rank (negative, wrong sum, not matching the ids) count as overflow of
all that rank's rows in either mode (nothing raises without a host read).

When nothing overflows, the outputs and gradients equal the synced mode's bit for bit: the same rows
are quantized the same way and reach the same experts in the same order.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .. import layouts
from ..numerics import ScaleMode
from .legs import Wire, expert_major_values
from .pipeline import PostsAhead
from .wire import (WireLog, all_to_all_mxfp8, all_to_all_rows, leg_range, quantize_rows, row_bytes_view,
                   row_words)

OVERFLOW = ("error", "drop")


def slots_per_rank(tokens: int, top_k: int, world: int, local_experts: int, capacity_factor: float,
                   experts: tuple[int, int] | None = None) -> int:
    """``S``: row slots a rank sends each peer for a token bound ``tokens`` (``T_max``, the same on every
    rank), ``ceil(capacity_factor * T_max * top_k / R)``, at most ``T_max * min(top_k, E_local)`` (every
    copy a peer can take; a factor ``>= R`` never overflows while no rank has more than ``T_max`` tokens).
    ``experts``: a range ``(lo, hi)`` of each peer's local experts (the chunked mode): its share,
    ``ceil(capacity_factor * T_max * top_k * (hi - lo) / (R * E_local))``, at most ``T_max * min(top_k,
    hi - lo)``; the whole range is the formula above."""
    lo, hi = experts or (0, local_experts)
    if (lo, hi) == (0, local_experts):
        s = math.ceil(capacity_factor * tokens * top_k / world)
    else:
        s = math.ceil(capacity_factor * tokens * top_k * (hi - lo) / (world * local_experts))
    return max(0, min(s, tokens * min(top_k, hi - lo)))


@dataclasses.dataclass(frozen=True, eq=False)
class CapacityRoute:
    group: object
    wire: Wire
    mode: ScaleMode
    slots: int  # S
    world: int
    send_idx: torch.Tensor  # (R*S,) sorted row in each send slot (0 where none)
    send_valid: torch.Tensor  # (R*S,) bool
    slot_of_row: torch.Tensor  # (N,) send slot of each sorted row, R*S where it overflows
    src: torch.Tensor  # (R*S,) received slot of each expert-major row (0 where none)
    valid: torch.Tensor  # (R*S,) bool: expert-major row t holds a received row
    slot_rows: torch.Tensor  # (R*S,) expert-major row of each received slot, R*S where none (slot_rows(src, valid))
    sent_rows: torch.Tensor  # (R*S,) sorted row of each send slot, N where none (send_idx where send_valid)
    num_tokens_per_local_expert: torch.Tensor  # (E_local,) int32
    dropped: torch.Tensor  # 0-d int64: token copies of the whole group past capacity (or invalid)
    blocks: torch.Tensor  # (R, E_local + 1) int32: the received slots as blocks (plan_receive)
    cast: torch.dtype | None = None  # the MXFP8 legs quantize the rows' rounding to it (wire.quantize_rows)

    @property
    def rows_received(self) -> int:
        return self.world * self.slots


def _kept(counts_re: torch.Tensor, slots: int) -> torch.Tensor:
    """Rows of each (peer, expert) block that fit the peer's ``slots`` (first come, expert order)."""
    ends = torch.cumsum(counts_re.clamp(min=0), 1).clamp(max=slots)
    return torch.diff(ends, dim=1, prepend=ends.new_zeros(ends.shape[0], 1))


def plan_send(counts: torch.Tensor, rows: int, world: int, slots: int, experts: tuple[int, int] | None = None):
    """Sender side: ``(send_idx, send_valid, slot_of_row, kept (R, E), dropped, in_range (N,))`` from this
    rank's ``counts (E,)`` (sanitized: negative counts are 0, the running total is clamped to ``rows``).
    ``experts``: a range ``(lo, hi)`` of each peer's local experts (default all): only the rows for those
    are placed in the slots (``kept`` is ``(R, hi - lo)``, ``in_range`` marks them among the sorted rows)."""
    dev = counts.device
    c = counts.to(torch.int64).view(world, -1)
    n_local = c.shape[1]
    lo, hi = experts or (0, n_local)
    flat_ends = layouts.sanitize_offsets(torch.cumsum(c.clamp(min=0).reshape(-1), 0), rows)
    ends = flat_ends.view(world, -1)
    block_starts = torch.cat([flat_ends.new_zeros(1), flat_ends[:-1]]).view(world, -1)
    seg_starts, seg_ends = block_starts[:, lo].contiguous(), ends[:, hi - 1].contiguous()
    n = seg_ends - seg_starts
    kept_r = n.clamp(max=slots)
    j = torch.arange(slots, device=dev)
    send_idx = (seg_starts.unsqueeze(1) + j).reshape(-1)
    send_valid = (j < kept_r.unsqueeze(1)).reshape(-1)
    i = torch.arange(rows, device=dev)
    b = layouts.group_of(i, flat_ends).clamp(max=max(flat_ends.numel() - 1, 0))  # (peer, expert) block of row i
    r_i, e_i = b // n_local, b % n_local
    in_range = (i < flat_ends[-1]) & (e_i >= lo) & (e_i < hi) if flat_ends.numel() else i < 0
    j_i = i - seg_starts[r_i]
    inside = in_range & (j_i < slots)
    slot_of_row = torch.where(inside, r_i * slots + j_i, world * slots)
    sizes = torch.diff(flat_ends, prepend=flat_ends.new_zeros(1)).view(world, -1)[:, lo:hi]
    return (torch.where(send_valid, send_idx, 0), send_valid, slot_of_row, _kept(sizes, slots), (n - kept_r).sum(),
            in_range)


def plan_receive(kept: torch.Tensor, slots: int):
    """Receiver side: ``(src, valid, num_tokens_per_local_expert, blocks)`` from ``kept (R, E_local)``, the rows
    each peer sent for each local expert (each peer's block starts at slot ``r * S``). ``blocks (R, E_local + 1)``
    int32: the received slots as the permute kernel's (source rank, expert) blocks, each peer's unused slots a
    last block: expert-major, that padding group lands past the real rows (:func:`_received_values`)."""
    world, n_local = kept.shape
    total = world * slots
    blocks = torch.cat([kept, slots - kept.sum(1, keepdim=True)], 1).to(torch.int32)
    within = torch.cumsum(kept, 1) - kept  # offset of block (r, e) inside peer r's slots
    sizes_er = kept.t().reshape(-1)  # expert-major blocks (e, r)
    dst_ends = torch.cumsum(sizes_er, 0)
    dst_starts = dst_ends - sizes_er
    t = torch.arange(total, device=kept.device)
    if sizes_er.numel() == 0:
        return t * 0, t < 0, kept.new_zeros(n_local).to(torch.int32), blocks
    b = layouts.group_of(t, dst_ends).clamp(max=sizes_er.numel() - 1)
    valid = t < dst_ends[-1]
    r, e = b % world, b // world
    src = torch.where(valid, r * slots + within[r, e] + t - dst_starts[b], 0)
    return src, valid, kept.sum(0).to(torch.int32), blocks


def _gather(x: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:  # a rank without tokens still fills its slots (with zeros)
        return x.new_zeros(idx.shape[0], *x.shape[1:])
    # as whole words (wire.row_words): the mask, broadcast along the row, runs in PyTorch's non-vectorized
    # elementwise kernel, a thread per element
    return torch.where(keep.unsqueeze(1), row_words(x)[idx], 0).view(x.dtype)


def _scatter(x: torch.Tensor, dest: torch.Tensor, keep: torch.Tensor | None, size: int) -> torch.Tensor:
    """``out (size, D)``, zero but for ``out[dest[i]] = x[i]`` where ``keep[i]`` (``keep=None``: ``dest`` already
    holds ``size`` for the rows to leave out). A zero fill and one copy: where the inverse map is at hand this
    replaces :func:`_gather`'s gather and mask, whose mask, broadcast along D, runs in PyTorch's non-vectorized
    elementwise kernel (12 such passes took 5.2 ms of a 36.7 ms sync-free step on 2 H200s, 2026-11-29)."""
    raw = row_words(x)  # rows copied by whole words (wire.row_words), not one element a thread
    out = raw.new_zeros(size + 1, *raw.shape[1:])
    index = dest if keep is None else torch.where(keep, dest, size)
    return out.index_copy_(0, index, raw)[:size].view(x.dtype)


def slot_rows(src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The inverse of a receiver's ``src`` over ``valid``: for each received slot, the expert-major row it
    becomes, ``len(src)`` where none."""
    total = src.numel()
    slots = torch.full((total + 1,), total, dtype=torch.int64, device=src.device)
    return slots.index_copy_(0, torch.where(valid, src, total), torch.arange(total, device=src.device))[:total]


def _received_values(data_r: torch.Tensor, scales_r: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype,
                     mode: ScaleMode) -> torch.Tensor:
    """The received MXFP8 slots (each peer's ``S``: its rows expert by expert, then its unused slots, which the
    sender left zero) dequantized in expert-major order, registered for the GEMMs: one permute pass
    (:func:`moe_quant.ep.legs.expert_major_values`) with ``blocks`` (:func:`plan_receive`), whose last block per
    peer, the padding, lands past the real rows as zeros, every byte what the gather of the received rows gives
    (and the former three passes: two copies through ``slot_rows`` and a dequantization)."""
    return expert_major_values(data_r, scales_r, blocks, dtype, mode)


def _forward_leg(x_sorted: torch.Tensor, route: CapacityRoute, leg: str) -> torch.Tensor:
    """Sorted rows -> slots -> all-to-all -> expert-major rows (MXFP8 on that wire)."""
    s, total, rows = [route.slots] * route.world, route.rows_received, route.slot_rows
    if route.wire is Wire.MXFP8:
        data, scales = quantize_rows(x_sorted, route.mode, route.cast)
        data_s = _scatter(data, route.slot_of_row, None, total)
        scales_s = _scatter(scales.view(torch.uint8), route.slot_of_row, None, total)
        data_r, scales_r = all_to_all_mxfp8(data_s, scales_s, s, s, route.group, leg)
        return _received_values(data_r, scales_r, route.blocks, x_sorted.dtype, route.mode)
    recv = all_to_all_rows(_scatter(x_sorted, route.slot_of_row, None, total), s, s, route.group, leg)
    return _scatter(recv, rows, None, total)


def _backward_leg(y: torch.Tensor, route: CapacityRoute, leg: str) -> torch.Tensor:
    """Expert-major rows -> received slots -> all-to-all back -> sorted rows (overflowing rows zero)."""
    s = [route.slots] * route.world
    back = all_to_all_rows(_scatter(y.contiguous(), route.src, route.valid, route.rows_received), s, s,
                           route.group, leg)
    return _scatter(back, route.sent_rows, None, route.slot_of_row.numel())


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sorted, route):
        ctx.route = route
        return _forward_leg(x_sorted, route, "dispatch")

    @staticmethod
    def backward(ctx, grad):
        return _backward_leg(grad, ctx.route, "dispatch backward"), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, route):
        ctx.route = route
        return _backward_leg(y, route, "combine")

    @staticmethod
    def backward(ctx, grad):
        return _forward_leg(grad.contiguous(), ctx.route, "combine backward"), None


class SlotExchange(PostsAhead):
    """The sync-free mode in ranges of local experts, for :mod:`moe_quant.ep.pipeline` (``chunks`` > 1,
    eager): range c has its own ``S_c`` slots per peer (``plans[c]``, ``receives[c]``: the sender's and the
    receiver's plans of :func:`plan_send` / :func:`plan_receive` for that range), and each leg of each
    range is one ``all_to_all_single`` of static size, posted asynchronously (``async_op``: the wait is a
    stream wait). The rows of every leg are those of :func:`dispatch_rows` / :func:`combine_rows` for
    that range; a sorted row overflowing its range's slots contributes zero, counted like any overflow."""

    def __init__(self, group, *, wire: Wire, mode: ScaleMode, world: int, ranges: list, plans: list,
                 receives: list, rows: int, cast: torch.dtype | None = None):
        self.group, self.wire, self.mode, self.world, self.cast = group, wire, mode, world, cast
        self.ranges, self.plans, self.receives, self.rows = ranges, plans, receives, rows
        self._posted: dict = {}  # (leg, range) -> [(work, sent buffer, receive buffer)] (MXFP8: data, scales)
        self._issued: set = set()
        self._queued: dict = {}  # leg -> its ranges not yet posted towards the experts (PostsAhead)
        self._dtypes: dict = {}  # leg -> (dtype, D) of its rows

    def counts_of(self, c: int) -> torch.Tensor:
        return self.receives[c][2]

    def _slots(self, c: int) -> int:
        return self.world * self.plans[c][3]

    def _post(self, leg: str, c: int, *bufs: torch.Tensor) -> None:
        """Post one asynchronous exchange of each buffer (MXFP8: the data, then the scales), recorded as one leg."""
        bufs = [row_bytes_view(b.contiguous()) for b in bufs]
        WireLog.record_rows(leg, bufs[0].shape[0], sum(b.numel() for b in bufs))
        posted = []
        with leg_range(leg):
            for buf in bufs:
                out = torch.empty_like(buf)
                posted.append((dist.all_to_all_single(out, buf, group=self.group, async_op=True), buf, out))
        self._posted[(leg, c)] = posted

    def _wait(self, leg: str, c: int) -> list[torch.Tensor]:
        outs = []
        for work, _, out in self._posted.pop((leg, c)):
            work.wait()
            outs.append(out)
        return outs

    def to_experts(self, leg: str, rows: torch.Tensor, order, quantized: tuple | None = None) -> None:
        rows = rows.contiguous()
        self._dtypes[leg] = (rows.dtype, rows.shape[1])
        parts = [rows]
        if self.wire is Wire.MXFP8:
            data, scales = quantized if quantized is not None else quantize_rows(rows, self.mode, self.cast)
            parts = [data, scales.view(torch.uint8)]
        self._queue(leg, order, lambda c: self._post(leg, c, *(_gather(p, *self.plans[c][:2]) for p in parts)))

    def arrived(self, leg: str, c: int) -> torch.Tensor:
        self._post_ahead(leg, c)
        outs = self._wait(leg, c)
        dtype, d = self._dtypes[leg]
        src, valid, _, blocks = self.receives[c]
        if self.wire is not Wire.MXFP8:
            return _gather(outs[0].view(dtype).reshape(outs[0].shape[0], d), src, valid)
        return _received_values(outs[0].view(torch.float8_e4m3fn), outs[1], blocks, dtype, self.mode)

    def from_experts(self, leg: str, c: int, rows: torch.Tensor) -> None:
        src, valid, *_ = self.receives[c]
        self._issued.add((leg, c))
        self._dtypes[leg] = (rows.dtype, rows.shape[1])
        self._post(leg, c, _scatter(rows.contiguous(), src, valid, self._slots(c)))

    def returned(self, leg: str, like: torch.Tensor) -> torch.Tensor:
        self._post_queued()
        for c in range(len(self.ranges)):
            if (leg, c) not in self._issued:  # never posted: zeros, so that peers never wait for it
                self.from_experts(leg, c, like.new_zeros(self._slots(c), like.shape[1]))
        dtype, d = self._dtypes[leg]
        out = row_words(torch.zeros(self.rows, d, dtype=dtype, device=like.device))  # selected by whole words
        for c in range(len(self.ranges)):
            back = self._wait(leg, c)[0].view(dtype).reshape(-1, d)
            slot_of_row, in_range = self.plans[c][2], self.plans[c][4]
            inside = slot_of_row < self._slots(c)
            rows = _gather(back, torch.where(inside, slot_of_row, 0), inside).view(out.dtype)
            out = torch.where(in_range.unsqueeze(1), rows, out)
        return out.view(dtype)


def dispatch_rows(x_sorted: torch.Tensor, route: CapacityRoute) -> torch.Tensor:
    """``(R*S, D)``: the received rows expert-major, then zeros; differentiable."""
    return _Dispatch.apply(x_sorted, route)


def combine_rows(y: torch.Tensor, route: CapacityRoute) -> torch.Tensor:
    """``(N, D)``: this rank's sorted rows back from the experts (zero where they overflowed)."""
    return _Combine.apply(y, route)


__all__ = ["CapacityRoute", "SlotExchange", "OVERFLOW", "slots_per_rank", "plan_send", "plan_receive", "dispatch_rows",
           "combine_rows"]
