"""The registry of known MXFP8 activations (``moe_quant.prequantized``) and the numerics it relies on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import mxfp8_grouped_mm, prequantized
from moe_quant import quantize as q
from moe_quant.ep.check import bits_equal


def _counting(monkeypatch):
    calls = [0]
    original = q.fake_rowwise  # the rowwise pass the grouped GEMM runs

    def counting(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    monkeypatch.setattr(q, "fake_rowwise", counting)
    return calls


def _operands(seed=0, m=96, k=64, n=32, e=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(e, n, k, generator=g) * 0.1).bfloat16()
    offs = torch.tensor([20, 20, m], dtype=torch.int32)
    return x, w, offs


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_gemm_reuses_a_known_operand_and_gives_the_same_result(monkeypatch, mode):
    x, w, offs = _operands()
    xq = q.fake_quantize_rowwise(x, mode)  # what a dispatch delivers: dequantized MXFP8 values
    plain = mxfp8_grouped_mm(xq, w.transpose(-2, -1), offs, scale_mode=mode)
    calls = _counting(monkeypatch)
    prequantized.remember(xq, mode)
    assert prequantized.lookup(xq, prequantized.ScaleMode(mode)) is not None  # precondition
    known = mxfp8_grouped_mm(xq, w.transpose(-2, -1), offs, scale_mode=mode)
    assert calls[0] == 0
    assert bits_equal(known, plain)
    other = "floor" if mode == "rceil" else "rceil"
    mxfp8_grouped_mm(xq, w.transpose(-2, -1), offs, scale_mode=other)  # another mode: quantized again
    assert calls[0] == 1


def test_new_storage_at_the_same_address_forgets_the_entry():
    """Storage replaced (``.data =``) by another storage at the same address, same shape, strides, dtype and
    version count: the caching allocator places a new block where a freed one was (reproduced on the CPU with
    ``.data = torch.empty(0)`` then a new tensor of the same size: the lookup was a hit on values that were not
    the remembered dequantization, and the GEMM multiplied them unquantized). Here the same address is made
    without the allocator: a second storage over the same memory (NumPy). The entry is keyed by the storage
    itself (issue 55), so the lookup misses and the GEMM quantizes what it gets."""
    x, w, offs = _operands(2)
    xq = q.fake_quantize_rowwise(x, "rceil")
    prequantized.remember(xq, "rceil")
    version = xq._version
    other = torch.from_numpy(xq.detach().view(torch.int16).numpy()).view(torch.bfloat16)  # same memory
    assert other.untyped_storage().data_ptr() == xq.untyped_storage().data_ptr()  # precondition: same address
    xq.data = other
    other.copy_(x)  # values that are not an MXFP8 dequantization
    assert xq._version == version and tuple(xq.shape) == tuple(x.shape)  # precondition: nothing else tells
    assert prequantized.lookup(xq, prequantized.ScaleMode.RCEIL) is None
    want = mxfp8_grouped_mm(xq.clone(), w.transpose(-2, -1), offs)
    assert bits_equal(mxfp8_grouped_mm(xq, w.transpose(-2, -1), offs), want)


def test_an_in_place_write_forgets_the_entry(monkeypatch):
    x, w, offs = _operands(1)
    xq = q.fake_quantize_rowwise(x, "rceil")
    prequantized.remember(xq, "rceil")
    xq.mul_(2)  # still exact MXFP8 values, but the registry cannot know: version counter bumped
    assert prequantized.lookup(xq, prequantized.ScaleMode.RCEIL) is None
    calls = _counting(monkeypatch)
    mxfp8_grouped_mm(xq, w.transpose(-2, -1), offs)
    assert calls[0] == 1


def test_remember_checks_its_arguments():
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode"):
        prequantized.remember(x, "nearest")
    with pytest.raises(ValueError, match="data and scales"):
        prequantized.remember(x, "rceil", data=torch.zeros(4, 32, dtype=torch.float8_e4m3fn))


@given(seed=st.integers(0, 2**16), mode=st.sampled_from(["rceil", "floor"]), wide=st.booleans())
def test_requantizing_dequantized_values_is_exact(seed, mode, wide):
    """The fallback's safety: 1x32 MXFP8 of already-dequantized 1x32 MXFP8 values gives them back."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g)
    if wide:
        x = x * torch.exp(torch.randn(64, 96, generator=g) * 3)
    once = q.fake_quantize_rowwise(x.bfloat16(), mode)
    assert bits_equal(q.fake_quantize_rowwise(once, mode), once)


def test_wgrad_requantization_of_received_values_equals_direct_rceil():
    """The EP weight gradient's 32x1 operands: re-quantizing the received (1x32-dequantized) values along
    tokens. In RCEIL both roundings keep 3 mantissa bits, so this equals quantizing the bf16 values along
    tokens except for elements ~2^14 below their 1x32 block's amax (subnormal there)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g).bfloat16()
    offs = torch.tensor([100, 256], dtype=torch.int32)
    direct, _ = q.fake_quantize_colwise_k_groups(x, offs, "rceil")
    twice, _ = q.fake_quantize_colwise_k_groups(q.fake_quantize_rowwise(x, "rceil"), offs, "rceil")
    assert bits_equal(direct, twice)
    y = x.clone()
    y[0, 0], y[0, 1] = 1000.0, 0.0123  # 0.0123 is subnormal in its 1x32 block (scale 4), normal along tokens
    direct, _ = q.fake_quantize_colwise_k_groups(y, offs, "rceil")
    twice, _ = q.fake_quantize_colwise_k_groups(q.fake_quantize_rowwise(y, "rceil"), offs, "rceil")
    assert not bits_equal(direct, twice)  # the documented exception exists


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_fused_block_takes_received_tokens_and_output_gradient(monkeypatch, mode):
    """Tokens that arrived in MXFP8 (and an output gradient that did) go to the fused SwiGLU block, which
    takes their received rowwise forms instead of quantizing them: two rowwise passes fewer (x, grad_y),
    and the output and every gradient are the same bits as the block on the same values unregistered.
    (Before, conversion sent received tokens to the per-GEMM path.)"""
    from moe_quant import MXFP8MoEConfig
    from moe_quant import autograd as mq_autograd
    from moe_quant.conversion.experts import block_serves, swiglu_experts

    g = torch.Generator().manual_seed(3)
    m, d, h, e = 96, 64, 64, 3
    w1, w3 = ((torch.randn(e, h, d, generator=g) * 0.1).bfloat16().requires_grad_() for _ in range(2))
    w2 = (torch.randn(e, d, h, generator=g) * 0.1).bfloat16().requires_grad_()
    offs = torch.tensor([20, 20, m], dtype=torch.int32)
    values = q.fake_quantize_rowwise(torch.randn(m, d, generator=g).bfloat16(), mode)
    grad = q.fake_quantize_rowwise(torch.randn(m, d, generator=g).bfloat16(), mode)
    config = MXFP8MoEConfig(scale_mode=mode)
    blocks = [0]
    real_block = mq_autograd.mxfp8_swiglu_experts

    def counting_block(*a, **k):
        blocks[0] += 1
        return real_block(*a, **k)

    monkeypatch.setattr(mq_autograd, "mxfp8_swiglu_experts", counting_block)
    runs = []
    for registered in (False, True):
        x, gy = values.clone().requires_grad_(), grad.clone()
        if registered:
            prequantized.remember(x, mode)
            prequantized.remember(gy, mode)
            assert block_serves(x, w1, w3, w2, offs, config)  # precondition of the count below
        calls = _counting(monkeypatch)
        y = swiglu_experts(x, w1, w3, w2, offs, config)
        y.backward(gy)
        runs.append((calls[0], [y.detach(), x.grad] + [w.grad.clone() for w in (w1, w2, w3)]))
        for w in (w1, w2, w3):
            w.grad = None
    (plain_calls, plain), (known_calls, known) = runs
    assert blocks[0] == 2  # the fused block ran both times
    assert (plain_calls, known_calls) == (5, 3)
    for a, b in zip(plain, known):
        assert bits_equal(a, b)


def test_compiled_gemm_backward_takes_a_known_output_gradient(monkeypatch):
    """Under ``torch.compile`` the per-GEMM path's backward ops run their stages at run time, where an output gradient
    that arrived in MXFP8 (expert parallelism's combine backward) is known: grad_out's dgrad operand is then grad_out
    itself, which its op returns as a copy (an op may not return an input), and the gradients are those of the
    gradient quantized again."""
    x, w, offs = _operands()
    g = torch.Generator().manual_seed(1)
    gy = q.fake_quantize_rowwise(torch.randn(x.shape[0], w.shape[1], generator=g).bfloat16(), "rceil")
    x, w = x.requires_grad_(), w.requires_grad_()
    mxfp8_grouped_mm(x, w.transpose(-2, -1), offs).backward(gy)
    want = [x.grad, w.grad]
    x.grad = w.grad = None
    fn = torch.compile(lambda a, b, o: mxfp8_grouped_mm(a * 1, b.transpose(-2, -1), o), fullgraph=True,
                       backend="aot_eager")
    y = fn(x, w, offs)
    prequantized.remember(gy, "rceil")
    calls = _counting(monkeypatch)
    y.backward(gy)
    assert calls[0] == 0  # precondition: the backward op found gy known (no rowwise pass)
    assert bits_equal(x.grad, want[0]) and bits_equal(w.grad, want[1])
