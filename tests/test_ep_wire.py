"""The MXFP8 wire moves the quantize kernel's outputs as they are: no packed buffer on either side.

Each MXFP8 leg hands ``all_to_all_single`` the data and the scales (two exchanges of the same row splits),
so the sender makes no ``torch.cat`` of them and the receiver's permutation gets contiguous rows (before,
a packed ``(M, K + K/32)`` buffer cost a copy on each side: 1.0 ms of the receiver's alone at EP = 4 on H200s,
docs/lab/ep_log.md). One rank over gloo: the same code as any world size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moe_quant.ep import MXFP8TokenDispatcher, WireLog, mxfp8_row_bytes
from moe_quant.ep import permute as ep_permute

T, K, E, TOP_K = 24, 64, 4, 2


class _BigByteOps(TorchDispatchMode):
    """Ops that produce a 1-byte-element tensor of at least ``n`` elements (fp8 data, packed rows)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.seen = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.element_size() == 1 and t.numel() >= self.n:
                self.seen.append(func.overloadpacket.__name__)
        return out


def _routing(gen):
    x = torch.randn(T, K, generator=gen, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
    scores = torch.rand(T, TOP_K, generator=gen)
    return x, scores, ids, torch.bincount(ids.flatten(), minlength=E)


@pytest.mark.parametrize("capacity_factor", [None, 2.0], ids=["synced", "sync_free"])
def test_mxfp8_leg_sends_data_and_scales_without_a_packed_copy(gloo_group, monkeypatch, capacity_factor):
    sent, permuted = [], []
    real_a2a, real_permute = dist.all_to_all_single, ep_permute.permute_received

    def a2a(out, inp, *args, **kwargs):
        sent.append((inp.dtype, tuple(inp.shape), inp.is_contiguous()))
        return real_a2a(out, inp, *args, **kwargs)

    def permute(data, scales, counts, **kwargs):
        permuted.append((data.is_contiguous(), scales.is_contiguous()))
        return real_permute(data, scales, counts, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", a2a)
    monkeypatch.setattr(ep_permute, "permute_received", permute)
    x, scores, ids, counts = _routing(torch.Generator().manual_seed(0))
    disp = MXFP8TokenDispatcher(E, TOP_K, wire="mxfp8", capacity_factor=capacity_factor)
    plain = MXFP8TokenDispatcher(E, TOP_K, wire="bf16", capacity_factor=capacity_factor)
    want, _, _ = plain.dispatch(x, scores, ids, counts)
    sent.clear()
    with WireLog() as log, _BigByteOps(T * TOP_K * K) as ops:
        got, tokens, _ = disp.dispatch(x, scores, ids, counts)
    rows = T * TOP_K if capacity_factor is None else got.shape[0]
    # the token leg: the data (rows, K) and the scales (rows, K / 32), each handed over as it is
    token_legs = [s for s in sent if s[1][0] == rows]
    assert token_legs == [(torch.uint8, (rows, K), True), (torch.uint8, (rows, K // 32), True)], sent
    assert "cat" not in ops.seen, ops.seen  # no packed buffer on the sender
    if capacity_factor is None:
        assert permuted == [(True, True)], permuted  # the receiver's permutation reads contiguous rows
    assert log.by_leg("dispatch") == (rows, rows * mxfp8_row_bytes(K))  # one leg, data and scales together
    # and the rows are what they were: the bf16 wire's rows, quantized and dequantized (MXFP8 rounds them)
    assert got.shape == want.shape and int(tokens.sum()) == T * TOP_K
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -3, atol=2 ** -6)


@given(n_experts=st.integers(1, 6), ids=st.lists(st.integers(-3, 8), min_size=0, max_size=24),
       bump=st.integers(-1, 1), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_mismatch_flags_ids_outside_the_experts_and_counts_off_the_histogram(n_experts, ids, bump, dtype):
    """The code every rank sends with its counts: ``_mismatch`` is True exactly when an id lies outside
    [0, num_experts) or the counts are not the in-range ids' histogram (a loop oracle; ``bump`` moves one
    count off it). The ids out of range are counted nowhere in the histogram, so counts that match the
    in-range ids still flag them."""
    disp = MXFP8TokenDispatcher(n_experts, 1)
    hist = [sum(i == e for i in ids) for e in range(n_experts)]
    counts = list(hist)
    counts[0] += bump
    want = any(not 0 <= i < n_experts for i in ids) or counts != hist
    got = disp._mismatch(torch.tensor(ids, dtype=dtype).view(-1, 1), torch.tensor(counts, dtype=torch.int32))
    assert got.dtype == torch.bool and got.shape == ()
    assert bool(got) == want


@given(world=st.integers(1, 3), n_local=st.integers(1, 3), slots=st.integers(0, 6), seed=st.integers(0, 2**16),
       counts=st.lists(st.integers(0, 5), min_size=9, max_size=9), extra=st.integers(0, 2))
def test_sync_free_slot_placement_equals_the_gather(world, n_local, slots, seed, counts, extra):
    """The sync-free legs place rows with a zero fill and one copy through the inverse maps (``slot_of_row`` on
    the sender, ``slot_rows`` of the receiver's plan, ``send_idx`` coming back) instead of a gather and a mask:
    every byte equal to the gather's, padding and overflowing rows zero, fp8 and bf16 rows alike (NaN payloads
    included)."""
    from moe_quant.ep import capacity

    c = torch.tensor(counts[:world * n_local])
    rows = int(c.sum()) + extra  # extra: rows past the counts (never sent)
    send_idx, send_valid, slot_of_row, kept, _, _ = capacity.plan_send(c, rows, world, slots)
    total = world * slots
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**16, (rows, 8), generator=g, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)  # any 16-bit pattern, NaNs included
    for t in (x, bits[:, :4].view(torch.uint8)[:, :6].contiguous().view(torch.float8_e4m3fn)):
        want = capacity._gather(t, send_idx, send_valid)
        got = capacity._scatter(t, slot_of_row, None, total)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    src, valid, _ = capacity.plan_receive(kept, slots)  # what this rank's own send looks like on arrival
    recv = torch.randint(0, 2**16, (total, 8), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = capacity._gather(recv, src, valid)
    got = capacity._scatter(recv, capacity.slot_rows(src, valid), None, total)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    inside = slot_of_row < total
    want = capacity._gather(recv, torch.where(inside, slot_of_row, 0), inside)
    got = capacity._scatter(recv, torch.where(send_valid, send_idx, rows), None, rows)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


_ROW_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float32, torch.int64]


@given(dtype=st.sampled_from(_ROW_DTYPES), n=st.integers(0, 9), d=st.integers(1, 40), skip=st.integers(0, 3),
       col0=st.integers(0, 5), step=st.sampled_from([1, 1, 2]), seed=st.integers(0, 2**31 - 1))
def test_row_words_index_copy_equals_the_elements(dtype, n, d, skip, col0, step, seed):
    """A row copy by whole words (``wire.row_words``, the legs' placement) moves the same bytes as one by elements,
    on rows of any width, offset (leading rows skipped) and column slice (a row stride wider than the row); it
    widens exactly where the row's bytes, strides and offset allow, and the widened view shares the storage."""
    from moe_quant.ep.wire import row_words

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n + skip, (step * d + col0) * dtype.itemsize), dtype=torch.uint8,
                         generator=g).view(dtype)
    t = base[skip:, col0:col0 + step * d:step]  # step 2: a strided last dimension
    w = row_words(t)
    item = t.element_size()
    legal = [s for s in (8, 4, 2) if s > item and t.stride(-1) == 1
             and all((v * item) % s == 0 for v in (t.shape[-1], t.storage_offset(), t.stride(0)))]
    assert w.element_size() == (legal[0] if legal else item) and not w.is_floating_point()
    assert w.data_ptr() == t.data_ptr() and w.view(t.dtype).shape == t.shape
    perm = torch.randperm(t.shape[0], generator=g)
    dense = lambda x: torch.empty(x.shape, dtype=x.dtype).copy_(x)  # noqa: E731  (a fresh row-major copy)
    want = dense(t).view(torch.uint8)[perm.argsort()]  # out[perm[i]] = t[i]
    got = torch.empty_like(w).index_copy_(0, perm, w).view(t.dtype)
    assert torch.equal(dense(got).view(torch.uint8), want)


def test_row_words_widens_the_legs_rows():
    """The precondition of the speed-up: DeepSeek-V3's fp8, bf16 and scale rows become 8-byte words."""
    from moe_quant.ep.wire import row_words

    for t in (torch.zeros(4, 7168, dtype=torch.float8_e4m3fn), torch.zeros(4, 7168, dtype=torch.bfloat16),
              torch.zeros(4, 224, dtype=torch.uint8)):
        assert row_words(t).dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_row_words_traces_under_compile(dtype):
    """The legs' row placement traces with ``fullgraph=True`` (torch 2.11's dynamo cannot trace
    ``storage_offset()``: there the same-size integer view is taken) and moves the same bytes as in eager."""
    from moe_quant.ep.wire import row_words

    def place(t, perm):
        w = row_words(t)
        return torch.empty_like(w).index_copy_(0, perm, w).view(t.dtype)

    t = torch.randint(0, 120, (6, 64), dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else \
        torch.randn(6, 64, dtype=dtype)
    perm = torch.randperm(6)
    got = torch.compile(place, fullgraph=True, backend="aot_eager")(t, perm)
    assert torch.equal(got.view(torch.uint8), place(t, perm).view(torch.uint8))
