"""CPU checks of moe_quant.ep.permute_received (the reference path): semantics against a loop oracle."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import from_mxfp8, to_blocked_m_groups, to_mxfp8
from moe_quant.ep import permute_received
from moe_quant.ep.permute import OUT_KINDS, reference_permute_received
from tests.mx_strategies import DISTRIBUTIONS, make_values, received_counts, to_bytes


def loop_oracle(data, scales, counts, m):
    """Expert-major rows by plain Python loops: ``(data_p, scales_p (uint8), offs list)``."""
    blocks, total = {}, 0
    for r, row in enumerate(counts):
        for e, c in enumerate(row):
            take = min(max(c, 0), m - total)
            blocks[r, e] = (total, take)
            total += take
    n_ranks, n_experts = len(counts), (len(counts[0]) if counts else 0)
    data_p = torch.zeros_like(to_bytes(data))
    scales_p = torch.zeros_like(to_bytes(scales))
    offs, t = [], 0
    for e in range(n_experts):
        for r in range(n_ranks):
            start, take = blocks[r, e]
            for i in range(take):
                data_p[t] = to_bytes(data)[start + i]
                scales_p[t] = to_bytes(scales)[start + i]
                t += 1
        offs.append(t)
    return data_p.view(torch.float8_e4m3fn), scales_p, offs


def received(m, k, seed, dist="normal"):
    assert k % 32 == 0
    return to_mxfp8(make_values((m, k), dist, seed))


def counts_tensor(counts, n_experts=None):
    if not counts:
        return torch.zeros(0, n_experts or 0, dtype=torch.int32)
    return torch.tensor(counts, dtype=torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32)


@given(rc=received_counts(), k=st.sampled_from([32, 64, 160]), dist=st.sampled_from(DISTRIBUTIONS),
       seed=st.integers(0, 2**31 - 1), out_dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_matches_loop_oracle(rc, k, dist, seed, out_dtype):
    counts, m = rc
    data, scales = received(m, k, seed, dist)
    c = counts_tensor(counts, 0)
    data_p, scales_p, offs = loop_oracle(data, scales, counts, m)
    assert data_p.shape == (m, k)
    offs_t = torch.tensor(offs, dtype=torch.int32)

    x, o = permute_received(data, scales, c, out="dequant", out_dtype=out_dtype)
    assert torch.equal(o, offs_t) and o.dtype == torch.int32
    assert torch.equal(to_bytes(x), to_bytes(from_mxfp8(data_p, scales_p, out_dtype)))

    d, s, o = permute_received(data, scales, c, out="plain")
    assert torch.equal(to_bytes(d), to_bytes(data_p)) and torch.equal(to_bytes(s), scales_p)
    assert s.dtype == torch.float8_e8m0fnu and torch.equal(o, offs_t)

    d, s, o = permute_received(data, scales, c, out="blocked")
    assert torch.equal(to_bytes(d), to_bytes(data_p)) and torch.equal(o, offs_t)
    assert torch.equal(to_bytes(s), to_bytes(to_blocked_m_groups(scales_p, offs_t)))


def test_example_by_hand():
    """Two ranks, three experts; rank 1 sends nothing to expert 0, expert 2 gets nothing."""
    data, scales = received(7, 32, 0)
    counts = torch.tensor([[2, 1, 0], [0, 4, 0]], dtype=torch.int32)
    d, s, offs = permute_received(data, scales, counts, out="plain")
    # input rows: r0e0 = 0,1; r0e1 = 2; r1e1 = 3..6  ->  e0: 0,1; e1: 2, 3..6
    assert offs.tolist() == [2, 7, 7]
    assert torch.equal(to_bytes(d), to_bytes(data))
    counts = torch.tensor([[1, 2], [3, 1]], dtype=torch.int32)  # r0e0=0, r0e1=1,2, r1e0=3,4,5, r1e1=6
    d, s, offs = permute_received(data, scales, counts, out="plain")
    assert offs.tolist() == [4, 7]
    order = [0, 3, 4, 5, 1, 2, 6]
    assert torch.equal(to_bytes(d), to_bytes(data)[order]) and torch.equal(to_bytes(s), to_bytes(scales)[order])


def test_bad_counts_are_sanitized_not_raised():
    data, scales = received(5, 64, 1)
    for counts, offs in (
        ([[-3, 2], [9, 9]], [3, 5]),  # negative -> 0, running total clamped to M=5
        ([[2**31 - 1, 2**31 - 1]], [5, 5]),  # int32 overflow of a naive sum
        ([[-(2**31), 1]], [0, 1]),
    ):
        d, s, o = permute_received(data, scales, torch.tensor(counts, dtype=torch.int32), out="plain")
        assert o.tolist() == offs
        assert d.shape == data.shape and s.shape == scales.shape
        assert torch.equal(to_bytes(d)[offs[-1]:], torch.zeros_like(to_bytes(d)[offs[-1]:]))


@pytest.mark.parametrize("out", OUT_KINDS)
def test_no_host_reads(out):
    """The reference runs on meta tensors: nothing depends on the values of counts on the host."""
    data = torch.empty(300, 64, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(300, 2, dtype=torch.uint8, device="meta")
    counts = torch.empty(3, 4, dtype=torch.int32, device="meta")
    res = permute_received(data, scales, counts, out=out)
    assert res[-1].shape == (4,) and res[0].shape == (300, 64)
    if out == "blocked":
        assert res[1].shape == (300 + 128 * 4, 4)


def test_argument_errors():
    data, scales = received(4, 64, 2)
    counts = torch.tensor([[4]], dtype=torch.int32)
    cases = [
        (TypeError, "data", dict(data=data.float())),
        (ValueError, "data", dict(data=data.view(-1))),
        (ValueError, "data", dict(data=data[:, :48], scales=scales[:, :1])),
        (TypeError, "scales", dict(scales=scales.float())),
        (ValueError, "scales", dict(scales=scales[:3])),
        (TypeError, "counts", dict(counts=counts.long())),
        (TypeError, "counts", dict(counts=[[4]])),
        (ValueError, "counts", dict(counts=counts.view(-1))),
        (ValueError, "counts", dict(counts=counts.to("meta"))),
        (ValueError, "out", dict(out="blocked_k")),
        (TypeError, "out_dtype", dict(out_dtype=torch.float16)),
    ]
    for exc, name, kw in cases:
        args = dict(data=data, scales=scales, counts=counts, out="dequant", out_dtype=torch.bfloat16) | kw
        with pytest.raises(exc, match=name):
            permute_received(args.pop("data"), args.pop("scales"), args.pop("counts"), **args)


def test_reference_is_what_the_entry_point_runs_on_cpu():
    data, scales = received(40, 64, 3)
    counts = torch.tensor([[10, 0, 5], [0, 0, 0], [7, 18, 0]], dtype=torch.int32)
    for out in OUT_KINDS:
        a = permute_received(data, scales.view(torch.uint8), counts, out=out)
        b = reference_permute_received(data, scales, counts, out=out)
        assert all(torch.equal(to_bytes(x), to_bytes(y)) for x, y in zip(a, b))


@given(n_ranks=st.integers(1, 4), n_experts=st.integers(1, 5),
       counts=st.lists(st.integers(0, 9), min_size=20, max_size=20))
def test_route_from_counts_row_map_and_expert_totals(n_ranks, n_experts, counts):
    """The synced mode's route (``legs.route_from_counts``) makes its row map on first use: it must be the
    received-order index of each expert-major row, a loop oracle's, and the experts' totals the counts' column
    sums (read on the host, so non-negative and summing to the rows received)."""
    from moe_quant.ep import legs

    table = [counts[r * n_experts:(r + 1) * n_experts] for r in range(n_ranks)]
    recv = torch.tensor(table, dtype=torch.int64)
    recv = torch.cat([recv, torch.zeros(n_ranks, legs.agree.SIZE, dtype=torch.int64)], dim=1)  # + the header
    sums = [sum(row) for row in table]
    route = legs.route_from_counts(recv, legs.Counts(sums, sums, table, table), None, wire=legs.Wire.BF16,
                                   mode="rceil")
    assert route._src is None  # not made before its first use
    starts, t = {}, 0
    for r in range(n_ranks):
        for e in range(n_experts):
            starts[r, e], t = t, t + table[r][e]
    oracle = [starts[r, e] + i for e in range(n_experts) for r in range(n_ranks) for i in range(table[r][e])]
    assert route.src.tolist() == oracle
    assert route.src is route.src  # made once
    assert route.num_tokens_per_local_expert.dtype == torch.int32
    assert route.num_tokens_per_local_expert.tolist() == [sum(table[r][e] for r in range(n_ranks))
                                                         for e in range(n_experts)]
