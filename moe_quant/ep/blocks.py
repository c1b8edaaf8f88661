"""The point-to-point transport of expert parallelism: every (peer, expert) block of rows goes straight from
where it is to where it is used, and the exchange can run in chunks of local experts that overlap the experts.

The all-to-all transport (:mod:`moe_quant.ep.legs`) hands ``all_to_all_single`` whole buffers per leg (MXFP8:
the data and the scales, two exchanges), in (source rank, local expert) order: the received rows are
permuted into expert-major order (a permutation pass), and the expert outputs permuted back before the
combine. Here the synced mode knows every block's size on the
host (the one host read of the counts), so each leg is one batch of point-to-point sends and receives
(``torch.distributed.batch_isend_irecv``, one NCCL group) whose slices are already in place:

* dispatch: block (peer r, local expert e) of this rank's rows, sorted by global expert, is a contiguous
  slice; it lands in the receiver's expert-major buffer at (expert e, source rank) -- the order the grouped
  GEMM takes. MXFP8 sends the quantized data and the plain scales as two slices of two buffers (no packing);
  the receiver dequantizes once (the permute kernel with one block, where it serves) and registers the
  fp8 data and scales (:mod:`moe_quant.prequantized`), so the GEMMs reuse them.
* combine: the expert outputs go from the experts' expert-major rows straight into the sender's sorted rows.
* backward: the same blocks the other way (combine backward in MXFP8 on that wire, dispatch backward exact).

Rows to this rank itself are copied locally. Every rank posts the same legs in the same order (the blocks
of a pair agree on their sizes: what rank a sends to rank b for expert e is what b receives from a for e).

Chunks. With ``chunks = C`` the local experts are split into C contiguous ranges; each leg posts one batch
per range, one range ahead of the experts (:class:`moe_quant.ep.pipeline.PostsAhead`; their transfers queue
on the communication stream), and the caller runs the experts of range c as soon as range c has arrived
(:meth:`BlockExchange.arrived` waits on the stream, not the host), while the later ranges travel; each
range's combine is posted when its experts are done, so it travels while the next range computes. In
backward the combine-backward batches are posted the same way (latest range first, the order autograd runs
the ranges in), and each range's dispatch backward is posted when its experts' backward is done. Every expert
sees exactly the rows it sees unchunked, in the same order (a range's rows are a contiguous slice of the
expert-major buffer), and the combine writes every row to the same place, so outputs and every gradient
(weights included) are bit-identical for any C.

Posting forms (:data:`POSTINGS`, :func:`posting`; a candidate for measurement, the default first). ``"per_block"``:
one send and one receive per (peer, local expert, tensor) block, straight between the sorted rows and the
expert-major rows (R·E_c·T ops per range). ``"merged"``: one per (peer, tensor) per range: a peer's rows for the
range's experts are contiguous in the sorted order, and arrive in a staging buffer in (source rank, expert) order;
MXFP8 rows go to expert-major order in the permute kernel's pass that dequantizes them (the pass the per-block
form spends on dequantizing alone), bf16 rows in one concatenation; going back, the expert-major rows are first
concatenated into (rank, expert) order. Fewer, larger messages and fewer host calls per post, for one more
copy of the bf16 legs. Same bits either way.

One :class:`BlockExchange` per dispatch holds the buffers and the pending work of its four legs; the
autograd functions of :mod:`moe_quant.ep.pipeline` drive it, so that autograd orders the waits and posts
as above. Eager only: under ``torch.compile`` the dispatcher uses the all-to-all transport (the same bits).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import backends
from .. import prequantized as pq
from ..numerics import ScaleMode
from .legs import Wire
from .permute import dequantize_rows, permute_received
from .pipeline import PostsAhead
from .wire import WireLog, leg_range, quantize_rows, row_bytes_view

_LEGS = ("dispatch", "combine", "combine backward", "dispatch backward")
POSTINGS = ("per_block", "merged")  # how a range is posted (module doc); the default first


class BlockExchange(PostsAhead):
    """The blocks of one dispatch and the state of its four legs (see the module doc).

    ``sent[r][e]``: rows this rank sends to rank r for r's local expert e (its rows sorted by global
    expert: block (r, e) starts at ``send_start[r][e]``); ``recv[r][e]``: rows it receives from rank r
    for its own local expert e (expert-major: block (e, r) starts at ``recv_start[r][e]``).
    ``num_tokens_per_local_expert``: the same counts as an (E_local,) int32 device tensor; ``ranges``: the
    ranges ``(lo, hi)`` of local experts (:func:`moe_quant.ep.pipeline.expert_ranges`).
    """

    posting = POSTINGS[0]  # the form of the next exchanges made (:func:`posting`)

    def __init__(self, group, *, wire: Wire, mode: ScaleMode, sent: list, recv: list,
                 num_tokens_per_local_expert: torch.Tensor, ranges: list, recv_counts: torch.Tensor | None = None,
                 cast: torch.dtype | None = None):
        self.group, self.wire, self.mode, self.cast = group, wire, mode, cast
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.peers = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world)]
        self.sent, self.recv = sent, recv
        n_local = len(sent[0]) if sent else 0
        self.ranges = ranges
        self.send_start, at = [], 0
        for r in range(self.world):
            row = []
            for e in range(n_local):
                row.append(at)
                at += sent[r][e]
            self.send_start.append(row)
        self.rows_sent = at
        self.recv_start = [[0] * n_local for _ in range(self.world)]
        self.expert_start, at = [], 0
        for e in range(n_local):
            self.expert_start.append(at)
            for r in range(self.world):
                self.recv_start[r][e] = at
                at += recv[r][e]
        self.expert_start.append(at)
        self.rows_received = at
        self.num_tokens_per_local_expert = num_tokens_per_local_expert
        self.merged = type(self).posting == "merged"
        self.recv_counts = recv_counts  # (R, E_local) int32 device: the permute kernel's counts (merged form)
        if self.merged and recv_counts is None and wire is Wire.MXFP8:
            raise ValueError("the merged posting form of an MXFP8 wire needs recv_counts")
        if self.merged:  # per range c: rank r's rows in this rank's sorted rows [send_lo, + send_n), and in the
            # range's staging buffer (source rank, expert order) [stage_start, + recv_rows)
            self.send_lo = [[self.send_start[r][lo] for lo, _ in ranges] for r in range(self.world)]
            self.send_n = [[sum(sent[r][lo:hi]) for lo, hi in ranges] for r in range(self.world)]
            self.recv_rows = [[sum(recv[r][lo:hi]) for lo, hi in ranges] for r in range(self.world)]
            self.stage_start = [[sum(self.recv_rows[q][c] for q in range(r)) for r in range(self.world)]
                                for c in range(len(ranges))]
        self._posted: dict = {}  # (leg, range) -> pending works and the tensors they use
        self._issued: set = set()  # (leg, range) posted back from the experts
        self._queued: dict = {}  # leg -> its ranges not yet posted towards the experts (PostsAhead)
        self._buffers: dict = {}  # leg -> its receive buffers while the exchange holds them

    # ------------------------------------------------------------------ rows of a range

    def rows_of(self, c: int) -> tuple[int, int]:
        """Expert-major rows ``[start, end)`` of range c."""
        lo, hi = self.ranges[c]
        return self.expert_start[lo], self.expert_start[hi]

    def counts_of(self, c: int) -> torch.Tensor:
        """``(hi - lo,)`` int32 device counts of range c's experts."""
        lo, hi = self.ranges[c]
        return self.num_tokens_per_local_expert[lo:hi]

    # ------------------------------------------------------------------ posting

    def _tag(self, leg: str, c: int, e: int, i: int, n_t: int) -> int:
        return ((_LEGS.index(leg) * len(self.ranges) + c) * len(self.sent[0]) + e) * n_t + i

    def _post(self, leg: str, c: int, sorted_side: list, other_side: list, *, to_experts: bool) -> None:
        """Post range c of ``leg`` between each tensor of ``sorted_side`` (this rank's sorted rows) and the matching
        tensor of ``other_side``, towards the experts or back: the range's expert-major rows block by block, or
        (merged form) its staging buffer one message per peer (:meth:`_pieces`)."""
        moves, rows = [], 0
        for r, e, a, n_a, b, n_b in self._pieces(c):
            rows += n_a if to_experts else n_b
            for i, (s_t, x_t) in enumerate(zip(sorted_side, other_side)):
                src, dst = (s_t[a:a + n_a], x_t[b:b + n_b]) if to_experts else (x_t[b:b + n_b], s_t[a:a + n_a])
                moves.append((r, self._tag(leg, c, e, i, len(sorted_side)), src, dst))
        self._send_all(leg, c, moves, rows, sorted_side if to_experts else other_side, (sorted_side, other_side))

    def _pieces(self, c: int) -> list:
        """Range c's pieces ``(r, e, a, n_a, b, n_b)``: rank r's ``n_a`` rows at row ``a`` of this rank's sorted rows
        and ``n_b`` rows at row ``b`` of the range's own rows. Per block: one piece per (r, e), ``b`` in the
        range's expert-major rows; merged: one per rank (``e`` 0), ``b`` in its staging buffer (source rank,
        expert order), rank r's rows of the range's experts being contiguous in the sorted order."""
        if self.merged:
            return [(r, 0, self.send_lo[r][c], self.send_n[r][c], self.stage_start[c][r], self.recv_rows[r][c])
                    for r in range(self.world)]
        lo, hi = self.ranges[c]
        base = self.rows_of(c)[0]
        return [(r, e, self.send_start[r][e], self.sent[r][e], self.recv_start[r][e] - base, self.recv[r][e])
                for r in range(self.world) for e in range(lo, hi)]

    def _send_all(self, leg: str, c: int, moves: list, rows: int, sending: list, keep) -> None:
        """Copy the moves to this rank itself, post the others as one batch; ``rows`` of ``sending``'s widths
        go on the wire record; ``keep``: tensors that live until the wait."""
        ops = []
        for r, tag, src, dst in moves:
            if r == self.rank:
                if src.shape[0]:
                    dst.copy_(src)
                continue
            if src.shape[0]:
                ops.append(dist.P2POp(dist.isend, src, self.peers[r], self.group, tag))
            if dst.shape[0]:
                ops.append(dist.P2POp(dist.irecv, dst, self.peers[r], self.group, tag))
        WireLog.record_rows(leg, rows, rows * sum(t.shape[1] * t.element_size() for t in sending))
        with leg_range(leg):
            works = dist.batch_isend_irecv(ops) if ops else []
        self._posted[(leg, c)] = (works, keep)

    def _staged_order_of_expert_major(self, c: int) -> list:
        """Range c's expert-major rows as ``(start, rows)`` blocks in (rank, expert) order: their concatenation is
        the range's staging order."""
        lo, hi = self.ranges[c]
        base = self.rows_of(c)[0]
        return [(self.recv_start[r][e] - base, self.recv[r][e]) for r in range(self.world) for e in range(lo, hi)]

    def _staged_blocks(self, c: int) -> list:
        """Range c's (expert, rank) blocks in expert-major order, each as ``(start in the staging buffer, rows)``."""
        lo, hi = self.ranges[c]
        out = []
        for e in range(lo, hi):
            for r in range(self.world):
                out.append((self.stage_start[c][r] + sum(self.recv[r][lo:e]), self.recv[r][e]))
        return out

    def _wait(self, leg: str, c: int) -> None:
        works, *_ = self._posted.pop((leg, c))
        for w in works:
            w.wait()  # NCCL: the current stream waits, the host does not

    # ------------------------------------------------------------------ the legs

    def to_experts(self, leg: str, rows: torch.Tensor, order, quantized: tuple | None = None) -> None:
        """Post ``rows (N, D)`` (this rank's sorted rows) towards the experts, ranges in ``order`` (one ahead of
        the waits: :class:`~moe_quant.ep.pipeline.PostsAhead`): MXFP8 data and scales on that wire (quantized
        once for every range; ``quantized``: that quantization, made earlier), else the rows' own bytes. Each
        range receives into buffers of its own, made when it is posted (a range's rows handed to the experts
        are never written again by a later range's receive)."""
        dev, d = rows.device, rows.shape[1]
        rows = rows.contiguous()
        if self.wire is Wire.MXFP8:
            data, scales = quantized if quantized is not None else quantize_rows(rows, self.mode, self.cast)
            src = [data.view(torch.uint8), scales.view(torch.uint8)]
            widths = [(d, torch.uint8), (d // 32, torch.uint8)]
        else:
            src = [row_bytes_view(rows)]
            widths = [(d, rows.dtype)]
        parts: dict = {}  # range -> its receive buffers
        self._buffers[leg] = (parts, rows.dtype, d, set())

        def post(c: int) -> None:
            start, end = self.rows_of(c)
            parts[c] = [row_bytes_view(torch.empty(end - start, w, dtype=t, device=dev)) for w, t in widths]
            self._post(leg, c, src, parts[c], to_experts=True)

        self._queue(leg, order, post)

    def arrived(self, leg: str, c: int) -> torch.Tensor:
        """Range c of ``leg`` (towards the experts) once arrived: expert-major rows ``(M_c, D)``; MXFP8 rows
        dequantized and registered with their fp8 data and scales (the GEMMs reuse them)."""
        self._post_ahead(leg, c)
        self._wait(leg, c)
        parts, dtype, d, seen = self._buffers[leg]
        dst = parts.pop(c)
        seen.add(c)
        if len(seen) == len(self.ranges):
            del self._buffers[leg]  # the last range: the exchange no longer holds the buffers
        start, end = self.rows_of(c)
        if self.wire is not Wire.MXFP8:
            rows = dst[0].view(dtype).reshape(end - start, d)
            if self.merged:  # staged in (rank, expert) order: expert-major by one concatenation
                rows = torch.cat([rows[b:b + n] for b, n in self._staged_blocks(c)])
            return rows
        data = dst[0].view(torch.float8_e4m3fn)
        scales = dst[1]
        scaled = backends.supports_scaled_grouped_mm(data.device)  # the scaled GEMM reads the fp8 data and scales
        if self.merged:  # staged in (rank, expert) order: the permute kernel's pass puts it in expert order
            lo, hi = self.ranges[c]
            counts = self.recv_counts[:, lo:hi].contiguous()
            if scaled:
                data, scales, _ = permute_received(data, scales, counts, out="plain")
                values = dequantize_rows(data, scales, dtype)
            else:
                values, _ = permute_received(data, scales, counts, out="dequant", out_dtype=dtype)
        else:
            values = dequantize_rows(data, scales, dtype)
        if scaled:
            pq.remember(values, self.mode, data, scales)
        else:
            pq.remember(values, self.mode)
        return values

    def from_experts(self, leg: str, c: int, rows: torch.Tensor) -> None:
        """Post range c's expert-major rows ``(M_c, D)`` back to the ranks they came from, into this rank's
        sorted rows (exact: the rows' own bytes)."""
        if leg not in self._buffers:
            self._buffers[leg] = torch.empty(self.rows_sent, rows.shape[1], dtype=rows.dtype, device=rows.device)
        self._issued.add((leg, c))
        rows = rows.contiguous()
        if self.merged:  # to (rank, expert) order: one message per peer
            rows = torch.cat([rows[b:b + n] for b, n in self._staged_order_of_expert_major(c)])
        self._post(leg, c, [row_bytes_view(self._buffers[leg])], [row_bytes_view(rows)], to_experts=False)

    def returned(self, leg: str, like: torch.Tensor) -> torch.Tensor:
        """Every range of ``leg`` (back from the experts) once arrived: this rank's sorted rows ``(N, D)``,
        ``like``'s dtype. A range never posted (no gradient reached its rows) is posted now with zeros, so
        peers never wait for it."""
        self._post_queued()
        for c in range(len(self.ranges)):
            if (leg, c) not in self._issued:
                start, end = self.rows_of(c)
                self.from_experts(leg, c, like.new_zeros(end - start, like.shape[1]))
            self._wait(leg, c)
        return self._buffers.pop(leg)


@contextlib.contextmanager
def posting(form: str):
    """``with posting("merged"):`` the exchanges made inside use that posting form (:data:`POSTINGS`), restored
    after (for measuring the candidate: ``benchmarks/bench_ep.py`` rows ``*_merged``)."""
    if form not in POSTINGS:
        raise ValueError(f"posting must be one of {', '.join(POSTINGS)}, got {form!r}")
    saved, BlockExchange.posting = BlockExchange.posting, form
    try:
        yield
    finally:
        BlockExchange.posting = saved


__all__ = ["BlockExchange", "POSTINGS", "posting"]
