"""Conversion routes the SwiGLU expert modules it knows to the fused block (``mxfp8_swiglu_experts``)
where it serves, and to three MXFP8 grouped GEMMs otherwise; both give the same bits."""

import copy

import pytest
import torch

from moe_quant.conversion import MXFP8MoEConfig, convert, experts as experts_mod, fallback_counts
from moe_quant.moe import GroupedExperts

D, H, E = 64, 96, 4
COUNTS = torch.tensor([40, 0, 57, 31])  # an empty expert, sizes not multiples of 32


def _run(mod, x, counts):
    x = x.detach().clone().requires_grad_()
    out = mod(x, counts)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    return [out.detach(), x.grad] + [p.grad for p in mod.parameters()]


def _fused_equals_unfused(mod, x, counts, block_calls, mxfp8_calls, monkeypatch):
    unfused = copy.deepcopy(mod)
    fused = _run(mod, x, counts)
    assert len(block_calls) == 1 and len(mxfp8_calls) == 3 and not fallback_counts()
    block_calls.clear(), mxfp8_calls.clear()
    monkeypatch.setattr(experts_mod, "block_serves", lambda *a: False)
    ref = _run(unfused, x, counts)
    assert not block_calls and len(mxfp8_calls) == 3 and not fallback_counts()
    assert len(fused) == len(ref) == 5
    for a, b in zip(fused, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_quant_grouped_experts_take_the_block(dtype, block_calls, mxfp8_calls, monkeypatch):
    torch.manual_seed(0)
    mod = convert(GroupedExperts(D, H, E).to(dtype), MXFP8MoEConfig())
    x = torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16)
    if dtype is torch.float32:  # fp32 activations: the per-GEMM path (the block serves bf16 activations)
        _run(mod, x, COUNTS)
        assert not block_calls and len(mxfp8_calls) == 3
        return
    _fused_equals_unfused(mod, x, COUNTS, block_calls, mxfp8_calls, monkeypatch)


def test_torchtitan_grouped_experts_take_the_block(block_calls, mxfp8_calls, monkeypatch):
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts as TitanExperts

    torch.manual_seed(0)
    mod = TitanExperts.Config(dim=D, hidden_dim=H, num_experts=E).build()
    with torch.no_grad():
        for w in mod.parameters():
            w.normal_(std=0.05)
    mod = convert(mod, MXFP8MoEConfig())
    x = torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16)
    _fused_equals_unfused(mod, x, COUNTS, block_calls, mxfp8_calls, monkeypatch)


@pytest.mark.parametrize("cfg", [dict(out_dtype=torch.float32), dict(out_dtype=torch.bfloat16)])
def test_block_only_for_bf16_outputs(cfg, block_calls, mxfp8_calls):
    torch.manual_seed(0)
    mod = convert(GroupedExperts(D, H, E).bfloat16(), MXFP8MoEConfig(**cfg))
    mod(torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16), COUNTS)
    assert len(block_calls) == (cfg["out_dtype"] is torch.bfloat16) and len(mxfp8_calls) == 3


def test_fallback_shapes_keep_the_per_gemm_path_and_count(block_calls):
    """H not a multiple of 32: grouped_mm's counted fallback, never the block."""
    torch.manual_seed(0)
    mod = convert(GroupedExperts(D, 40, E).bfloat16(), MXFP8MoEConfig())
    mod(torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16), COUNTS)
    assert not block_calls and sum(fallback_counts().values()) == 3


def test_func_transforms_keep_the_per_gemm_path(block_calls, mxfp8_calls):
    torch.manual_seed(0)
    mod = convert(GroupedExperts(D, H, E).bfloat16(), MXFP8MoEConfig())
    x = torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16)
    params = dict(mod.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(mod, p, (x, COUNTS)).float().sum())(params)
    assert not block_calls and len(mxfp8_calls) == 3 and set(grads) == set(params)


def test_fused_block_off_takes_the_per_gemm_path_with_the_same_bits(block_calls, mxfp8_calls):
    """``MXFP8MoEConfig(fused_block=False)``: three MXFP8 grouped GEMMs, no block, the block's bits."""
    torch.manual_seed(0)
    fused = convert(GroupedExperts(D, H, E).to(torch.bfloat16), MXFP8MoEConfig())
    per_gemm = convert(copy.deepcopy(fused), MXFP8MoEConfig(fused_block=False))
    x = torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16)
    want = _run(fused, x, COUNTS)
    assert len(block_calls) == 1  # precondition: the default takes the block
    block_calls.clear(), mxfp8_calls.clear()
    got = _run(per_gemm, x, COUNTS)
    assert not block_calls and len(mxfp8_calls) == 3 and not fallback_counts()
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(TypeError, match="fused_block must be a bool"):
        MXFP8MoEConfig(fused_block=1)


def test_dswiglu_cols_fp8_reaches_the_block_with_the_same_bits(monkeypatch):
    """``MXFP8MoEConfig(dswiglu_cols_fp8=...)`` is what the converted experts' block is called with (default False);
    the same bits either way; anything but a bool raises, naming it."""
    from moe_quant import autograd

    seen, real = [], autograd.mxfp8_swiglu_experts
    monkeypatch.setattr(autograd, "mxfp8_swiglu_experts", lambda *a, **k: seen.append(k["dswiglu_cols_fp8"]) or real(*a, **k))
    torch.manual_seed(0)
    off = convert(GroupedExperts(D, H, E).to(torch.bfloat16), MXFP8MoEConfig())
    on = convert(copy.deepcopy(off), MXFP8MoEConfig(dswiglu_cols_fp8=True))
    x = torch.randn(int(COUNTS.sum()), D, dtype=torch.bfloat16)
    for a, b in zip(_run(on, x, COUNTS), _run(off, x, COUNTS)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert seen == [True, False]
    assert not MXFP8MoEConfig().dswiglu_cols_fp8
    with pytest.raises(TypeError, match="dswiglu_cols_fp8 must be a bool, got str"):
        MXFP8MoEConfig(dswiglu_cols_fp8="no")
