"""Experts as a list of per-expert modules (issue 56): an ``nn.ModuleList`` of ``nn.Linear`` experts or of small SwiGLU
MLPs made of ``nn.Linear`` layers, run in a loop over the experts' token groups. Converting the list (or the Linear
layers in it) makes each Linear an MXFP8 GEMM of one group (``mxfp8_grouped_mm`` with G = 1: forward, input gradient,
weight gradient), parameters unchanged. The oracle: the same block with stacked experts converted
(``moe_quant.moe.MoE``), which the loop equals bit for bit, and ``mxfp8_grouped_mm`` itself; the divergence checks of
the stacked experts (state_dict, pickles, compile, activation checkpointing, FSDP2 on gloo, torch.func, optimizers)."""

import copy
import functools
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from test_func_transforms import _vmap_views_dtype
from torchao.quantization import quantize_

import moe_quant
from moe_quant import MXFP8MoEConfig, fallback_counts, mxfp8_grouped_mm, unconvert
from moe_quant.conversion import converted_class, is_converted
from moe_quant.moe import GroupedExperts, MoE
from moe_quant.routing import sort_tokens_by_expert, unsort_tokens

D, H, E, K, T = 64, 96, 4, 2, 80
EXPERTS_LIST = lambda mod, fqn: fqn.split(".")[-1] == "experts"  # noqa: E731  the ModuleList
EXPERT_LINEARS = lambda mod, fqn: isinstance(mod, nn.Linear) and ".experts." in f".{fqn}"  # noqa: E731


class SwiGLUExpert(nn.Module):
    """One expert: SwiGLU over three nn.Linear layers (what older transformers models and many codebases write)."""

    def __init__(self, dim=D, hidden=H):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LoopMoE(nn.Module):
    """:class:`moe_quant.moe.MoE`'s router and token order, experts as a ModuleList run one by one on their tokens
    (split by the counts, read on the host as such loops do); the router (and a shared expert) stay dense."""

    def __init__(self, experts: nn.ModuleList, num_experts=E, top_k=K, shared=False):
        super().__init__()
        self.router = MoE(D, H, num_experts, top_k).router
        self.experts = experts
        self.shared = SwiGLUExpert(D, 32) if shared else None

    def forward(self, x):
        scores, selected, counts = self.router(x)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores, selected)
        outs = [expert(chunk) for expert, chunk in zip(self.experts, x_sorted.split(counts.tolist()))]
        out = unsort_tokens(torch.cat(outs), scores_sorted, token_idx, x)
        return out if self.shared is None else out + self.shared(x)


def stacked_and_loop(seed=0, dtype=torch.bfloat16, shared=False, num_experts=E):
    """A stacked MoE and the same block as a LoopMoE of SwiGLU experts (the same router and weights)."""
    torch.manual_seed(seed)
    moe = MoE(D, H, num_experts, K)
    loop = LoopMoE(nn.ModuleList(SwiGLUExpert() for _ in range(num_experts)), num_experts, shared=shared)
    loop.router.load_state_dict(moe.router.state_dict())
    with torch.no_grad():
        for e, expert in enumerate(loop.experts):
            expert.gate.weight.copy_(moe.experts.w1[e])
            expert.up.weight.copy_(moe.experts.w3[e])
            expert.down.weight.copy_(moe.experts.w2[e])
    return moe.to(dtype), loop.to(dtype)


def batch(seed=1, dtype=torch.bfloat16, t=T):
    return torch.randn(t, D, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def run(model, x, module=None):
    """Output, input gradient and parameter gradients (of ``module``, default ``model``) of one fwd+bwd."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.float().square().sum().backward()
    module = module or getattr(model, "_orig_mod", model)  # a compiled module: its parameters by their own names
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def stacked_grads_as_loop(grads):
    """The stacked MoE's gradients under the LoopMoE's parameter names."""
    out = {n: g for n, g in grads.items() if n.startswith("router.")}
    for e in range(E):
        for name, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            out[f"experts.{e}.{name}.weight"] = grads[f"experts.{w}"][e]
    return out


def assert_same(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for n, g in want[2].items():
        assert torch.equal(got[2][n], g), n


@pytest.mark.parametrize("match", ["list", "linears", "container"])
def test_loop_of_swiglu_experts_equals_the_stacked_experts_converted_bit_for_bit(match, mxfp8_calls):
    """Converting the list, its Linear layers, or a container around it: each expert Linear runs one MXFP8 GEMM of one
    group, and the loop's output and every gradient equal the stacked experts' converted block bit for bit (the same
    quantization blocks: a group's rows, a group's 32-token blocks); the router and a shared expert stay dense."""
    filter_fn = {"list": EXPERTS_LIST, "linears": EXPERT_LINEARS, "container": lambda mod, fqn: fqn == ""}[match]
    names = [f"experts.{e}.{n}" for e in range(E) for n in ("gate", "up", "down")]
    assert list(moe_quant.convert(stacked_and_loop(shared=True)[1], filter_fn=filter_fn)) == names  # not shared.*
    moe, loop = stacked_and_loop()
    params = dict(loop.named_parameters())
    plain = copy.deepcopy(loop)
    assert list(moe_quant.convert(loop, filter_fn=filter_fn)) == names
    assert not is_converted(loop.router.gate)
    assert all(loop.get_parameter(n) is p and type(p) is nn.Parameter for n, p in params.items())
    assert loop.state_dict().keys() == plain.state_dict().keys()
    moe_quant.convert(moe, filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    x = batch()
    mxfp8_calls.clear()
    got = run(loop, x)
    counts = moe.router(x.detach())[2]
    assert len(mxfp8_calls) == 3 * E and all(c[2].tolist() == [c[0].shape[0]] for c in mxfp8_calls)
    assert [c[0].shape[0] for c in mxfp8_calls[::3]] == counts.tolist()
    want = run(moe, x)
    assert_same(got, (want[0], want[1], stacked_grads_as_loop(want[2])))
    assert not torch.equal(got[0], plain(x.detach()))  # precondition: MXFP8 differs from bf16
    assert not fallback_counts()


def test_linear_experts_with_bias_equal_mxfp8_grouped_mm_of_one_group(mxfp8_calls):
    """A ModuleList of nn.Linear experts (with bias), inputs of any leading shape, an expert with no tokens: each is
    ``mxfp8_grouped_mm(x, W^T, [M]) + b``, forward and backward, bit for bit; the empty expert's weight gradient is 0."""
    torch.manual_seed(0)
    experts = nn.ModuleList([nn.Linear(D, 32, bias=False), nn.Linear(D, 32), nn.Linear(D, 32)]).bfloat16()
    plain = copy.deepcopy(experts)
    moe_quant.convert(experts, filter_fn=lambda mod, fqn: fqn == "")
    assert all(type(m) is converted_class(nn.Linear) and type(m).__name__ == "MXFP8Linear" for m in experts)
    xs = [torch.randn(5, 7, D).bfloat16().requires_grad_(), torch.randn(0, D).bfloat16().requires_grad_(),
          torch.randn(33, D).bfloat16().requires_grad_()]
    for lin, ref, x in zip(experts, plain, xs):
        y = lin(x)
        y.float().square().sum().backward()
        w = ref.weight.detach().clone().requires_grad_()
        b = None if ref.bias is None else ref.bias.detach().clone().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        a = xr.reshape(-1, D)
        want = (mxfp8_grouped_mm(a, w.t().unsqueeze(0), torch.tensor([a.shape[0]], dtype=torch.int32))
                .view(*x.shape[:-1], 32))
        want = want if b is None else want + b
        want.float().square().sum().backward()
        assert torch.equal(y, want) and torch.equal(x.grad, xr.grad) and y._base is None  # not a view, as F.linear
        assert torch.equal(lin.weight.grad, w.grad) and (b is None or torch.equal(lin.bias.grad, b.grad))
    assert not experts[1].weight.grad.any() and experts[0].weight.grad.any()
    assert len(mxfp8_calls) == 3 and not fallback_counts()  # the converted Linears (the oracle is not spied on)


def test_a_linear_mxfp8_cannot_serve_is_a_counted_fallback():
    torch.manual_seed(0)
    lin = nn.Linear(D, 40).bfloat16()  # N = 40: not a multiple of 32
    plain = copy.deepcopy(lin)
    moe_quant.convert(lin, filter_fn=lambda mod, fqn: True)
    x = torch.randn(8, D).bfloat16()
    assert torch.equal(lin(x), plain(x))
    (reason, n), = fallback_counts().items()
    assert n == 1 and reason.startswith("nn.Linear: K or N not a multiple of 32")
    moe_quant.convert(lin, MXFP8MoEConfig(allow_fallback=False), filter_fn=lambda mod, fqn: True)
    with pytest.raises(ValueError, match="allow_fallback=False"):
        lin(x)


def test_fp32_master_weights_under_autocast_run_mxfp8_at_the_autocast_dtype(mxfp8_calls):
    torch.manual_seed(0)
    lin = nn.Linear(D, 32)
    plain = copy.deepcopy(lin)
    moe_quant.convert(lin, filter_fn=lambda mod, fqn: True)
    x = torch.randn(16, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = lin(x), plain(x)
    assert y.dtype == ref.dtype == torch.bfloat16 and len(mxfp8_calls) == 1
    assert 20 < 10 * torch.log10(ref.float().pow(2).sum() / (y.float() - ref.float()).pow(2).sum()) < 60
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and not fallback_counts()


def test_what_converts_is_what_the_user_matched():
    """A Linear converts only where the user's filter matched it or the per-expert list around it: a matched single
    expert module (here one SwiGLU expert, like a shared expert) converts nothing, and says so."""
    _, loop = stacked_and_loop(shared=True)
    with pytest.raises(ValueError, match=r"matched 'shared' \(SwiGLUExpert\), holding no experts.*'experts' "
                                         r"\(ModuleList\).*fqn.split\('.'\)\[-1\] == 'experts'"):
        moe_quant.convert(loop, filter_fn=lambda mod, fqn: fqn == "shared")
    moe_quant.convert(loop, filter_fn=lambda mod, fqn: fqn == "router.gate")  # a Linear the user matched converts
    assert is_converted(loop.router.gate) and not any(is_converted(m) for m in loop.experts.modules())


# ----------------------------------------------------------------------------- behaves as the plain model


def test_state_dict_copies_pickles_and_unconvert():
    _, loop = stacked_and_loop()
    moe_quant.convert(loop, filter_fn=EXPERTS_LIST)
    x = batch().detach()
    ref = loop(x)
    buf = io.BytesIO()
    torch.save(loop, buf)
    buf.seek(0)
    for c in (copy.deepcopy(loop), pickle.loads(pickle.dumps(loop)), torch.load(buf, weights_only=False)):
        assert type(c.experts[0].gate) is converted_class(nn.Linear) and torch.equal(c(x), ref)
    buf = io.BytesIO()
    torch.save(loop.state_dict(), buf)
    buf.seek(0)
    _, plain = stacked_and_loop(seed=5)
    plain.load_state_dict(torch.load(buf))  # weights_only=True, strict
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), loop.parameters()))
    unconvert(loop)
    assert all(type(m) is nn.Linear for m in loop.modules() if isinstance(m, nn.Linear))
    assert torch.equal(loop(x), plain(x))


@pytest.mark.parametrize("opt_kwargs", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_optimizer_built_before_conversion_trains_the_same_parameters(opt_kwargs):
    _, plain = stacked_and_loop(dtype=torch.float32)
    conv = copy.deepcopy(plain)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, **opt_kwargs) for m in (plain, conv)]
    moe_quant.convert(conv, filter_fn=EXPERTS_LIST)
    x = batch(dtype=torch.float32).detach()
    conv(x).square().sum().backward()
    for (n, p), q in zip(conv.named_parameters(), plain.parameters()):
        q.grad = p.grad.clone()
    before = [p.detach().clone() for p in conv.parameters()]
    for opt in opts:
        opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, conv.parameters()))  # the step moved every parameter
    for (n, p), q in zip(conv.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


UNIFORM_E = 2  # experts of UniformExperts: each Linear is traced on its own (seconds of CPU each)


class UniformExperts(nn.Module):
    """Experts in a ModuleList, each on a fixed number of tokens (``x (E, T, D)``): no host read, so it compiles with
    fullgraph. ``linear``: each expert one nn.Linear with a bias (cheaper to trace), else a SwiGLU expert."""

    def __init__(self, linear=False):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) if linear else SwiGLUExpert() for _ in range(UNIFORM_E))

    def forward(self, x):
        return torch.stack([expert(x[e]) for e, expert in enumerate(self.experts)])


def uniform(seed=0, linear=False):
    torch.manual_seed(seed)
    return UniformExperts(linear).bfloat16()


def test_compile_fullgraph_dynamic_runs_mxfp8_equal_to_eager(mxfp8_calls):
    from torch._dynamo.testing import CompileCounterWithBackend

    mod = uniform(linear=True)
    moe_quant.convert(mod, filter_fn=EXPERTS_LIST)
    x = torch.randn(UNIFORM_E, 40, D).bfloat16()
    eager = run(mod, x)
    torch._dynamo.reset()
    mxfp8_calls.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, backend=counter, fullgraph=True, dynamic=True)
    for n, p in mod.named_parameters():
        p.grad = None
    got = run(compiled, x)
    assert counter.frame_count == 1 and len(mxfp8_calls) == UNIFORM_E  # traced once: the MXFP8 calls in the graph
    assert_same(got, eager)


def test_loop_under_compile_with_graph_breaks_equals_eager():
    """The loop reads the counts on the host (``tolist``): Dynamo breaks the graph there and traces the experts (two
    nn.Linear experts: each converted Linear's trace costs seconds of CPU)."""
    torch.manual_seed(0)
    loop = LoopMoE(nn.ModuleList(nn.Linear(D, D) for _ in range(2)), num_experts=2).bfloat16()
    moe_quant.convert(loop, filter_fn=EXPERTS_LIST)
    x = batch()
    eager = run(loop, x)
    torch._dynamo.reset()
    loop.zero_grad(set_to_none=True)
    assert_same(run(torch.compile(loop, backend="aot_eager"), x), eager)


@pytest.mark.parametrize("selective", [False, True])
def test_activation_checkpointing_recomputes_and_equals(selective, mxfp8_calls):
    _, loop = stacked_and_loop()
    moe_quant.convert(loop, filter_fn=EXPERTS_LIST)
    x = batch()
    want = run(loop, x)
    loop.zero_grad(set_to_none=True)
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} if selective else {}
    mxfp8_calls.clear()
    got = run(lambda t: checkpoint(loop, t, use_reentrant=False, **kwargs), x, module=loop)
    assert len(mxfp8_calls) == 2 * 3 * E  # the experts ran again in backward
    assert_same(got, want)
    assert not selective or torch.ops.aten._grouped_mm.default in seen  # the MXFP8 GEMMs went through the policy


def test_fsdp2_one_gloo_rank_equals_unsharded(gloo_group, mxfp8_calls):
    """fully_shard on each expert and the model, before conversion: FSDP2 gathers the plain parameters into the
    converted Linear layers (fp32 sharded, bf16 compute: inputs and parameters cast to bf16), whose GEMMs run MXFP8,
    equal to the unsharded bf16 model converted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    _, mod = stacked_and_loop(dtype=torch.float32)
    ref = copy.deepcopy(mod).bfloat16()
    moe_quant.convert(ref, filter_fn=EXPERTS_LIST)
    x = batch(dtype=torch.float32)
    want = run(ref, x.bfloat16())
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for expert in mod.experts:
        fully_shard(expert, mesh=mesh, mp_policy=policy)
    fully_shard(mod, mesh=mesh, mp_policy=policy)
    moe_quant.convert(mod, filter_fn=EXPERTS_LIST)
    assert isinstance(mod.experts[0], FSDPModule) and is_converted(mod.experts[0].gate)
    mxfp8_calls.clear()
    got = run(mod, x)
    assert len(mxfp8_calls) == 3 * E
    got_grads = {n: g.full_tensor() for n, g in got[2].items()}
    assert all(g.dtype == torch.float32 for g in got_grads.values())
    assert_same((got[0], got[1], got_grads), (want[0], want[1].float(), {n: g.float() for n, g in want[2].items()}))


def test_grad_of_functional_call_equals_autograd(mxfp8_calls):
    _, loop = stacked_and_loop(dtype=torch.float32)
    moe_quant.convert(loop, filter_fn=EXPERTS_LIST)
    x = batch(dtype=torch.float32).detach()
    params = {n: p.detach() for n, p in loop.named_parameters()}
    grads = torch.func.grad(lambda p: functional_call(loop, p, (x,)).square().sum())(params)
    assert len(mxfp8_calls) == 3 * E
    loop(x).square().sum().backward()
    for n, p in loop.named_parameters():
        assert torch.equal(grads[n], p.grad), n


@pytest.mark.xfail(not _vmap_views_dtype(), strict=True,
                   reason="this torch's vmap has no batching rule for aten::view.dtype (docs/limitations.md)")
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_vmap_equals_a_loop():
    mod = uniform()
    moe_quant.convert(mod, filter_fn=EXPERTS_LIST)
    xs = torch.randn(2, UNIFORM_E, 32, D).bfloat16()
    with torch.no_grad():
        assert torch.equal(torch.vmap(mod)(xs), torch.stack([mod(x) for x in xs]))
    assert not fallback_counts()


def test_quantize_with_the_list_matched_converts_as_moe_quant_convert():
    _, a = stacked_and_loop()
    b = copy.deepcopy(a)
    quantize_(a, MXFP8MoEConfig(), filter_fn=EXPERTS_LIST)
    moe_quant.convert(b, filter_fn=EXPERTS_LIST)
    assert [n for n, m in a.named_modules() if is_converted(m)] == [n for n, m in b.named_modules() if is_converted(m)]
