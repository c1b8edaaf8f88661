"""The converted torchtitan model's dispatcher computes what torchtitan's own dispatchers compute (issue 32,
item 10: it applied the routing scores in bf16, torchtitan in fp32). Two gloo ranks, torchtitan 0.3.0's
``RoutedExperts`` with converted experts, the same weights, tokens and routing; ours is what
``moe_quant.ep.titan``'s converter installs. Jobs: tests/titan_bits_ranks.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytest.importorskip("torchtitan.models.common.token_dispatcher", reason="torchtitan not importable")
from ep_ranks import run_session  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

JOBS = {
    "local_bf16": ("titan_bits", {"wire": "bf16", "ep": False}),
    "local_mxfp8": ("titan_bits", {"wire": "mxfp8", "ep": False}),
    "ep_bf16": ("titan_bits", {"wire": "bf16", "ep": True}),
    "ep_mxfp8": ("titan_bits", {"wire": "mxfp8", "ep": True}),
    "ep_bf16_uneven": ("titan_bits", {"wire": "bf16", "ep": True, "tokens": (24, 9)}),
    # fp32 activations (torchtitan's experts cast them to bf16): the MXFP8 wire sends their bf16 rounding
    "ep_mxfp8_fp32": ("titan_bits", {"wire": "mxfp8", "ep": True, "dtype": "float32"}),
    "ep_bf16_fp32": ("titan_bits", {"wire": "bf16", "ep": True, "dtype": "float32"}),
}
D = 64  # titan_ranks.D
ALL = ("out", "x_grad", "score_grad", "w1_grad", "w2_grad", "w3_grad")


@pytest.fixture(scope="module")
def bits2():
    names = list(JOBS)
    results = run_session(2, [JOBS[n] for n in names], timeout_s=600.0)
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(names)}


@pytest.mark.parametrize("job", ["local_bf16", "local_mxfp8", "ep_bf16", "ep_bf16_uneven", "ep_bf16_fp32"])
def test_same_bits_as_torchtitans_dispatchers(job, bits2):
    """EP off (vs LocalTokenDispatcher; the wire setting does not apply) and EP with the bf16 wire (vs
    AllToAllTokenDispatcher): output, input gradient, routing-score gradient and the three weight
    gradients, every bit."""
    for r in bits2[job]:
        assert r["rows"] > 0 and r["score_grad_nonzero"], r  # precondition: tokens routed, scores trained
        assert r["equal"] == dict.fromkeys(ALL, True), (job, r)


@pytest.mark.parametrize("job", ["ep_mxfp8", "ep_mxfp8_fp32"])
def test_mxfp8_wire_same_forward_and_input_and_score_grads(job, bits2):
    """EP with the MXFP8 wire vs torchtitan's bf16 all-to-all feeding the same converted experts: the experts
    quantize their inputs 1x32 anyway, so the output, the input gradient and the score gradient are the same
    bits; the weight gradients differ only where the 32x1 re-quantization of received values differs
    (the SQNR bound of tests/test_ep.py). fp32 activations too: torchtitan's experts quantize their bf16 cast,
    which is what the wire sends (issue 55 item 5: it sent the fp32 rows' MXFP8 form, and most outputs
    differed)."""
    for r in bits2[job]:
        assert all(r["equal"][n] for n in ("out", "x_grad", "score_grad")), r
        assert r["dispatch_bytes_per_row"] == D + D // 32, r  # precondition: MXFP8 on the wire
        assert all(r["sqnr"][n] == "inf" or r["sqnr"][n] > 40 for n in ("w1_grad", "w2_grad", "w3_grad")), r


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [2, 6])
def test_combine_equals_local_dispatcher_on_cuda(top_k):
    """On CUDA the sum of a token's top-k rows depends on the order of the adds for top-k > 2: the converted
    model's dispatcher (EP off) sums with torchtitan's deterministic scatter_add, so its combine (output,
    expert-output and score gradients) equals LocalTokenDispatcher's bit for bit, at DeepSeek-V3's top-k too."""
    import torch
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    from moe_quant.ep.titan import dispatcher_class, dispatcher_config

    e, t, d = 64, 4096, 512
    g = torch.Generator(device="cuda").manual_seed(top_k)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g)
    scores, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    grad = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ours = dispatcher_class()(dispatcher_config(num_experts=e, top_k=top_k))
    theirs = LocalTokenDispatcher(LocalTokenDispatcher.Config(num_experts=e, top_k=top_k))
    res = []
    for disp in (ours, theirs):
        s = scores.clone().requires_grad_()
        routed, _, meta = disp.dispatch(x, s, ids, counts)
        routed = (routed.float() * 1.5 - 0.25).bfloat16().requires_grad_()
        out = disp.combine(routed, meta, x)
        res.append([out, *torch.autograd.grad(out, (routed, s), grad)])
    for name, a, b in zip(("output", "expert-output grad", "score grad"), *res):
        assert torch.equal(a, b), name
