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
