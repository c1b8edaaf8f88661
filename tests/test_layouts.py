"""Blocked scale layouts (docs/design.md section 3): an independent loop oracle, torchao's oracles, round trips."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import group_sizes, offsets_from_sizes

from moe_quant import layouts
from moe_quant.layouts import (
    from_blocked,
    from_blocked_3d,
    from_blocked_k_groups,
    from_blocked_m_groups,
    to_blocked,
    to_blocked_3d,
    to_blocked_k_groups,
    to_blocked_m_groups,
)

mx = pytest.importorskip("torchao.prototype.moe_training.kernels.mxfp8")


def design_off(r, c, nc):
    """docs/design.md's formula, written out independently of moe_quant.layouts."""
    return 512 * (nc * (r // 128) + c // 4) + 16 * (r % 32) + 4 * ((r // 32) % 4) + (c % 4)


def loop_blocked(s):
    rows, cols = s.shape
    nr, nc = math.ceil(rows / 128), math.ceil(cols / 4)
    out = bytearray(512 * nr * nc)
    for r in range(rows):
        for c in range(cols):
            out[design_off(r, c, nc)] = int(s[r, c])
    return torch.tensor(list(out), dtype=torch.uint8)


def loop_m_groups(s, sizes):
    m, cols = s.shape
    g_count = len(sizes)
    cp = 4 * math.ceil(cols / 4)
    out = torch.zeros((m + 128 * g_count) * cp, dtype=torch.uint8)
    start, prow = 0, 0
    for size in sizes:
        blk = loop_blocked(s[start : start + size]) if size else torch.zeros(0, dtype=torch.uint8)
        out[prow * cp : prow * cp + blk.numel()] = blk
        start += size
        prow += 128 * math.ceil(size / 128)
    return out.view(m + 128 * g_count, cp)


def bytes_of(t):
    return t.view(torch.uint8)


@given(rows=st.integers(1, 300), cols=st.integers(1, 11), seed=st.integers(0, 2**31 - 1))
def test_to_blocked_matches_formula_and_round_trips(rows, cols, seed):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    b = to_blocked(s)
    assert b.shape == layouts.blocked_shape(rows, cols)
    assert torch.equal(b.flatten(), loop_blocked(s))
    assert torch.equal(from_blocked(b, rows, cols), s)


@given(groups=group_sizes(), cols=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_m_groups_any_sizes(groups, cols, seed):
    sizes, tail = groups
    m = sum(sizes) + tail
    s = torch.randint(1, 256, (m, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    offs = offsets_from_sizes(sizes)
    b = to_blocked_m_groups(s, offs)
    assert b.shape == layouts.m_groups_blocked_shape(m, cols, len(sizes))
    assert torch.equal(b, loop_m_groups(s, sizes))  # every byte, padding included
    back = from_blocked_m_groups(b, offs, m, cols)
    assert torch.equal(back[: sum(sizes)], s[: sum(sizes)]) and bool((back[sum(sizes) :] == 0).all())


@given(nblocks=st.lists(st.integers(0, 4), min_size=1, max_size=5), cols=st.sampled_from([4, 8, 16]), seed=st.integers(0, 99))
def test_m_groups_matches_torchao_when_128_aligned(nblocks, cols, seed):
    sizes = [128 * n for n in nblocks]
    m = sum(sizes)
    s = torch.randint(0, 256, (m, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    offs = offsets_from_sizes(sizes)
    ref, _ = mx.torch_to_blocked_2d_M_groups(s.view(torch.float8_e8m0fnu), offs)
    assert torch.equal(to_blocked_m_groups(s, offs), bytes_of(ref))


@given(nblocks=st.lists(st.integers(0, 3), min_size=1, max_size=4), rows=st.integers(1, 260), seed=st.integers(0, 99))
def test_k_groups_matches_torchao_when_128_aligned(nblocks, rows, seed):
    sizes = [128 * n for n in nblocks]
    m = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    n_cols = layouts.k_groups_padded_len(m, len(sizes)) // 32
    s = torch.zeros(rows, n_cols, dtype=torch.uint8)
    s[:, : m // 32] = torch.randint(0, 256, (rows, m // 32), dtype=torch.uint8, generator=g)
    offs = offsets_from_sizes(sizes)
    ref, _ = mx.torch_to_blocked_2d_K_groups(s[:, : m // 32].contiguous().view(torch.float8_e8m0fnu), offs // 32)
    assert torch.equal(to_blocked_k_groups(s, offs, m), bytes_of(ref))


@given(groups=group_sizes(), rows=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_k_groups_any_sizes(groups, rows, seed):
    sizes, tail = groups
    m = sum(sizes) + tail
    offs = offsets_from_sizes(sizes)
    n_cols = layouts.k_groups_padded_len(m, len(sizes)) // 32
    g = torch.Generator().manual_seed(seed)
    # scales exist only for columns inside a padded group: build them group by group
    s = torch.zeros(rows, n_cols, dtype=torch.uint8)
    col, rp = 0, 128 * math.ceil(rows / 128)
    expect = torch.zeros(layouts.k_groups_blocked_shape(rows, m, len(sizes)), dtype=torch.uint8).flatten()
    base = 0
    for size in sizes:
        c = math.ceil(size / 32)
        part = torch.randint(1, 256, (rows, c), dtype=torch.uint8, generator=g)
        s[:, col : col + c] = part
        if c:
            blk = loop_blocked(part)
            expect[base * rp : base * rp + blk.numel()] = blk
        col += c
        base += 4 * math.ceil(c / 4)
    b = to_blocked_k_groups(s, offs, m)
    assert torch.equal(b.flatten(), expect)
    assert torch.equal(from_blocked_k_groups(b, offs, rows, m), s)


@given(sizes=group_sizes(), rows=st.integers(1, 300), seed=st.integers(0, 99))
def test_unblock_k_groups_reads_the_bytes_of_the_full_size_index(sizes, rows, seed):
    """unblock_k_groups (the kernels' path from the 32x1 kernel's blocked scales to the plain ones the emulated GEMM's
    dequantization reads) gathers by a per-column and a per-row part of the index: the same bytes as the full-size
    index of _k_groups_dest, on a buffer of random bytes everywhere (the tiles' padding rows and columns and the
    columns of no group included: those must come out 0), with empty groups and rows past the last group."""
    sizes, tail = sizes
    m = sum(sizes) + tail
    offs = offsets_from_sizes(sizes)
    shape = layouts.k_groups_blocked_shape(rows, m, len(sizes))
    blocked = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dest, keep = layouts._k_groups_dest(rows, m, offs)
    expect = torch.where(keep, blocked.reshape(-1)[torch.where(keep, dest, 0)], 0)
    assert keep.any() or not any(sizes)  # the precondition: real scales to move where there are tokens
    got = layouts.unblock_k_groups(blocked, offs, rows, m)
    assert got.dtype == torch.uint8 and torch.equal(got, expect)
    assert torch.equal(layouts.unblock_k_groups(blocked.view(torch.float8_e8m0fnu), offs, rows, m).view(torch.uint8),
                       expect)


@given(sizes=group_sizes(), rows=st.integers(1, 100), seed=st.integers(0, 99))
def test_k_groups_plain_offset_indexes_the_plain_scales(sizes, rows, seed):
    """The plain K-groups scales (what the emulated GEMM's dequantization reads, and the ``cols_fp8`` block kernels
    write by ``k_groups_plain_offset``): the reference's ``(R, Mp/32)`` (``k_groups_plain_shape``), scale (r, j) at byte
    ``k_groups_plain_offset(r, t, Mp)`` for every padded token t of block j, a group's blocks at its padded tokens (the
    group's first token's scale is that of its first 32 tokens alone)."""
    from moe_quant import reference
    from moe_quant.numerics import ScaleMode

    sizes, tail = sizes
    m = sum(sizes) + tail
    offs = offsets_from_sizes(sizes)
    x = torch.randn(m, rows, generator=torch.Generator().manual_seed(seed)) * torch.rand(m, 1) * 100
    data_t, scales, poffs = reference.quantize_colwise_k_groups_plain(x, offs, ScaleMode.RCEIL)
    mp = data_t.shape[1]
    assert tuple(scales.shape) == layouts.k_groups_plain_shape(rows, m, len(sizes)) == (rows, mp // 32)
    r = torch.arange(rows).unsqueeze(1)
    t = torch.arange(mp).unsqueeze(0)
    flat = scales.view(torch.uint8).reshape(-1)
    assert torch.equal(flat[layouts.k_groups_plain_offset(r, t, mp)], scales.view(torch.uint8).repeat_interleave(32, 1))
    assert layouts.k_groups_plain_offset(rows - 1, mp - 1, mp) == scales.numel() - 1 if mp else True
    for g, (end, pend, size) in enumerate(zip(offs.tolist(), poffs.tolist(), sizes)):  # each group's first block
        if size:
            first = x[end - size:end - size + min(size, 32)]
            want = reference.quantize_colwise_k_groups_plain(first, offs.new_tensor([first.shape[0]]), ScaleMode.RCEIL)
            pstart = pend - 32 * math.ceil(size / 32)
            got = flat[layouts.k_groups_plain_offset(torch.arange(rows), pstart, mp)]
            assert torch.equal(got, want[1].view(torch.uint8)[:, 0]), g


@given(e=st.integers(1, 4), rows=st.integers(1, 200), cols=st.integers(1, 9), seed=st.integers(0, 99))
def test_3d(e, rows, cols, seed):
    s = torch.randint(0, 256, (e, rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    b = to_blocked_3d(s)
    assert torch.equal(b, torch.stack([loop_blocked(s[i]) for i in range(e)]))
    if cols % 4 == 0:
        assert torch.equal(b, bytes_of(mx.torch_to_blocked_per_group_3d(s.view(torch.float8_e8m0fnu))))
    assert torch.equal(from_blocked_3d(b, rows, cols), s)


@pytest.mark.parametrize("bad", [[5, 3, 9], [-4, 2, 7], [0, 50, 10_000], [10_000, 10_000, 10_000]])
def test_bad_offsets_never_escape_the_buffer(bad):
    m, cols = 40, 3
    s = torch.randint(1, 256, (m, cols), dtype=torch.uint8)
    offs = torch.tensor(bad, dtype=torch.int32)
    b = to_blocked_m_groups(s, offs)
    assert b.shape == layouts.m_groups_blocked_shape(m, cols, 3)
    # sanitized offsets: clamp to [0, M], then non-decreasing
    clean = offs.to(torch.int64).clamp(0, m).cummax(0).values
    sizes = torch.diff(clean, prepend=clean.new_zeros(1)).tolist()
    assert torch.equal(b, loop_m_groups(s, sizes))
    kb = to_blocked_k_groups(torch.randint(1, 256, (7, layouts.k_groups_padded_len(m, 3) // 32), dtype=torch.uint8), offs, m)
    assert kb.shape == layouts.k_groups_blocked_shape(7, m, 3)


def test_scale_dtype_is_kept():
    s = torch.randint(0, 255, (5, 4), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert to_blocked(s).dtype == torch.float8_e8m0fnu
    assert to_blocked_m_groups(s, torch.tensor([5], dtype=torch.int32)).dtype == torch.float8_e8m0fnu
    with pytest.raises(TypeError, match="scales"):
        to_blocked(torch.zeros(2, 2))
