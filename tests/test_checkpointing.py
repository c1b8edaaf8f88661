"""Activation checkpointing around a converted MoE block: non-reentrant
``torch.utils.checkpoint`` and selective activation checkpointing (SAC) give the same
gradients as the plain run, and really recompute."""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torchao.quantization import quantize_

from moe_quant.conversion import MXFP8MoEConfig, fallback_counts, is_converted, reset_fallback_counts
from moe_quant.moe import MoELayer

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 64, 96, 4, 2, 192


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    layer = MoELayer(DIM, HIDDEN, EXPERTS, TOP_K).to(torch.bfloat16)
    quantize_(layer, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    assert is_converted(layer.moe.experts)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    g = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    return layer, x, g


def run(layer, x, g, wrap, count_calls=True):
    calls = []
    hook = layer.moe.experts.register_forward_pre_hook(lambda mod, inp: calls.append(1)) if count_calls else None
    try:
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = wrap(xx)
        out.backward(g)
    finally:
        if hook is not None:
            hook.remove()
    grads = {"out": out.detach(), "x": xx.grad}
    grads.update({n: p.grad.clone() for n, p in layer.named_parameters()})
    return grads, len(calls)


def assert_same(ref, other):
    assert ref.keys() == other.keys()
    for name in ref:
        assert torch.equal(ref[name], other[name]), name


def test_checkpoint_non_reentrant(setup):
    layer, x, g = setup
    reset_fallback_counts()
    ref, n_ref = run(layer, x, g, layer)
    ck, n_ck = run(layer, x, g, lambda xx: checkpoint(layer, xx, use_reentrant=False))
    assert (n_ref, n_ck) == (1, 2)  # the experts ran again in backward
    assert_same(ref, ck)
    assert not fallback_counts()


@pytest.mark.parametrize("save", ["grouped_mm", "nothing"])
def test_selective_activation_checkpointing(setup, save):
    layer, x, g = setup
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        if save == "grouped_mm" and op is torch.ops.aten._grouped_mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    ref, _ = run(layer, x, g, layer)
    sac, n_sac = run(layer, x, g, lambda xx: checkpoint(layer, xx, use_reentrant=False, context_fn=context_fn))
    assert n_sac == 2
    assert torch.ops.aten._grouped_mm.default in seen  # the MXFP8 GEMMs went through the policy
    assert_same(ref, sac)


@pytest.mark.parametrize("selective", [False, True])
def test_checkpoint_under_compile_fullgraph(setup, selective):
    from torch._dynamo.testing import CompileCounterWithBackend

    layer, x, g = setup

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten._grouped_mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} if selective else {}
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda xx: checkpoint(layer, xx, use_reentrant=False, **kwargs), backend=counter, fullgraph=True
    )
    ref, _ = run(layer, x, g, layer)
    got, _ = run(layer, x, g, compiled, count_calls=False)  # a hook's side effect would break the graph
    assert counter.frame_count == 1
    assert_same(ref, got)


# -- issue 55 items 2 and 3: every route recomputes the same MXFP8 GEMMs, reentrant or not --------------------


def _wrap(fn, how):
    """``fn`` under activation checkpointing: reentrant, non-reentrant, or selective (every grouped_mm saved)."""
    if how == "none":
        return fn
    if how == "sac":
        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten._grouped_mm.default else \
                CheckpointPolicy.PREFER_RECOMPUTE

        return lambda *a: checkpoint(fn, *a, use_reentrant=False,
                                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    return lambda *a: checkpoint(fn, *a, use_reentrant=how == "reentrant")


def test_checkpoint_reentrant(setup, mxfp8_calls):
    layer, x, g = setup
    ref, _ = run(layer, x, g, layer)
    n = len(mxfp8_calls)
    ck, n_ck = run(layer, x, g, _wrap(layer, "reentrant"))
    assert n_ck == 2 and len(mxfp8_calls) == 3 * n  # the experts ran again in backward, in MXFP8
    assert_same(ref, ck)


def _titan_block():
    moe = pytest.importorskip("torchtitan.models.common.moe")
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    torch.manual_seed(0)
    block = moe.RoutedExperts.Config(
        inner_experts=moe.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K)).build()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.05)
    quantize_(block, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, moe.GroupedExperts))
    assert is_converted(block.inner_experts)
    return block.to(torch.bfloat16)


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "sac"])
def test_torchtitan_experts_recompute_the_same_mxfp8_gemms(how, mxfp8_calls):
    """torchtitan's RoutedExperts (its local dispatcher) with converted GroupedExperts under checkpointing: output,
    input, score and weight gradients equal the run without it, bit for bit; the recompute ran MXFP8 GEMMs."""
    block = _titan_block()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, TOKENS, DIM, generator=g).bfloat16()
    scores, ids = torch.topk(torch.randn(TOKENS, EXPERTS, generator=g).softmax(-1), TOP_K, dim=-1)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    gout = torch.randn(1, TOKENS, DIM, generator=g).bfloat16()

    def step(wrap):
        block.zero_grad(set_to_none=True)
        xx, ss = x.clone().requires_grad_(), scores.view(1, TOKENS, TOP_K).clone().requires_grad_()
        out = wrap(lambda a, s: block(a, s, ids.view(1, TOKENS, TOP_K), counts))(xx, ss)
        out.backward(gout)
        return [out.detach(), xx.grad, ss.grad] + [p.grad.clone() for p in block.parameters()]

    ref = step(lambda f: f)
    n = len(mxfp8_calls)
    got = step(lambda f: _wrap(f, how))
    assert n == 3 and len(mxfp8_calls) == 3 * n  # forward, then forward and recompute
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("route", ["quantize_", "experts_implementation"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_transformers_gradient_checkpointing_recomputes_the_same_mxfp8_gemms(route, reentrant, tmp_path, mxfp8_calls):
    """A transformers MoE model (Qwen3-MoE, two MoE layers) converted either way, trained with transformers'
    activation checkpointing (``activation_checkpointing_enable``, 5.23's ``gradient_checkpointing_enable``): loss
    and every gradient equal the run without it, bit for bit."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import moe_quant
    from examples.hf_train import EXPERTS_FILTER, build_config, build_model

    config = build_config("qwen3_moe", hidden=64, intermediate=32, experts=8, top_k=2, layers=2, vocab=128)
    model = build_model(config, seed=1)  # fp32: two MXFP8 grouped GEMMs per MoE layer, each counted
    if route == "quantize_":
        quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    else:
        model.save_pretrained(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path,
                                                     experts_implementation=moe_quant.register_experts_implementation())
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = step()
    n = len(mxfp8_calls)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    got = step()
    assert n == 2 * 2 and len(mxfp8_calls) == 3 * n and not fallback_counts()  # the recompute ran MXFP8 GEMMs
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
