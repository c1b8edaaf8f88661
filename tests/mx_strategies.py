"""Hypothesis strategies shared by the numerics, layout and kernel tests.

Values come from a seeded torch generator (hypothesis draws the seed, the shape and the
distribution), so large tensors stay cheap to generate and every failure replays.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DISTRIBUTIONS = ("normal", "wide", "zero_blocks", "subnormal", "nan_inf", "amax_band")

# group sizes that stress the layouts: empty, single, around 32 and 128
SPECIAL_GROUP_SIZES = (0, 1, 31, 32, 33, 127, 128, 129)


def make_values(shape, dist: str, seed: int, dtype=torch.bfloat16, inject_inf: bool = True) -> torch.Tensor:
    """A tensor of ``shape`` with blocks of 32 along the last dim drawn from ``dist``."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "wide":  # magnitudes 2^-140 .. 2^127
        e = torch.randint(-140, 127, (n,), generator=g).float()
        x = torch.randn(n, generator=g).sign() * torch.rand(n, generator=g).add(1) * torch.exp2(e)
    elif dist == "zero_blocks":
        x = torch.randn(n, generator=g)
        blocks = x.view(-1, 32) if n % 32 == 0 else x.view(1, -1)
        blocks[torch.rand(blocks.shape[0], generator=g) < 0.4] = 0
    elif dist == "subnormal":  # bf16 subnormals: below 2^-126
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-133, -120, (n,), generator=g).float())
    elif dist == "nan_inf":
        x = torch.randn(n, generator=g)
        if n == 0:
            return x.view(shape).to(dtype)
        specials = [float("nan"), float("inf"), float("-inf")] if inject_inf else [float("nan")]
        idx = torch.randint(0, max(n, 1), (max(1, n // 97),), generator=g)
        which = torch.randint(0, len(specials), idx.shape, generator=g)
        x[idx] = torch.tensor(specials)[which]
    elif dist == "amax_band":  # block amax in (448 * 2^k, 512 * 2^k)
        x = torch.randn(n, generator=g)
        if n % 32 == 0 and n > 0:
            blocks = x.view(-1, 32)
            k = torch.randint(-120, 110, (blocks.shape[0],), generator=g).float()
            blocks.mul_(torch.exp2(k - 8).unsqueeze(1))
            peak = 448 * torch.exp2(k) * (1 + torch.rand(blocks.shape[0], generator=g) * (64 / 448))
            blocks[:, 0] = peak.clamp(max=3e38)
    elif dist == "grid":  # per block an amax 2^E of any mantissa, the rest down to 2^-20 of it (e4m3 normal,
        # subnormal, ties, values that round to zero) and zeros: every case of the block's e4m3 grid
        x = torch.randn(n, generator=g)
        if n % 32 == 0 and n > 0:
            nb = n // 32
            e = torch.randint(-100, 120, (nb, 1), generator=g)
            drop = torch.randint(0, 21, (nb, 32), generator=g)
            drop[:, 0] = 0
            mant = 1 + torch.randint(0, 128, (nb, 32), generator=g) / 128
            sign = torch.randint(0, 2, (nb, 32), generator=g) * 2 - 1
            blocks = sign * mant * torch.exp2((e - drop).float())
            blocks[torch.rand(nb, 32, generator=g) < 0.1] = 0
            x = blocks.flatten()
    else:
        raise ValueError(dist)
    return x.view(shape).to(dtype)


@st.composite
def group_sizes(draw, max_groups: int = 6, max_size: int = 300, allow_tail: bool = True):
    """A list of group sizes (mixing special sizes and random ones) plus a tail of rows past the last group."""
    g = draw(st.integers(1, max_groups))
    sizes = draw(
        st.lists(st.one_of(st.sampled_from(SPECIAL_GROUP_SIZES), st.integers(0, max_size)), min_size=g, max_size=g)
    )
    tail = draw(st.integers(0, 40)) if allow_tail else 0
    return sizes, tail


def offsets_from_sizes(sizes, device="cpu") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@st.composite
def received_counts(draw, max_ranks: int = 4, max_experts: int = 5, max_count: int = 140, bad: bool = True):
    """``(counts (R, E) list of lists, M)`` of a received all-to-all buffer: empty experts, ranks that
    send nothing, ragged blocks, a tail of rows past the counts; with ``bad``, sometimes negative counts
    and totals past M (which the permutation must sanitize)."""
    r = draw(st.integers(0, max_ranks))
    e = draw(st.integers(0, max_experts))
    count = st.one_of(st.sampled_from(SPECIAL_GROUP_SIZES), st.integers(0, max_count))
    if bad:
        count = st.one_of(count, st.sampled_from((-1, -(2**31), 2**31 - 1, 1000)))
    counts = draw(st.lists(st.lists(count, min_size=e, max_size=e), min_size=r, max_size=r))
    silent = draw(st.integers(-1, r - 1)) if r else -1  # one rank that sends nothing
    if silent >= 0:
        counts[silent] = [0] * e
    valid_total = sum(max(c, 0) for row in counts for c in row)
    m = draw(st.one_of(st.just(min(valid_total, 600)), st.integers(0, 600)))
    return counts, m
