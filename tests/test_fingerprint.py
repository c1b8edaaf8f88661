"""The byte fingerprint (moe_quant.fingerprint): the reference is the definition (checked against a pure-Python
oracle), does not depend on its chunking, and changes on a flipped bit, a swap of two words, a change in the
last partial word; the kernel op's host-side split of a tensor into launches (CPU, with the reference standing
in for the kernel) reads every word once, at its position, from 16-byte aligned addresses."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import fingerprint as fp
from moe_quant.kernels.fingerprint import ops as ops_fingerprint
from moe_quant.fingerprint import WORD_KEY, WORD_MIX, as_int64

MASK = (1 << 64) - 1


def oracle(data: bytes) -> int:
    """The definition in Python integers (docs: moe_quant/fingerprint.py), as a two's-complement int64."""
    data = bytes(data) + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(data) // 8):
        x = int.from_bytes(data[8 * i:8 * i + 8], "little") ^ (i * WORD_KEY & MASK)
        x ^= x >> 32
        x = x * WORD_MIX & MASK
        total += x ^ (x >> 32)
    total &= MASK
    return total - (1 << 64) if total >> 63 else total


def value(t: torch.Tensor) -> int:
    return int(fp.reference_fingerprint(t))


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.float64]


@given(n=st.integers(0, 70), offset=st.integers(0, 9), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_reference_is_the_definition(n, offset, dtype, seed):
    size = torch.tensor([], dtype=dtype).element_size()
    base = random_bytes((offset + n + 1) * size, seed).view(dtype)
    t = base[offset:offset + n]  # any storage offset: viewable as int64 words or not
    assert value(t) == oracle(t.contiguous().view(torch.uint8).tolist())
    assert fp.fingerprint(t).dtype == torch.int64 and fp.fingerprint(t).shape == ()
    assert int(fp.fingerprint(t)) == value(t)  # on the CPU, the entry point is the reference


def test_reference_of_non_contiguous_and_multi_dim_tensors_is_of_their_row_major_bytes():
    t = torch.randn(6, 10, dtype=torch.bfloat16)
    for v in (t.T, t[:, 1:7], t[::2], t.view(2, 3, 10)):
        assert value(v) == oracle(v.contiguous().view(torch.uint8).reshape(-1).tolist())


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64, 1000])
@pytest.mark.parametrize("offset", [0, 1, 8, 13])
def test_reference_does_not_depend_on_the_chunk(chunk, offset, monkeypatch):
    t = random_bytes(offset + 8 * 1000 + 5, 3)[offset:]
    want = value(t)
    monkeypatch.setattr(fp, "CHUNK_WORDS", chunk)
    assert value(t) == want


@pytest.mark.parametrize("n", [1, 7, 8, 9, 26, 27, 31, 32, 40])
def test_one_flipped_bit_anywhere_changes_it(n):
    t = random_bytes(n, n)
    want = value(t)
    for byte in range(n):
        for bit in range(8):
            u = t.clone()
            u[byte] ^= 1 << bit
            assert value(u) != want, (byte, bit)


def _swapped(words: torch.Tensor, i: int, j: int) -> torch.Tensor:
    out = words.clone()
    out[i], out[j] = words[j].clone(), words[i].clone()
    return out


# words that differ only in their top bits: a linear position-weighted sum misses many of these swaps
HIGH_BIT_DIFFS = [1 << 63, 3 << 62, 0xFFFF << 48, 1 << 44, (1 << 64) - (1 << 20)]


@pytest.mark.parametrize("distance", [1, 2, 3, 4, 8, 1024, 1 << 16])
@pytest.mark.parametrize("diff", HIGH_BIT_DIFFS, ids=hex)
def test_a_swap_of_two_words_differing_in_their_high_bits_changes_it(distance, diff):
    words = torch.zeros(distance + 3, dtype=torch.int64)
    base = 0x0123456789ABCDEF
    words[1] = as_int64(base)
    words[1 + distance] = as_int64(base ^ diff)
    assert value(_swapped(words, 1, 1 + distance)) != value(words)


@given(n=st.integers(2, 300), i=st.integers(0, 299), j=st.integers(0, 299), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.int64, torch.int16]))
def test_a_swap_of_two_different_elements_changes_it(n, i, j, seed, dtype):
    """Elements of 8 bytes (whole words) and of 2 bytes (a bf16 weight's elements: within a word and across)."""
    t = random_bytes(8 * n, seed).view(dtype)
    i, j = i % t.numel(), j % t.numel()
    if t[i] == t[j]:
        t[j] ^= 1
    if i != j:
        assert value(_swapped(t, i, j)) != value(t)


@pytest.mark.parametrize("n", [1, 3, 5, 7, 9, 13, 15, 17, 23, 1001])
def test_a_change_in_the_last_partial_word_changes_it(n):
    t = random_bytes(n, n)
    want = value(t)
    for k in range(1, min(8, n) + 1):  # every byte of the last (partial) words
        u = t.clone()
        u[-k] += 1
        assert value(u) != want, k
    h = torch.randn(n, dtype=torch.bfloat16)  # a bf16 weight whose size is not a multiple of 4 elements
    g = h.clone()
    g[-1] = -h[-1] if h[-1] != 0 else 1.0
    assert value(g) != value(h)


@given(n=st.integers(0, 200), offset=st.integers(0, 40), max_launch=st.sampled_from([16, 32, 48, 1 << 30]),
       stage=st.sampled_from([16, 48, 1 << 26]), seed=st.integers(0, 2**31 - 1))
def test_the_op_reads_every_word_once_at_its_position(n, offset, max_launch, stage, seed):
    """``ops_fingerprint.accumulate`` with the reference standing in for the kernel: every launch gets a 16-byte
    aligned piece and the number of its first word, and their sums add up to the fingerprint."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_fingerprint, "MAX_LAUNCH_BYTES", max_launch)
        mp.setattr(ops_fingerprint, "STAGE_BYTES", stage)
        check_split(random_bytes(offset + n, seed)[offset:], max_launch)


def check_split(b: torch.Tensor, max_launch: int) -> None:
    total = torch.zeros((), dtype=torch.int64)
    seen = []

    def launch(piece, first_word):
        nonlocal total
        assert piece.dtype == torch.uint8 and piece.data_ptr() % 16 == 0 and 0 < piece.numel() <= max_launch
        seen.append((first_word, piece.numel()))
        total = total + fp.reference_words_sum(piece, first_word)

    ops_fingerprint.accumulate(b, launch)
    assert int(total) == value(b)
    pos = 0
    for first_word, length in seen:  # in order, contiguous, each starting on a word boundary
        assert first_word * 8 == pos
        pos += length
    assert pos == b.numel()


def test_the_op_reads_an_8_byte_aligned_tensor_in_place():
    raw = random_bytes(4096, 1)
    start = -raw.data_ptr() % 16  # 16-byte aligned
    for head in (0, 8):
        b = raw[start + head:start + head + 1000]
        plan = ops_fingerprint.pieces(b.data_ptr(), b.numel())
        assert [st for _, _, st in plan] == ([True] if head else []) + [False]
        assert plan[0][:2] == ((0, 8) if head else (0, 1000))


@pytest.mark.parametrize("n", [0, 5, 4096])
def test_the_custom_op_has_a_meta_implementation(n):
    """``torch.ops.moe_quant.fingerprint`` (what ``torch.compile`` would trace) gives an int64 scalar."""
    out = torch.ops.moe_quant.fingerprint(torch.empty(n, dtype=torch.uint8, device="meta"))
    assert out.shape == () and out.dtype == torch.int64 and out.device.type == "meta"
