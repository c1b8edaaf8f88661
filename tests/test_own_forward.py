"""Experts modules conversion has no forward for (docs/design.md section 8.2): a user's own module whose forward
calls ``torch._grouped_mm`` / ``F.grouped_mm`` on its 3-D parameters, and subclasses of the known classes with a
forward of their own (issue 32 item 1). The converted module runs its own forward, its grouped GEMMs in MXFP8,
with the guarantees of any converted module: the same parameters, ``torch.func``, FSDP2, copies and pickles,
``state_dict``; under ``torch.compile`` eagerly behind a graph break (Dynamo does not apply the routing mode to
``torch._grouped_mm``), ``fullgraph=True`` naming the seam to add. The oracle of each numeric check is the same
computation written with ``mxfp8_grouped_mm``."""

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torchao.quantization import quantize_

from moe_quant import MXFP8MoEConfig, fallback_counts, mxfp8_grouped_mm, unconvert
from moe_quant.conversion import convert, converted_class, is_converted
from moe_quant.moe import GroupedExperts

D, H, E, M = 64, 96, 4, 80
COUNTS = torch.tensor([17, 0, 33, 30], dtype=torch.int32)  # an empty expert, sizes not multiples of 32


class OwnExperts(nn.Module):
    """A user's experts module: SwiGLU over three 3-D weights, its grouped GEMMs called directly (no seam)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, D) * 0.05)
        self.w2 = nn.Parameter(torch.randn(E, D, H) * 0.05)
        self.w3 = nn.Parameter(torch.randn(E, H, D) * 0.05)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(F.grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs)  # offs positional
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class GeluExperts(GroupedExperts):
    """A subclass of moe_quant's GroupedExperts with its own forward: gelu, two GEMMs, a scale."""

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.gelu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        return 0.5 * torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


def _titan_gelu_class():
    titan = pytest.importorskip("torchtitan.models.common.moe")

    class TitanGeluExperts(titan.GroupedExperts):
        """A subclass of torchtitan's GroupedExperts with its own forward through torchtitan's seam."""

        def forward(self, x, counts):
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.gelu(self._grouped_mm(A=x, B_t=self.w1_EFD.transpose(-2, -1), offs=offs))
            return 0.5 * self._grouped_mm(A=h, B_t=self.w2_EDF.transpose(-2, -1), offs=offs)

    return TitanGeluExperts


def make(kind="own", seed=0):
    torch.manual_seed(seed)
    if kind == "own":
        mod = OwnExperts()
    elif kind == "gelu":
        mod = GeluExperts(D, H, E)
    else:
        cls = _titan_gelu_class()
        mod = cls(cls.__mro__[1].Config(dim=D, hidden_dim=H, num_experts=E))
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(std=0.05)
    return mod.to(torch.bfloat16)


def batch(seed=1):
    return torch.randn(M, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).requires_grad_()


def oracle(plain, x, kind="own", mode="rceil"):
    """The module's own computation with each grouped GEMM ``mxfp8_grouped_mm``: output, dx, parameter grads."""
    w = {n: p.detach().clone().requires_grad_() for n, p in plain.named_parameters()}
    x = x.detach().clone().requires_grad_()
    offs = torch.cumsum(COUNTS, dim=0, dtype=torch.int32)

    def mm(a, name):
        return mxfp8_grouped_mm(a, w[name].transpose(-2, -1), offs, scale_mode=mode)

    if kind == "own":
        out = mm(F.silu(mm(x, "w1")) * mm(x, "w3"), "w2")
    elif kind == "gelu":
        out = 0.5 * mm(F.gelu(mm(x, "w1")), "w2")
    else:
        out = 0.5 * mm(F.gelu(mm(x, "w1_EFD")), "w2_EDF")
    out.float().square().sum().backward()
    return out.detach(), x.grad, {n: t.grad for n, t in w.items()}


def run(mod, x):
    out = mod(x, COUNTS)
    out.float().square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mod.named_parameters()}


def assert_same(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for n in want[2]:
        if want[2][n] is None:
            assert got[2][n] is None, n
        else:
            assert torch.equal(got[2][n], want[2][n]), n


@pytest.mark.parametrize("kind", ["own", "gelu", "titan"])
def test_own_forward_runs_with_its_grouped_gemms_in_mxfp8(kind, mxfp8_calls):
    """The module's own forward runs (a subclass's forward is not replaced by the stock SwiGLU), each of its grouped
    GEMMs in MXFP8: output and every gradient equal the same computation with mxfp8_grouped_mm, bit for bit."""
    plain = make(kind)
    mod = copy.deepcopy(plain)
    params = dict(mod.named_parameters())
    quantize_(mod, MXFP8MoEConfig(scale_mode="floor"), filter_fn=lambda m, fqn: m is mod)
    assert is_converted(mod) and isinstance(mod, type(plain)) and type(mod) is converted_class(type(plain))
    assert all(mod.get_parameter(n) is p and type(p) is nn.Parameter for n, p in params.items())
    x = batch()
    got = run(mod, x)
    assert len(mxfp8_calls) == (3 if kind == "own" else 2) and not fallback_counts()
    assert_same(got, oracle(plain, x, kind, "floor"))
    assert not torch.equal(got[0], plain(x.detach(), COUNTS))  # not the bf16 op
    if kind != "own":  # and not the stock SwiGLU forward of the class it subclasses
        stock = type(plain).__mro__[1].forward(plain, x.detach(), COUNTS).float()
        assert (got[0].float() - stock).norm() > 0.5 * stock.norm()


def test_compile_runs_the_own_forward_eagerly_and_fullgraph_names_the_seam(mxfp8_calls, caplog, monkeypatch):
    """Dynamo does not apply a TorchFunctionMode to torch._grouped_mm: the own forward runs behind a graph break
    (MXFP8, equal to eager bit for bit), logged once per class (issue 56: it was silent), and fullgraph=True raises
    an Unsupported whose message leads with moe_quant's words and names the _grouped_mm seam to add (not Dynamo's
    "Remove the torch.compiler.disable call")."""
    from moe_quant.conversion import own_forward

    monkeypatch.setattr(own_forward, "_NOTED", set(), raising=False)
    mod = convert(make(), MXFP8MoEConfig())
    x = batch().detach()
    eager = mod(x, COUNTS)
    assert "graph break" not in caplog.text  # eager says nothing
    mxfp8_calls.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        out = torch.compile(mod, backend="aot_eager")(x, COUNTS)
        torch._dynamo.reset()
        torch.compile(mod, backend="aot_eager")(x, COUNTS)  # a second compile logs nothing more
    assert torch.equal(out, eager) and len(mxfp8_calls) == 6
    notes = [r.getMessage() for r in caplog.records if "behind a graph break" in r.getMessage()]
    assert len(notes) == 1 and "test_own_forward.OwnExperts" in notes[0] and own_forward.SEAM in notes[0], notes
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(mod, backend="aot_eager", fullgraph=True)(x, COUNTS)
    message = str(info.value)
    assert message.startswith("moe_quant: fullgraph=True cannot trace the converted test_own_forward.OwnExperts")
    assert "_grouped_mm(self, *, A, B_t, offs)" in message and "Remove the" not in message, message


def test_torch_func_grad_of_functional_call_equals_autograd(mxfp8_calls):
    # fp32 (read as bf16 by the MXFP8 GEMM): with bf16 weights PyTorch's own bf16 ops differ between torch.func and
    # autograd in the last bit (the unconverted module's gradients do too)
    mod = convert(make().float(), MXFP8MoEConfig())
    x = batch().detach().float()
    params = {n: p.detach() for n, p in mod.named_parameters()}
    grads = torch.func.grad(lambda p: functional_call(mod, p, (x, COUNTS)).float().square().sum())(params)
    assert len(mxfp8_calls) == 3
    mod(x, COUNTS).float().square().sum().backward()
    for n, p in mod.named_parameters():
        assert torch.equal(grads[n], p.grad), n


def test_copies_pickles_and_state_dict():
    mod = convert(make(), MXFP8MoEConfig(scale_mode="floor"))
    x = batch().detach()
    ref = mod(x, COUNTS)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    for c in (copy.deepcopy(mod), pickle.loads(pickle.dumps(mod)), torch.load(buf, weights_only=False)):
        assert type(c) is type(mod) and c._mxfp8_config == mod._mxfp8_config
        assert torch.equal(c(x, COUNTS), ref)
    buf = io.BytesIO()
    torch.save(mod.state_dict(), buf)
    buf.seek(0)
    plain = make(seed=5)
    plain.load_state_dict(torch.load(buf))  # weights_only=True
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), mod.parameters()))
    unconvert(mod)
    assert type(mod) is OwnExperts and torch.equal(mod(x, COUNTS), plain(x, COUNTS))


@pytest.mark.parametrize("order", ["convert_then_shard", "shard_then_convert"])
def test_fsdp2_one_rank(order, gloo_group, mxfp8_calls):
    """fully_shard before or after conversion: FSDP2 gathers the plain parameters into the own forward, which
    runs its GEMMs in MXFP8 (the unsharded module's results, bit for bit); unconvert keeps FSDP2's class."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ref = convert(make(), MXFP8MoEConfig())
    x = batch()
    want = run(ref, x)
    mod = make()
    if order == "convert_then_shard":
        convert(mod, MXFP8MoEConfig())
    fully_shard(mod, mesh=init_device_mesh("cpu", (1,)))
    sharded_class = type(mod)
    if order == "shard_then_convert":
        convert(mod, MXFP8MoEConfig())
    assert isinstance(mod, FSDPModule) and is_converted(mod) and type(mod).__mro__[2] is converted_class(OwnExperts)
    mxfp8_calls.clear()
    x2 = x.detach().clone().requires_grad_()
    out = mod(x2, COUNTS)
    out.float().square().sum().backward()
    assert len(mxfp8_calls) == 3 and torch.equal(out, want[0]) and torch.equal(x2.grad, want[1])
    for n, p in mod.named_parameters():
        assert torch.equal(p.grad.full_tensor(), want[2][n]), n
    unconvert(mod)
    assert isinstance(mod, FSDPModule) and not is_converted(mod) and type(mod).__mro__[2] is OwnExperts
    if order == "shard_then_convert":
        assert type(mod) is sharded_class  # FSDP2's own class back, not a copy


class BmmExperts(nn.Module):
    """Experts run as torch.bmm over a fixed number of tokens each: nothing conversion can route."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, D, H, dtype=torch.bfloat16) * 0.05)

    def forward(self, x):
        return torch.bmm(x, self.w)


def test_forward_without_grouped_mm_is_a_counted_fallback_naming_what_to_add():
    mod = convert(BmmExperts(), MXFP8MoEConfig())
    x = torch.randn(E, 8, D, dtype=torch.bfloat16)
    plain = torch.bmm(x, mod.w)
    assert torch.equal(mod(x), plain)
    (reason, n), = fallback_counts().items()
    assert n == 1 and "BmmExperts.forward made no torch._grouped_mm" in reason
    assert "_grouped_mm(self, *, A, B_t, offs)" in reason and "torch._grouped_mm(A, W.transpose(-2, -1)" in reason
    convert(mod, MXFP8MoEConfig(allow_fallback=False))
    with pytest.raises(ValueError, match="made no torch._grouped_mm.*allow_fallback=False"):
        mod(x)


def test_module_without_forward_is_refused():
    class NoForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(E, D, H))

    with pytest.raises(TypeError, match="cannot convert .*NoForward"):
        convert(NoForward(), MXFP8MoEConfig())


def test_module_whose_forward_an_instance_attribute_replaces_is_refused():
    """A hook library (accelerate's add_hook_to_module) sets ``module.forward`` on the instance: it, not the class's
    forward, runs, so a converted class would change nothing; conversion says so instead."""
    mod = make()
    old = mod.forward
    mod.forward = lambda x, counts: old(x, counts)
    with pytest.raises(TypeError, match="instance attribute 'forward'"):
        convert(mod, MXFP8MoEConfig())
    assert not is_converted(mod)


def test_fx_graph_module_of_an_experts_module_converts(mxfp8_calls):
    """torch.fx gives each GraphModule a class of its own, holding the generated forward: that class is the
    module's own (not a layer over GraphModule), and its forward's grouped GEMMs run in MXFP8."""
    x = batch().detach()
    ref = convert(make(), MXFP8MoEConfig())(x, COUNTS)
    mxfp8_calls.clear()
    gm = torch.fx.symbolic_trace(make())
    own = type(gm)
    convert(gm, MXFP8MoEConfig())
    assert torch.equal(gm(x, COUNTS), ref) and len(mxfp8_calls) == 3
    unconvert(gm)
    assert type(gm) is own


class PositionalHelperExperts(OwnExperts):
    """A helper named like the seam but of another signature, called positionally (issue 55 item 4)."""

    def _grouped_mm(self, a, b, offs):
        return torch._grouped_mm(a, b, offs=offs)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(self._grouped_mm(x, self.w1.transpose(-2, -1), offs))
        h = h * self._grouped_mm(x, self.w3.transpose(-2, -1), offs)
        return self._grouped_mm(h, self.w2.transpose(-2, -1), offs)


class KeywordSeamExperts(OwnExperts):
    """The seam's signature: conversion overrides the method (route 2), the forward stays the module's."""

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(self._grouped_mm(A=x, B_t=self.w1.transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x, B_t=self.w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=self.w2.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("cls", [PositionalHelperExperts, KeywordSeamExperts])
def test_seam_is_taken_by_its_signature_not_its_name(cls, mxfp8_calls):
    """A ``_grouped_mm`` method of another signature than the seam's is the module's own helper: the module takes
    the own-forward route (its torch._grouped_mm calls routed), and trains in MXFP8 like the seam's module."""
    torch.manual_seed(0)
    plain = cls().to(torch.bfloat16)
    mod = convert(copy.deepcopy(plain), MXFP8MoEConfig())
    seam = "_grouped_mm" in vars(type(mod))
    assert seam == (cls is KeywordSeamExperts) and ("forward" in vars(type(mod))) != seam
    x = batch()
    got = run(mod, x)
    assert len(mxfp8_calls) == 3 and not fallback_counts()
    assert_same(got, oracle(plain, x))


class WithSubmodule(OwnExperts):
    """Experts whose forward also calls a submodule with grouped GEMMs on the submodule's own weights."""

    def __init__(self):
        super().__init__()
        self.extra = PositionalHelperExperts()  # its own w1, w2, w3 (and a forward of its own)

    def forward(self, x, counts):
        return super().forward(x, counts) + self.extra(x, counts)


def _submodule_oracle(plain, x, inner):
    """The outer module's GEMMs in MXFP8 (rceil), the submodule's as ``inner`` computes them."""
    w = {n: p.detach().clone().requires_grad_() for n, p in plain.named_parameters(recurse=False)}
    x = x.detach().clone().requires_grad_()
    offs = torch.cumsum(COUNTS, dim=0, dtype=torch.int32)

    def mm(a, name):
        return mxfp8_grouped_mm(a, w[name].transpose(-2, -1), offs)

    sub = copy.deepcopy(plain.extra)
    out = mm(F.silu(mm(x, "w1")) * mm(x, "w3"), "w2") + inner(sub)(x, COUNTS)
    out.float().square().sum().backward()
    grads = {n: t.grad for n, t in w.items()} | {f"extra.{n}": p.grad for n, p in sub.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("sub", ["unconverted", "converted_floor"])
def test_only_the_modules_own_grouped_gemms_are_routed(sub):
    """A submodule the user left out of the conversion (filter_fn) runs its grouped GEMMs as it does alone, the
    plain op, when the converted module's forward calls it; one converted with another config runs that config
    (issue 55 item 1: the routing mode sent every grouped GEMM of the forward to MXFP8 with the outer module's
    scale mode). The outer module's own GEMMs run in MXFP8."""
    torch.manual_seed(0)
    plain = WithSubmodule().to(torch.bfloat16)
    mod = copy.deepcopy(plain)
    if sub == "converted_floor":
        quantize_(mod, MXFP8MoEConfig(scale_mode="floor"), filter_fn=lambda m, fqn: fqn == "extra")
    quantize_(mod, MXFP8MoEConfig(), filter_fn=lambda m, fqn: m is mod)
    assert is_converted(mod) and is_converted(mod.extra) == (sub == "converted_floor")

    def inner(m):
        return convert(m, MXFP8MoEConfig(scale_mode="floor")) if sub == "converted_floor" else m

    x = batch()
    got = run(mod, x)
    want = _submodule_oracle(plain, x, inner)
    assert_same(got, want)
    assert not fallback_counts()
    # precondition: the submodule's GEMMs in the outer config's MXFP8 give other bits
    rceil = _submodule_oracle(plain, x, lambda m: convert(m, MXFP8MoEConfig()))
    assert not torch.equal(want[0], rceil[0])


class CastExperts(OwnExperts):
    """fp32 master weights cast to the activations' dtype in forward."""

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = (w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch._grouped_mm(x, w1.mT, offs=offs)) * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1).contiguous(), offs=offs)


def test_weights_made_from_the_parameters_in_forward_are_routed(mxfp8_calls):
    """Casts of the module's parameters, views and copies of them made in forward are its weights too."""
    torch.manual_seed(0)
    plain = CastExperts()  # fp32
    mod = convert(copy.deepcopy(plain), MXFP8MoEConfig())
    x = batch()
    got = run(mod, x)
    assert len(mxfp8_calls) == 3 and not fallback_counts()
    want = oracle(plain, x)  # mxfp8_grouped_mm reads fp32 weights as bf16: the cast's values
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for n in want[2]:
        assert torch.equal(got[2][n], want[2][n].float()), n


class CheckpointedExperts(OwnExperts):
    """The SwiGLU under torch.utils.checkpoint inside the module's own forward."""

    use_reentrant = True

    def forward(self, x, counts):
        from torch.utils.checkpoint import checkpoint

        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)

        def swiglu(x):
            h = F.silu(F.grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs)
            return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)

        return checkpoint(swiglu, x, use_reentrant=self.use_reentrant)


class CheckpointedSeamExperts(KeywordSeamExperts):
    use_reentrant = True

    def forward(self, x, counts):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, counts, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("cls", [CheckpointedExperts, CheckpointedSeamExperts])
def test_checkpoint_inside_the_forward_recomputes_in_mxfp8(cls, reentrant, mxfp8_calls):
    """torch.utils.checkpoint inside the module's forward (issue 55 items 2 and 3): the recompute in backward runs
    the same MXFP8 GEMMs, so output and every gradient equal the module's without the checkpoint, bit for bit
    (reentrant: they were the bf16 GEMMs' gradients; non-reentrant: CheckpointError, the saved tensors differed)."""
    torch.manual_seed(0)
    plain = cls().to(torch.bfloat16)
    mod = convert(copy.deepcopy(plain), MXFP8MoEConfig())
    mod.use_reentrant = reentrant
    x = batch()
    got = run(mod, x)
    assert len(mxfp8_calls) == 6 and not fallback_counts()  # three in forward, three in the recompute
    assert_same(got, oracle(plain, x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_around_the_module_recomputes_in_mxfp8(reentrant, mxfp8_calls):
    """A checkpoint around the converted module (as transformers' and torchtitan's activation checkpointing wrap
    whole layers): its recompute calls the converted forward again, in MXFP8; no backward routing is needed."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain = OwnExperts().to(torch.bfloat16)
    mod = convert(copy.deepcopy(plain), MXFP8MoEConfig())
    x = batch()
    out = checkpoint(mod, x, COUNTS, use_reentrant=reentrant)
    out.float().square().sum().backward()
    got = out.detach(), x.grad, {n: p.grad for n, p in mod.named_parameters()}
    assert len(mxfp8_calls) == 6 and not fallback_counts()
    assert_same(got, oracle(plain, x))
