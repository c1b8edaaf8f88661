"""The order in which :func:`moe_quant.ep.pipeline.run_ranges` posts the exchanges of its ranges and queues the
experts (no process group: an exchange that records what it is asked to do)."""

from __future__ import annotations

import pytest
import torch

from moe_quant.ep import pipeline


class _Recording(pipeline.PostsAhead):
    """The exchange interface of :mod:`moe_quant.ep.pipeline`, recording "post LEG c", "wait LEG c", "back LEG c",
    "returned LEG"; rows travel unchanged (one row per range)."""

    def __init__(self, n: int, log: list):
        self.ranges = [(c, c + 1) for c in range(n)]
        self._queued, self.log, self.rows = {}, log, {}

    def counts_of(self, c):
        return torch.ones(1, dtype=torch.int32)

    def to_experts(self, leg, rows, order, quantized=None):
        self.rows[leg] = rows.detach()
        self._queue(leg, order, lambda c: self.log.append(("post", leg, c)))

    def arrived(self, leg, c):
        self._post_ahead(leg, c)
        self.log.append(("wait", leg, c))
        return self.rows[leg][c:c + 1].clone()

    def from_experts(self, leg, c, rows):
        self.log.append(("back", leg, c))

    def returned(self, leg, like):
        self._post_queued()
        self.log.append(("returned", leg))
        return torch.zeros(len(self.ranges), like.shape[1], dtype=like.dtype)


def _posted_ahead_by_one(log: list, leg: str, order: list) -> None:
    """Every range of ``leg`` posted once, in ``order``; when range c is waited for, the ranges through the one
    after c are posted and no later one."""
    posts = [e[2] for e in log if e[:2] == ("post", leg)]
    assert posts == order, log
    for i, e in enumerate(log):
        if e[:2] == ("wait", leg):
            k = order.index(e[2])
            posted = [p[2] for p in log[:i] if p[:2] == ("post", leg)]
            assert posted == order[:k + 2], (e, posted, log)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_run_ranges_posts_one_range_ahead_of_the_experts(n):
    """Forward: range 0's dispatch, then before waiting for range c the dispatch of range c + 1, so range 0's
    experts are queued after two posts, not after all of them (the host's posts kept the device idle, 3.4 ms
    a step with 4 ranges on 2 H200s); the backward's combine backward likewise, latest range first. Every
    range is posted once per leg."""
    log = []
    ex = _Recording(n, log)

    def runner(c):
        def run(rows, counts):
            log.append(("experts", c))
            return rows * 2

        return run

    x = torch.randn(n, 8, requires_grad=True)
    y = pipeline.run_ranges(ex, x, [runner(c) for c in range(n)])
    forward = list(log)
    want = [("post", "dispatch", 0)]
    for c in range(n):
        want += ([("post", "dispatch", c + 1)] if c + 1 < n else []) + [("wait", "dispatch", c), ("experts", c),
                                                                       ("back", "combine", c)]
    assert forward == want + [("returned", "combine")]
    assert forward.index(("experts", 0)) == min(n, 2) + 1  # the experts of range 0 after at most two posts
    y.sum().backward()
    backward = log[len(forward):]
    _posted_ahead_by_one(backward, "combine backward", list(reversed(range(n))))
    assert sorted(e[2] for e in backward if e[:2] == ("back", "dispatch backward")) == list(range(n))
    assert backward[-1] == ("returned", "dispatch backward")


def test_ranges_never_waited_for_are_posted_before_returned():
    """A range whose arrival nobody waits for is still posted (by ``returned``, before its own waits), so that
    peers, which post and wait for it, never hang."""
    log = []
    ex = _Recording(3, log)
    ex.to_experts("dispatch", torch.zeros(3, 4), [0, 1, 2])
    ex.arrived("dispatch", 0)
    assert [e for e in log if e[0] == "post"] == [("post", "dispatch", 0), ("post", "dispatch", 1)]
    ex.returned("combine", torch.zeros(0, 4))
    assert [e for e in log if e[0] == "post"] == [("post", "dispatch", c) for c in range(3)]
    assert log[-1] == ("returned", "combine")
