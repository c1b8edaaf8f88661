"""Opt-in reuse of quantized weights (moe_quant.weight_cache): same results as quantizing every call,
reuse only while the weight is unchanged, nothing kept for freed weights."""

import copy
import gc

import pytest
import torch
from mx_strategies import offsets_from_sizes

from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm, weight_cache
from moe_quant.conversion import MXFP8ExpertWeight
from moe_quant.moe import MoE


def problem(seed=0, sizes=(40, 0, 72, 32)):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    A = torch.randn(m, 128, generator=g).bfloat16().requires_grad_()
    W = (torch.randn(len(sizes), 64, 128, generator=g) / 11).bfloat16().requires_grad_()
    go = torch.randn(m, 64, generator=g).bfloat16()
    return A, W, go, offsets_from_sizes(list(sizes))


def step(A, W, go, offs, cache):
    A.grad = W.grad = None
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, weight_cache=cache)
    out.backward(go)
    return out.detach(), A.grad.clone(), W.grad.clone()


def assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_reuse_while_unchanged_and_recompute_after_an_update():
    A, W, go, offs = problem()
    cache = weight_cache.cache_for(W)
    first = step(A, W, go, offs, cache)
    assert (cache.hits, cache.misses) == (0, 2)  # fwd (along K) and dgrad (along N)
    again = step(A, W, go, offs, cache)
    assert (cache.hits, cache.misses) == (2, 2)
    assert_same(first, again)
    assert_same(first, step(A, W, go, offs, None))
    with torch.no_grad():
        W.mul_(1.5)  # an in-place update bumps the version counter
    updated = step(A, W, go, offs, cache)
    assert (cache.hits, cache.misses) == (2, 4)
    assert_same(updated, step(A, W, go, offs, None))
    assert not torch.equal(updated[0], first[0])


def test_same_cache_for_every_view_of_a_weight_and_type_checked():
    _, W, _, _ = problem()
    assert weight_cache.cache_for(W) is weight_cache.cache_for(W.transpose(-2, -1))
    A, W, go, offs = problem()
    with pytest.raises(TypeError, match="weight_cache"):
        mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, weight_cache="yes")


def test_inference_mode_bypasses_the_cache():
    A, W, _, offs = problem()
    cache = weight_cache.cache_for(W)
    with torch.inference_mode():
        mxfp8_grouped_mm(A.detach(), W.detach().transpose(-2, -1), offs, weight_cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 0, 0)


def test_freed_weights_leave_no_cache_behind():
    before = len(weight_cache._CACHES)
    A, W, go, offs = problem()
    step(A, W, go, offs, weight_cache.cache_for(W))
    assert len(weight_cache._CACHES) == before + 1
    del A, W, go, offs
    gc.collect()
    assert len(weight_cache._CACHES) == before


def test_converted_model_gradient_accumulation_matches_uncached():
    """Two micro-batches then an optimizer step, twice: bit-identical to the uncached model, and the
    weights are quantized once per step (cache hits on the second micro-batch)."""
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    base = MoE(dim=64, hidden_dim=96, num_experts=4, top_k=2).bfloat16()
    models = {}
    for cached in (False, True):
        m = copy.deepcopy(base)
        quantize_(m, MXFP8MoEConfig(cache_quantized_weights=cached), filter_fn=lambda mod, fqn: "experts" in fqn)
        models[cached] = (m, torch.optim.SGD(m.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 16, 64, generator=g).bfloat16() for _ in range(4)]
    for s in range(2):
        for cached, (m, opt) in models.items():
            opt.zero_grad()
            for x in batches[2 * s: 2 * s + 2]:
                m(x).float().pow(2).mean().backward()
            opt.step()
    (m0, _), (m1, _) = models[False], models[True]
    for (n0, p0), (n1, p1) in zip(m0.named_parameters(), m1.named_parameters()):
        assert n0 == n1
        assert torch.equal(p0.detach().float(), p1.detach().float()), n0
    caches = [weight_cache.cache_for(p) for p in m1.parameters() if isinstance(p, MXFP8ExpertWeight)]
    assert caches and all(c.hits > 0 for c in caches), caches


def test_config_flag_is_checked():
    with pytest.raises(TypeError, match="cache_quantized_weights"):
        MXFP8MoEConfig(cache_quantized_weights="yes")
