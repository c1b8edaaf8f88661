"""The experts of one rank run range by range while the exchange of the other ranges is in flight.

An *exchange* is one dispatch's four legs over some transport, with the methods below (
:class:`moe_quant.ep.blocks.BlockExchange`: point-to-point blocks of the synced mode;
:class:`moe_quant.ep.capacity.SlotExchange`: the slots of the sync-free mode):

* ``ranges``: the ranges ``(lo, hi)`` of local experts (:func:`expert_ranges`); ``counts_of(c)``: range
  c's counts per expert (device);
* ``to_experts(leg, rows, order, quantized)``: post this rank's sorted rows towards the experts, range by
  range in ``order``; ``arrived(leg, c)``: range c's rows for this rank's experts once arrived (a stream
  wait, no host read), MXFP8 dequantized and registered for the GEMMs;
* ``from_experts(leg, c, rows)``: post range c's expert-side rows back; ``returned(leg, like)``: this
  rank's sorted rows once every range is back (a range never posted is posted with zeros first, so that
  peers never wait for it).

The four legs are autograd functions linked by empty "token" tensors, so that autograd runs the posts and
waits where they overlap the experts: the forward posts range 0's dispatch, then, just before waiting for
range c and queueing its experts, range c + 1's (:class:`PostsAhead`), and posts range c's combine right
after its experts; the backward does the same with the combine backward, latest range first (autograd runs
later nodes first), and posts each range's dispatch backward as soon as that range's experts' backward is
done.

SMs for the communication kernels (``sm_carveout``). A GEMM launched while an NCCL kernel holds some SMs runs
its persistent grid (one CTA per SM) in two waves: the CTAs that found no free SM start when others finish, and
the GEMM takes up to twice as long. With ``sm_carveout=n`` each range's experts, forward and backward, run while
torch's GEMMs target ``n`` fewer SMs (``torch._C._set_sm_carveout_experimental``: torch's grouped GEMM and cuBLAS
read it), so they fit beside the transfers (:class:`SmWindow`). On 2 H200s with NCCL held to 4 channels (about
55 GB/s per GPU; p2p in 4 ranges, 2026-11-29) the grouped GEMMs that overlapped a transfer ran at up to 1.9x
their time alone; with ``sm_carveout=4`` every one ran at its time alone and the step went from 37.08 to 33.99 ms
(docs/lab/ep_log.md). The GEMMs' bits do not depend on it (``tests/test_grouped_mm_gpu.py``).
"""

from __future__ import annotations

import torch


def expert_ranges(num_local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ranges ``[lo, hi)`` of the local experts, as even as possible (at most one
    per expert: ``min(chunks, E_local)`` ranges)."""
    n = max(1, min(chunks, num_local_experts))
    bounds = [num_local_experts * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


class PostsAhead:
    """How an exchange posts the legs towards the experts: ``_queue`` posts the first range of ``order`` and keeps
    the others; ``_post_ahead(leg, c)``, called by ``arrived`` before its wait, posts the queued ranges through c
    and one more; ``_post_queued`` (called by ``returned``) posts what is left. So the host issues range c + 1's
    exchange just before queueing range c's experts, instead of every range's exchange before the first
    experts: on 2 H200s (2026-11-29, p2p in 4 ranges) the device waited 3.4 ms per step for the host to post
    the four ranges of the dispatch. Every range is posted exactly once, in the order given, on every rank
    alike (the peers' posts match in order)."""

    def _queue(self, leg: str, order, post) -> None:
        queue = list(order)
        if queue:
            post(queue.pop(0))
        if queue:
            self._queued[leg] = (queue, post)

    def _post_ahead(self, leg: str, c: int) -> None:
        if leg not in self._queued:
            return
        queue, post = self._queued[leg]
        n = queue.index(c) + 2 if c in queue else 1  # through c, then one more
        todo, queue[:] = queue[:n], queue[n:]
        if not queue:
            del self._queued[leg]
        for r in todo:
            post(r)

    def _post_queued(self) -> None:
        for leg in list(self._queued):
            queue, post = self._queued.pop(leg)
            for r in queue:
                post(r)


class SmWindow:
    """One range's experts, during which torch's GEMMs target ``n`` fewer SMs (see the module doc).

    Windows nest process-wide (a depth count): the first one opened saves the setting in force and sets ``n``,
    the last one closed restores it. Forward: the experts' call (``with window:``). Backward: opened by
    :class:`_Return` (the range's output gradient has arrived, its experts' backward comes next), closed by
    :class:`_Received` (their input gradient is made) or, where that never runs (rows that need no gradient),
    when autograd's backward pass ends. ``n=None``: a window that changes nothing."""

    _depth = 0
    _saved = None

    def __init__(self, n: int | None):
        self.n, self._open = n, False

    def open(self) -> None:
        if self.n is None or self._open:
            return
        cls = SmWindow
        if cls._depth == 0:
            cls._saved = torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(self.n)
        cls._depth += 1
        self._open = True

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        cls = SmWindow
        cls._depth -= 1
        if cls._depth == 0:
            torch._C._set_sm_carveout_experimental(cls._saved)

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def close_stale() -> None:
        """Close the windows left open by a backward pass that raised (its end-of-pass callbacks never ran):
        outside a backward pass no window can be open but a forward one, and none is between two dispatches.
        Called before each chunked dispatch."""
        cls = SmWindow
        if cls._depth and torch._C._current_graph_task_id() == -1:
            cls._depth = 0
            torch._C._set_sm_carveout_experimental(cls._saved)

    def open_for_backward(self) -> None:
        """Open until :meth:`close` or the end of the running backward pass, whichever comes first."""
        if self.n is None:
            return
        self.open()
        torch.autograd.Variable._execution_engine.queue_callback(self.close)


def _token(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


class _Send(torch.autograd.Function):
    """Sorted rows -> every range posted towards the experts; one empty token per range."""

    @staticmethod
    def forward(ctx, x_sorted, ex, quantized):
        ctx.ex, ctx.like = ex, x_sorted.new_empty(0, x_sorted.shape[1])
        ex.to_experts("dispatch", x_sorted, range(len(ex.ranges)), quantized)
        return tuple(_token(x_sorted) for _ in ex.ranges)

    @staticmethod
    def backward(ctx, *_tokens):
        return ctx.ex.returned("dispatch backward", ctx.like), None, None


class _Received(torch.autograd.Function):
    """Range c once arrived (expert-major rows); backward closes the range's :class:`SmWindow` (its experts'
    backward is done) and posts their gradient back (dispatch backward)."""

    @staticmethod
    def forward(ctx, token, ex, c: int, window):
        ctx.ex, ctx.c, ctx.window = ex, c, window
        return ex.arrived("dispatch", c)

    @staticmethod
    def backward(ctx, grad):
        ctx.window.close()
        ctx.ex.from_experts("dispatch backward", ctx.c, grad)
        return grad.new_empty(0), None, None, None


class _Return(torch.autograd.Function):
    """Range c's expert outputs posted back (combine); backward waits for their gradient (combine backward) and
    opens the range's :class:`SmWindow` (its experts' backward comes next)."""

    @staticmethod
    def forward(ctx, y, ex, c: int, window):
        ctx.ex, ctx.c, ctx.window = ex, c, window
        ex.from_experts("combine", c, y)
        return _token(y)

    @staticmethod
    def backward(ctx, _token_grad):
        grad = ctx.ex.arrived("combine backward", ctx.c)
        ctx.window.open_for_backward()
        return grad, None, None, None


class _Gather(torch.autograd.Function):
    """Every range's combine arrived: this rank's sorted rows ``(N, D)``; backward posts the gradient of
    every range towards the experts (latest range first, the order autograd runs them in)."""

    @staticmethod
    def forward(ctx, ex, like, *tokens):
        ctx.ex = ex
        return ex.returned("combine", like)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        ex.to_experts("combine backward", grad, reversed(range(len(ex.ranges))))
        return (None, None, *(grad.new_empty(0) for _ in ex.ranges))


def send(x_sorted: torch.Tensor, ex, quantized: tuple | None = None) -> tuple:
    """Post this rank's sorted rows towards the experts (every range; ``quantized``: their 1x32 MXFP8
    form, made earlier); the tokens :func:`received` takes."""
    return _Send.apply(x_sorted, ex, quantized)


def received(token: torch.Tensor, ex, c: int, window: SmWindow | None = None) -> torch.Tensor:
    """Range c's rows for this rank's experts ``[lo, hi)``, expert-major, once arrived (differentiable;
    ``window``: the range's :class:`SmWindow`, closed in backward)."""
    return _Received.apply(token, ex, c, window or SmWindow(None))


def send_back(y: torch.Tensor, ex, c: int, window: SmWindow | None = None) -> torch.Tensor:
    """Post range c's expert outputs back; the token :func:`gather` takes (``window``: opened in backward)."""
    return _Return.apply(y, ex, c, window or SmWindow(None))


def gather(ex, tokens, like: torch.Tensor) -> torch.Tensor:
    """This rank's sorted rows back from every range's experts ``(N, D)`` (``like``: dtype and width)."""
    return _Gather.apply(ex, like.new_empty(0, like.shape[1]), *tokens)


def run_ranges(ex, x_sorted: torch.Tensor, runners: list, quantized: tuple | None = None,
               sm_carveout: int | None = None) -> torch.Tensor:
    """This rank's sorted rows ``x_sorted`` through the experts of every range of ``ex`` (``runners[c]``:
    range c's experts, ``(rows, counts) -> outputs``) and back: ``(N, D)`` in ``x_sorted``'s order.
    ``sm_carveout``: with more than one range, the experts' GEMMs leave that many SMs to the transfers
    (:class:`SmWindow`)."""
    if len(runners) != len(ex.ranges):
        raise ValueError(f"split_experts returned {len(runners)} callables for {len(ex.ranges)} ranges")
    carve = sm_carveout if len(ex.ranges) > 1 else None  # one range: nothing travels while the experts run
    SmWindow.close_stale()
    tokens = send(x_sorted, ex, quantized)
    back = []
    for c, (run, token) in enumerate(zip(runners, tokens)):
        window = SmWindow(carve)
        rows = received(token, ex, c, window)
        with window:
            y = run(rows, ex.counts_of(c))
        back.append(send_back(y, ex, c, window))
    return gather(ex, back, x_sorted)


__all__ = ["PostsAhead", "SmWindow", "expert_ranges", "send", "received", "send_back", "gather", "run_ranges"]
