"""Every public function rejects bad arguments before any work with a TypeError / ValueError
that names the argument (docs/design.md section 8), and parses scale modes the same way everywhere.

The table below is the contract: one row per (function, bad argument) with the exception type
and the argument name the message must contain. Hypothesis covers the size arguments.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mx_strategies import make_values

import moe_quant as mq
from moe_quant import layouts
from moe_quant.conversion import convert, converted_class
from moe_quant.ep import MXFP8TokenDispatcher
from moe_quant.moe import EPMoE

BF16 = torch.bfloat16
I32 = torch.int32


def _x(m=4, k=64, dtype=BF16):
    return torch.randn(m, k).to(dtype)


def _offs(*v):
    return torch.tensor(v, dtype=I32)


def _scales(rows, cols):
    return torch.randint(0, 255, (rows, cols), dtype=torch.uint8)


def _enter(cm):
    with cm:
        pass


def _dispatcher(**kw):
    return MXFP8TokenDispatcher(4, 2, **kw)


def _data_and_scales(m=4, k=64):
    return mq.to_mxfp8(_x(m, k))


def _block(x=None, w1=None, w3=None, w2=None, offs=None, **kw):
    """``mq.mxfp8_swiglu_experts`` on a valid (M=8, D=64, H=32, E=2) block with one argument replaced."""
    w = lambda *s: torch.randn(*s, dtype=BF16) * 0.1  # noqa: E731
    return mq.mxfp8_swiglu_experts(_x(8, 64) if x is None else x, w(2, 32, 64) if w1 is None else w1,
                                   w(2, 32, 64) if w3 is None else w3, w(2, 64, 32) if w2 is None else w2,
                                   _offs(4, 8) if offs is None else offs, **kw)


# (id, call, exception, argument name the message must contain)
CASES = [
    # ---- mxfp8_swiglu_experts
    ("block x fp16", lambda: _block(x=_x(8, 64, torch.float16)), TypeError, "x"),
    ("block x 1-D", lambda: _block(x=torch.randn(64, dtype=BF16)), ValueError, "x"),
    ("block w1 D mismatch", lambda: _block(w1=torch.randn(2, 32, 96, dtype=BF16)), ValueError, "w1"),
    ("block w3 shape", lambda: _block(w3=torch.randn(2, 64, 64, dtype=BF16)), ValueError, "w3"),
    ("block w2 not swapped", lambda: _block(w2=torch.randn(2, 32, 64, dtype=BF16)), ValueError, "w2"),
    ("block H 48", lambda: _block(w1=torch.randn(2, 48, 64, dtype=BF16), w3=torch.randn(2, 48, 64, dtype=BF16),
                                  w2=torch.randn(2, 64, 48, dtype=BF16)), ValueError, "w1"),
    ("block D 48", lambda: _block(x=_x(8, 48), w1=torch.randn(2, 32, 48, dtype=BF16),
                                  w3=torch.randn(2, 32, 48, dtype=BF16), w2=torch.randn(2, 48, 32, dtype=BF16)),
     ValueError, "x"),
    ("block w2 int", lambda: _block(w2=torch.ones(2, 64, 32, dtype=torch.int32)), TypeError, "w2"),
    ("block offs int64", lambda: _block(offs=torch.tensor([4, 8])), TypeError, "offs"),
    ("block offs length", lambda: _block(offs=_offs(8)), ValueError, "offs"),
    ("block offs past M", lambda: _block(offs=_offs(4, 9)), ValueError, "offs"),
    ("block scale_mode", lambda: _block(scale_mode="round"), ValueError, "scale_mode"),
    ("block backend", lambda: _block(backend="fast"), ValueError, "backend"),
    # ---- to_mxfp8
    ("to_mxfp8 last dim 33", lambda: mq.to_mxfp8(_x(4, 33)), ValueError, "x"),
    ("to_mxfp8 last dim 16", lambda: mq.to_mxfp8(_x(4, 16)), ValueError, "x"),
    ("to_mxfp8 0-d", lambda: mq.to_mxfp8(torch.tensor(1.0)), ValueError, "x"),
    ("to_mxfp8 list", lambda: mq.to_mxfp8([1.0] * 32), TypeError, "x"),
    ("to_mxfp8 int", lambda: mq.to_mxfp8(torch.ones(2, 32, dtype=torch.int32)), TypeError, "x"),
    ("to_mxfp8 bool", lambda: mq.to_mxfp8(torch.ones(2, 32, dtype=torch.bool)), TypeError, "x"),
    ("to_mxfp8 complex", lambda: mq.to_mxfp8(torch.ones(2, 32, dtype=torch.complex64)), TypeError, "x"),
    ("to_mxfp8 mode", lambda: mq.to_mxfp8(_x(), scale_mode="garbage"), ValueError, "scale_mode"),
    ("to_mxfp8 mode type", lambda: mq.to_mxfp8(_x(), scale_mode=1), ValueError, "scale_mode"),
    # ---- from_mxfp8
    (
        "from_mxfp8 broadcastable scales",
        lambda: mq.from_mxfp8(_data_and_scales()[0], _data_and_scales()[1][:1]),
        ValueError,
        "scales",
    ),
    (
        "from_mxfp8 scales too wide",
        lambda: mq.from_mxfp8(_data_and_scales(4, 64)[0], _data_and_scales(4, 96)[1]),
        ValueError,
        "scales",
    ),
    ("from_mxfp8 bf16 data", lambda: mq.from_mxfp8(_x(), _data_and_scales()[1]), TypeError, "data"),
    (
        "from_mxfp8 e5m2 data",
        lambda: mq.from_mxfp8(_data_and_scales()[0].view(torch.float8_e5m2), _data_and_scales()[1]),
        TypeError,
        "data",
    ),
    ("from_mxfp8 list data", lambda: mq.from_mxfp8([0] * 32, _data_and_scales()[1]), TypeError, "data"),
    (
        "from_mxfp8 bf16 scales",
        lambda: mq.from_mxfp8(_data_and_scales()[0], _data_and_scales()[1].float().to(BF16)),
        TypeError,
        "scales",
    ),
    (
        "from_mxfp8 fp8 out_dtype",
        lambda: mq.from_mxfp8(*_data_and_scales(), out_dtype=torch.float8_e4m3fn),
        TypeError,
        "out_dtype",
    ),
    ("from_mxfp8 int out_dtype", lambda: mq.from_mxfp8(*_data_and_scales(), out_dtype=torch.int32), TypeError, "out_dtype"),
    (
        "from_mxfp8 scales on another device",
        lambda: mq.from_mxfp8(_data_and_scales()[0], _data_and_scales()[1].to("meta")),
        ValueError,
        "scales",
    ),
    # ---- quantize_rowwise / fake_quantize_rowwise
    ("quantize_rowwise mode", lambda: mq.quantize_rowwise(_x(), "garbage"), ValueError, "mode"),
    ("quantize_rowwise list", lambda: mq.quantize_rowwise([[0.0] * 32], "rceil"), TypeError, "x"),
    ("quantize_rowwise int", lambda: mq.quantize_rowwise(_x(dtype=torch.int32), "rceil"), TypeError, "x"),
    ("quantize_rowwise 3-D", lambda: mq.quantize_rowwise(_x().view(1, 4, 64), "rceil"), ValueError, "x"),
    ("quantize_rowwise K=48", lambda: mq.quantize_rowwise(_x(4, 48), "rceil"), ValueError, "x"),
    ("quantize_rowwise offs int64", lambda: mq.quantize_rowwise(_x(), "rceil", torch.tensor([4])), TypeError, "offs"),
    ("quantize_rowwise offs 2-D", lambda: mq.quantize_rowwise(_x(), "rceil", _offs(2, 4).view(1, 2)), ValueError, "offs"),
    ("quantize_rowwise offs list", lambda: mq.quantize_rowwise(_x(), "rceil", [4]), TypeError, "offs"),
    ("fake_quantize_rowwise mode", lambda: mq.fake_quantize_rowwise(_x(), "nearest"), ValueError, "mode"),
    ("fake_quantize_rowwise K=33", lambda: mq.fake_quantize_rowwise(_x(4, 33), "floor"), ValueError, "x"),
    (
        "fake_quantize_rowwise fp8 out_dtype",
        lambda: mq.fake_quantize_rowwise(_x(), "floor", torch.float8_e4m3fn),
        TypeError,
        "out_dtype",
    ),
    # ---- quantize_colwise_k_groups
    ("k_groups 1-D x", lambda: mq.quantize_colwise_k_groups(torch.randn(64), _offs(64), "rceil"), ValueError, "x"),
    ("k_groups int x", lambda: mq.quantize_colwise_k_groups(_x(dtype=torch.int32), _offs(4), "rceil"), TypeError, "x"),
    ("k_groups offs None", lambda: mq.quantize_colwise_k_groups(_x(), None, "rceil"), TypeError, "offs"),
    ("k_groups offs int64", lambda: mq.quantize_colwise_k_groups(_x(), torch.tensor([4]), "rceil"), TypeError, "offs"),
    ("k_groups mode", lambda: mq.quantize_colwise_k_groups(_x(), _offs(4), "RCEIL2"), ValueError, "mode"),
    # ---- quantize_3d
    ("quantize_3d 2-D w", lambda: mq.quantize_3d(_x(), "rceil", "k"), ValueError, "w"),
    ("quantize_3d int w", lambda: mq.quantize_3d(torch.ones(2, 32, 32, dtype=torch.int32), "rceil", "k"), TypeError, "w"),
    ("quantize_3d along", lambda: mq.quantize_3d(torch.randn(2, 32, 32), "rceil", "m"), ValueError, "along"),
    ("quantize_3d along None", lambda: mq.quantize_3d(torch.randn(2, 32, 32), "rceil", None), ValueError, "along"),
    ("quantize_3d K=48 along k", lambda: mq.quantize_3d(torch.randn(2, 32, 48), "rceil", "k"), ValueError, "w"),
    ("quantize_3d N=48 along n", lambda: mq.quantize_3d(torch.randn(2, 48, 32), "rceil", "n"), ValueError, "w"),
    ("quantize_3d mode", lambda: mq.quantize_3d(torch.randn(2, 32, 32), "garbage", "k"), ValueError, "mode"),
    # ---- mxfp8_grouped_mm (the rest is in test_grouped_mm.py)
    (
        "grouped_mm validate_offsets",
        lambda: mq.mxfp8_grouped_mm(_x(64, 64), torch.randn(2, 64, 32, dtype=BF16), _offs(32, 64), validate_offsets="yes"),
        TypeError,
        "validate_offsets",
    ),
    (
        "grouped_mm out_dtype",
        lambda: mq.mxfp8_grouped_mm(_x(64, 64), torch.randn(2, 64, 32, dtype=BF16), _offs(32, 64), out_dtype=torch.int8),
        TypeError,
        "out_dtype",
    ),
    # ---- layouts
    ("to_blocked 1-D", lambda: mq.to_blocked(torch.zeros(8, dtype=torch.uint8)), ValueError, "scales"),
    ("to_blocked 3-D", lambda: mq.to_blocked(torch.zeros(1, 8, 4, dtype=torch.uint8)), ValueError, "scales"),
    ("to_blocked list", lambda: mq.to_blocked([[0]]), TypeError, "scales"),
    ("to_blocked float", lambda: mq.to_blocked(torch.zeros(2, 2)), TypeError, "scales"),
    ("from_blocked rows too many", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), 129, 4), ValueError, "blocked"),
    ("from_blocked cols too many", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), 5, 5), ValueError, "blocked"),
    ("from_blocked negative rows", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), -1, 4), ValueError, "rows"),
    ("from_blocked float rows", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), 5.0, 4), TypeError, "rows"),
    ("from_blocked bool cols", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), 5, True), TypeError, "cols"),
    ("from_blocked str cols", lambda: mq.from_blocked(mq.to_blocked(_scales(5, 4)), 5, "4"), TypeError, "cols"),
    ("from_blocked 3-D", lambda: mq.from_blocked(torch.zeros(1, 128, 4, dtype=torch.uint8), 5, 4), ValueError, "blocked"),
    ("to_blocked_3d 2-D", lambda: mq.to_blocked_3d(_scales(5, 4)), ValueError, "scales"),
    ("from_blocked_3d rows", lambda: mq.from_blocked_3d(mq.to_blocked_3d(_scales(5, 4)[None]), 200, 4), ValueError, "blocked"),
    ("from_blocked_3d 3-D", lambda: mq.from_blocked_3d(torch.zeros(1, 128, 4, dtype=torch.uint8), 5, 4), ValueError, "blocked"),
    ("from_blocked_3d negative cols", lambda: mq.from_blocked_3d(torch.zeros(1, 512, dtype=torch.uint8), 5, -4), ValueError, "cols"),
    ("to_blocked_m_groups offs int64", lambda: mq.to_blocked_m_groups(_scales(8, 2), torch.tensor([8])), TypeError, "offs"),
    ("to_blocked_m_groups offs 0-d", lambda: mq.to_blocked_m_groups(_scales(8, 2), torch.tensor(8, dtype=I32)), ValueError, "offs"),
    ("to_blocked_m_groups 1-D scales", lambda: mq.to_blocked_m_groups(torch.zeros(8, dtype=torch.uint8), _offs(8)), ValueError, "scales"),
    (
        "from_blocked_m_groups m mismatch",
        lambda: mq.from_blocked_m_groups(mq.to_blocked_m_groups(_scales(8, 2), _offs(8)), _offs(8), 9, 2),
        ValueError,
        "blocked",
    ),
    (
        "from_blocked_m_groups G mismatch",
        lambda: mq.from_blocked_m_groups(mq.to_blocked_m_groups(_scales(8, 2), _offs(8)), _offs(4, 8), 8, 2),
        ValueError,
        "blocked",
    ),
    (
        "from_blocked_m_groups negative m",
        lambda: mq.from_blocked_m_groups(torch.zeros(128, 4, dtype=torch.uint8), _offs(0), -1, 2),
        ValueError,
        "m",
    ),
    (
        "to_blocked_k_groups scales width",
        lambda: mq.to_blocked_k_groups(_scales(7, 4), _offs(40), 40),  # (round_up(40, 32) + 32) / 32 = 3 columns
        ValueError,
        "scales",
    ),
    ("to_blocked_k_groups str m", lambda: mq.to_blocked_k_groups(_scales(7, 3), _offs(40), "40"), TypeError, "m"),
    (
        "from_blocked_k_groups rows mismatch",
        lambda: mq.from_blocked_k_groups(torch.zeros(128, 6, dtype=torch.uint8), _offs(40), 129, 40),
        ValueError,
        "blocked",
    ),
    ("padded_group_offsets 2-D", lambda: mq.padded_group_offsets(_offs(4, 8).view(2, 1), 8), ValueError, "offs"),
    ("padded_group_offsets list", lambda: mq.padded_group_offsets([4, 8], 8), TypeError, "offs"),
    ("padded_group_offsets int64", lambda: mq.padded_group_offsets(torch.tensor([4, 8]), 8), TypeError, "offs"),
    ("padded_group_offsets negative total", lambda: mq.padded_group_offsets(_offs(4, 8), -8), ValueError, "total"),
    ("padded_group_offsets float total", lambda: mq.padded_group_offsets(_offs(4, 8), 8.5), TypeError, "total"),
    ("padded_group_offsets zero align", lambda: mq.padded_group_offsets(_offs(4, 8), 8, 0), ValueError, "align"),
    ("padded_group_offsets float align", lambda: mq.padded_group_offsets(_offs(4, 8), 8, 32.0), TypeError, "align"),
    # ---- conversion and weight reuse
    ("convert config", lambda: convert(torch.nn.Linear(2, 2), "rceil"), TypeError, "config"),
    ("convert None", lambda: convert(None, mq.MXFP8MoEConfig()), TypeError, "module"),
    ("unconvert None", lambda: mq.unconvert(None), TypeError, "module"),
    ("unconvert a tensor", lambda: mq.unconvert(torch.zeros(2)), TypeError, "module"),
    ("converted_class of an instance", lambda: converted_class(torch.nn.Linear(2, 2)), TypeError, "cls"),
    ("reuse_quantized_weights int", lambda: _enter(mq.reuse_quantized_weights(3)), TypeError, "model"),
    ("reuse_quantized_weights tensor", lambda: _enter(mq.reuse_quantized_weights(torch.zeros(2))), TypeError, "model"),
    # ---- expert parallelism (rejected when built: no process group needed)
    ("dispatcher capacity_factor 0", lambda: _dispatcher(capacity_factor=0), ValueError, "capacity_factor"),
    ("dispatcher overflow", lambda: _dispatcher(capacity_factor=1.0, overflow="ignore"), ValueError, "overflow"),
    ("dispatcher max_tokens synced", lambda: _dispatcher(max_tokens=8), ValueError, "max_tokens"),
    ("dispatcher max_tokens 0", lambda: _dispatcher(capacity_factor=1.0, max_tokens=0), ValueError, "max_tokens"),
    ("dispatcher max_tokens bool", lambda: _dispatcher(capacity_factor=1.0, max_tokens=True), TypeError, "max_tokens"),
    ("dispatcher max_tokens float", lambda: _dispatcher(capacity_factor=1.0, max_tokens=8.0), TypeError, "max_tokens"),
    ("dispatcher transport", lambda: _dispatcher(transport="nvshmem"), ValueError, "transport"),
    ("dispatcher chunks 0", lambda: _dispatcher(transport="p2p", chunks=0), ValueError, "chunks"),
    ("dispatcher chunks float", lambda: _dispatcher(transport="p2p", chunks=2.0), TypeError, "chunks"),
    ("dispatcher chunks all_to_all", lambda: _dispatcher(chunks=2), ValueError, "chunks"),
    ("dispatcher sm_carveout negative", lambda: _dispatcher(transport="p2p", chunks=2, sm_carveout=-1), ValueError,
     "sm_carveout"),
    ("dispatcher sm_carveout float", lambda: _dispatcher(transport="p2p", chunks=2, sm_carveout=8.0), TypeError,
     "sm_carveout"),
    ("EPMoE max_tokens negative", lambda: EPMoE(64, 96, 4, 2, capacity_factor=1.0, max_tokens=-1), ValueError,
     "max_tokens"),
]


def _names_argument(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) is not None


@pytest.mark.parametrize("call, exc, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_raises_clear_error(call, exc, name):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    assert _names_argument(str(info.value), name), f"message does not name {name!r}: {info.value}"


# ----------------------------------------------------------------------------- sizes (hypothesis)


@given(k=st.integers(1, 300), lead=st.lists(st.integers(0, 3), max_size=2))
def test_to_mxfp8_last_dim_must_be_whole_blocks(k, lead):
    x = torch.zeros(*lead, k)
    if k % 32:
        with pytest.raises(ValueError, match=r"\bx\b.*multiple of 32"):
            mq.to_mxfp8(x)
    else:
        data, scales = mq.to_mxfp8(x)
        assert data.shape == x.shape and scales.shape == (*lead, k // 32)


@given(
    rows=st.integers(1, 300), cols=st.integers(1, 12), rows2=st.integers(0, 300), cols2=st.integers(0, 12)
)
def test_from_blocked_rejects_sizes_of_another_layout(rows, cols, rows2, cols2):
    b = mq.to_blocked(_scales(rows, cols))
    if layouts.blocked_shape(rows2, cols2) == layouts.blocked_shape(rows, cols):
        back = mq.from_blocked(b, rows2, cols2)  # same buffer: any (rows2, cols2) it holds reads back
        assert back.shape == (rows2, cols2)
        r, c = min(rows, rows2), min(cols, cols2)
        assert torch.equal(back[:r, :c], mq.from_blocked(b, rows, cols)[:r, :c])
    else:
        with pytest.raises(ValueError, match="blocked"):
            mq.from_blocked(b, rows2, cols2)
    # the 3D layout stores each expert's tiles flat: only the byte count can be checked
    b3 = mq.to_blocked_3d(_scales(rows, cols)[None])
    rp, cp = layouts.blocked_shape(rows2, cols2)
    if rp * cp == b3.shape[1]:
        assert mq.from_blocked_3d(b3, rows2, cols2).shape == (1, rows2, cols2)
    else:
        with pytest.raises(ValueError, match="blocked"):
            mq.from_blocked_3d(b3, rows2, cols2)


@given(size=st.integers(-(2**40), -1), which=st.sampled_from(["rows", "cols"]))
def test_negative_sizes_are_rejected(size, which):
    b = mq.to_blocked(_scales(5, 4))
    kw = {"rows": 5, "cols": 4, which: size}
    with pytest.raises(ValueError, match=which):
        mq.from_blocked(b, **kw)


@given(k=st.integers(1, 6).map(lambda n: 32 * n), rows=st.integers(1, 6))
def test_from_mxfp8_scales_must_match_exactly(k, rows):
    data, scales = mq.to_mxfp8(torch.randn(rows, k))
    assert torch.equal(mq.from_mxfp8(data, scales), mq.from_mxfp8(data, scales.view(torch.uint8)))
    for bad in (scales[:, :1], scales[:1], scales.unsqueeze(0), scales.reshape(-1)):
        if bad.shape == scales.shape:
            continue
        with pytest.raises(ValueError, match="scales"):
            mq.from_mxfp8(data, bad)


# ----------------------------------------------------------------------------- scale modes: parsed, never FLOOR by accident


def _rceil_differs_from_floor():
    """Every block's amax is 1000: RCEIL scale 2^2 (1000/448 = 2.23 rounds up to 4), FLOOR
    2^(floor(log2 1000) - 8) = 2^1, so the two modes give different scales and data everywhere."""
    x = make_values((64, 128), "normal", 7, torch.float32)
    x[:, ::32] = 1000.0
    return x.to(BF16)


def _as_bytes(out):
    return [t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t for t in out]


QUANTIZERS = {
    "quantize_rowwise": lambda x, mode: mq.quantize_rowwise(x, mode),
    "quantize_rowwise_offs": lambda x, mode: mq.quantize_rowwise(x, mode, _offs(10, 10, 64)),
    "fake_quantize_rowwise": lambda x, mode: (mq.fake_quantize_rowwise(x, mode),),
    "quantize_colwise_k_groups": lambda x, mode: mq.quantize_colwise_k_groups(x, _offs(10, 10, 64), mode),
    "quantize_3d_k": lambda x, mode: mq.quantize_3d(x.view(2, 32, 128), mode, "k"),
    "quantize_3d_n": lambda x, mode: mq.quantize_3d(x.view(2, 32, 128), mode, "n"),
    "to_mxfp8": lambda x, mode: mq.to_mxfp8(x, mode),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_string_modes_mean_what_they_say(name):
    fn = QUANTIZERS[name]
    x = _rceil_differs_from_floor()
    rceil = _as_bytes(fn(x, mq.ScaleMode.RCEIL))
    floor = _as_bytes(fn(x, mq.ScaleMode.FLOOR))
    assert any(not torch.equal(r, f) for r, f in zip(rceil, floor)), "test data must tell the modes apart"
    for spelling, want in (("rceil", rceil), ("RCEIL", rceil), ("floor", floor), ("Floor", floor)):
        got = _as_bytes(fn(x, spelling))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), spelling
