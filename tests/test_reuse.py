"""reuse_quantized_weights: inside the scope each expert weight is quantized once for all micro-batches;
results equal quantizing every time, bit for bit; on exit a weight that changed raises."""

import copy

import pytest
import torch
from conftest import spy_on
from torchao.quantization import quantize_

import moe_quant.autograd.grouped_mm as gm
from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm, reuse_quantized_weights
from moe_quant.moe import GroupedExperts, TinyMoEModel

EXPERTS = lambda mod, fqn: isinstance(mod, GroupedExperts)  # noqa: E731


def model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = TinyMoEModel(32, 64, 64, 4, 2, 2, 16).to(dtype)
    quantize_(m, MXFP8MoEConfig(), filter_fn=EXPERTS)
    return m


def micro_batches(n=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(48, 32, generator=g).to(dtype) for _ in range(n)]


@pytest.fixture
def weight_quantizations(monkeypatch):
    """How often a weight operand is made (a quantization of a 3-D weight)."""
    return spy_on(monkeypatch, gm.q, "fake_quantize_3d")


def accumulate(m, xs, reuse):
    if reuse:
        with reuse_quantized_weights(m) as scope:
            for x in xs:
                m(x).float().pow(2).mean().backward()
        return scope
    for x in xs:
        m(x).float().pow(2).mean().backward()
    return None


@pytest.mark.parametrize("opt", ["sgd", "adamw_forloop", "adamw_foreach", "adamw_fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_master"])
def test_gradient_accumulation_with_optimizer_steps_equals_no_reuse(opt, dtype, weight_quantizations):
    ref, m = model(dtype), model(dtype)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adamw_forloop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
        "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    }[opt]
    opt_ref, opt_m = make(ref.parameters()), make(m.parameters())
    for step in range(2):
        xs = micro_batches(3, dtype)
        n0 = len(weight_quantizations)
        accumulate(ref, xs, reuse=False)
        n_plain = len(weight_quantizations) - n0
        scope = accumulate(m, xs, reuse=True)
        n_reuse = len(weight_quantizations) - n0 - n_plain
        assert n_reuse * 3 == n_plain  # once per step, not once per micro-batch
        assert scope.hits > 0 and not scope.entries  # operands freed on exit
        for (n, p), q in zip(ref.named_parameters(), m.parameters()):
            assert torch.equal(p.grad, q.grad), (step, n)
        opt_ref.step()
        opt_m.step()
        opt_ref.zero_grad()
        opt_m.zero_grad()
        for p, q in zip(ref.parameters(), m.parameters()):
            assert torch.equal(p, q)


WRITES = {
    "optimizer_step": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).step(),
    "data": lambda m: m.layers[0].moe.experts.w1.data.mul_(2),
    "state_dict": lambda m: m.state_dict()["layers.1.moe.experts.w2"].add_(1),
    "data_assignment": lambda m: setattr(m.layers[0].moe.experts.w3, "data", m.layers[0].moe.experts.w3.data * 2),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_inside_the_scope_raises_on_exit(write):
    m = model()
    xs = micro_batches(2)
    with pytest.raises(RuntimeError, match="changed inside the scope"):
        with reuse_quantized_weights(m):
            m(xs[0]).float().sum().backward()
            with torch.no_grad():
                WRITES[write](m)
            m(xs[1]).float().sum().backward()


def test_an_exception_inside_the_scope_propagates_unchanged():
    m = model()
    with pytest.raises(KeyError, match="mine"):
        with reuse_quantized_weights(m):
            m(micro_batches(1)[0])
            m.layers[0].moe.experts.w1.data.mul_(2)  # would fail the check; the user's error wins
            raise KeyError("mine")


def test_func_and_inference_mode_are_not_served():
    m = model()
    x = micro_batches(1)[0]
    with reuse_quantized_weights(m) as scope:
        with torch.inference_mode():
            m(x)
            m(x)
        params = dict(m.named_parameters())
        torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).float().sum())(
            {n: p.detach() for n, p in params.items()})
    assert scope.hits == 0 and scope.misses == 0


def test_compile_is_not_served():
    m = model()
    x = micro_batches(1)[0]
    compiled = torch.compile(copy.deepcopy(m), backend="aot_eager", fullgraph=True)
    with reuse_quantized_weights(compiled) as scope:
        compiled(x).float().sum().backward()
        compiled(x).float().sum().backward()
    assert scope.hits == 0


def test_direct_calls_on_weight_views():
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(80, 96, dtype=torch.bfloat16)
    offs = torch.tensor([17, 17, 50, 80], dtype=torch.int32)
    ref = mxfp8_grouped_mm(a, w.transpose(-2, -1), offs)
    with reuse_quantized_weights([w]) as scope:
        outs = [mxfp8_grouped_mm(a, w.transpose(-2, -1), offs) for _ in range(3)]
        mxfp8_grouped_mm(a, w[:2].transpose(-2, -1), offs[:2].clamp(max=50))  # another view: its own operand
    assert all(torch.equal(o, ref) for o in outs)
    assert scope.hits == 2 and scope.misses == 2


@pytest.mark.parametrize("bad", [3, torch.zeros(2), [torch.zeros(2), "w"]])
def test_bad_argument(bad):
    with pytest.raises(TypeError, match="model must be"):
        with reuse_quantized_weights(bad):
            pass


def test_exit_fingerprints_each_served_weight_again_and_names_only_the_changed_one(monkeypatch):
    import moe_quant.reuse as reuse

    calls = spy_on(monkeypatch, reuse, "fingerprint")
    m = model()
    with pytest.raises(RuntimeError, match=r"reuse_quantized_weights: 1 weight\(s\) it served changed"):
        with reuse_quantized_weights(m) as scope:
            for x in micro_batches(2):
                m(x).float().sum().backward()
            served = len(scope.served)
            assert len(calls) == served  # at first use only
            with torch.no_grad():
                m.layers[1].moe.experts.w2.data.add_(1)  # one weight, through an alias: only the bytes tell
    assert served == 6 and len(calls) == 2 * served  # w1, w3, w2 of two layers: once more each on exit
