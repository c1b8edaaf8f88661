"""Model conversion: MXFP8MoEConfig + quantize_, the MXFP8ExpertWeight wrapper, grouped-mm
interception, fallbacks, optimizers, state_dict round trips."""

import copy
import dataclasses
import io
import logging
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchao.quantization import quantize_

from moe_quant import conversion, mxfp8_grouped_mm
from moe_quant.conversion import (
    MXFP8ExpertWeight,
    MXFP8MoEConfig,
    convert_parameters,
    fallback_counts,
    unwrap_parameters,
)
from moe_quant.moe import GroupedExperts, MoE, TinyMoEModel

E, N, K, M = 4, 64, 96, 80
EXPERTS = lambda mod, fqn: "experts" in fqn  # noqa: E731


class Experts(nn.Module):
    def __init__(self, dtype=torch.bfloat16, shape=(E, N, K)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape, dtype=dtype) * 0.1)
        self.b = nn.Parameter(torch.zeros(shape[0], shape[1], dtype=dtype))  # 2-D: never converted


def converted(**cfg):
    torch.manual_seed(0)
    mod = Experts()
    convert_parameters(mod, MXFP8MoEConfig(**cfg))
    return mod


def operands(m=M, k=K, dtype=torch.bfloat16):
    torch.manual_seed(1)
    a = torch.randn(m, k, dtype=dtype)
    offs = torch.tensor([17, 17, 50, m], dtype=torch.int32)  # an empty group, sizes not multiples of 32
    return a, offs


@pytest.fixture(autouse=True)
def _clean_warnings():
    conversion._WARNED_NOTHING_CONVERTED.clear()  # "nothing converted" warns once per class and process


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_normalization():
    c = MXFP8MoEConfig()
    assert (c.scale_mode.value, c.backend.value, c.out_dtype, c.allow_fallback) == ("rceil", "auto", None, True)
    c = MXFP8MoEConfig(scale_mode="FLOOR", backend="emulated", out_dtype=torch.float32)
    assert (c.scale_mode.value, c.backend.value, c.out_dtype) == ("floor", "emulated", torch.float32)
    assert c == MXFP8MoEConfig(scale_mode="floor", backend="emulated", out_dtype=torch.float32)
    assert hash(c) == hash(MXFP8MoEConfig(scale_mode="floor", backend="emulated", out_dtype=torch.float32))


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(scale_mode="nearest"), ValueError, "scale_mode"),
        (dict(scale_mode=3), ValueError, "scale_mode"),
        (dict(backend="cublas"), ValueError, "backend"),
        (dict(out_dtype=torch.float16), ValueError, "out_dtype"),
        (dict(out_dtype="bf16"), ValueError, "out_dtype"),
        (dict(allow_fallback="yes"), TypeError, "allow_fallback"),
    ],
)
def test_config_rejects_bad_values(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        MXFP8MoEConfig(**kwargs)


def test_convert_rejects_other_configs():
    with pytest.raises(TypeError, match="MXFP8MoEConfig"):
        convert_parameters(Experts(), object())


# ----------------------------------------------------------------------------- conversion


def test_quantize_converts_only_3d_expert_params():
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    kinds = {n: type(p) for n, p in model.named_parameters()}
    wrapped = {n for n, t in kinds.items() if t is MXFP8ExpertWeight}
    assert wrapped == {f"layers.{i}.moe.experts.w{j}" for i in range(2) for j in (1, 2, 3)}
    for n, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.requires_grad
        data = p._data if n in wrapped else p
        assert torch.equal(data, before[n])
    # idempotent
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    assert all(type(model.get_parameter(n)._data) is torch.Tensor for n in wrapped)


def test_fqn_to_config_converts_single_parameters():
    from torchao.quantization import FqnToConfig

    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    fqns = FqnToConfig(
        {"layers.0.moe.experts.w1": MXFP8MoEConfig(), r"re:layers\.1\.moe\.experts": MXFP8MoEConfig(scale_mode="floor")}
    )
    quantize_(model, fqns, filter_fn=None)
    wrapped = {n: p.config.scale_mode.value for n, p in model.named_parameters() if type(p) is MXFP8ExpertWeight}
    assert wrapped == {
        "layers.0.moe.experts.w1": "rceil",
        "layers.1.moe.experts.w1": "floor",
        "layers.1.moe.experts.w2": "floor",
        "layers.1.moe.experts.w3": "floor",
    }


def test_unmatched_filter_warns(caplog):
    model = nn.Sequential(nn.Linear(32, 32))
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig())  # default filter: nn.Linear, no 3-D weight
    assert "nothing converted" in caplog.text


class _FeedForward(nn.Module):
    """torchtitan's shared expert: 2-D weights only."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class _TitanStyleMoE(nn.Module):
    """The module names of torchtitan's MoE: ``moe.experts`` (routed) and ``moe.shared_experts``."""

    def __init__(self, n_layers=4):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            layer = nn.Module()
            layer.moe = nn.Module()
            layer.moe.experts = GroupedExperts(32, 64, 4)
            layer.moe.shared_experts = _FeedForward()
            self.layers.append(layer)


def test_name_filter_matching_shared_experts_warns_once_per_class(caplog):
    model = _TitanStyleMoE(n_layers=4)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)  # also matches every layer's shared_experts
        quantize_(_TitanStyleMoE(n_layers=2), MXFP8MoEConfig(), filter_fn=EXPERTS)  # and again, another model
    warnings = [r for r in caplog.records if "nothing converted" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "_FeedForward" in warnings[0].getMessage() and "isinstance" in warnings[0].getMessage()
    converted_names = {n for n, p in model.named_parameters() if type(p) is MXFP8ExpertWeight}
    assert converted_names == {f"layers.{i}.moe.experts.w{j}" for i in range(4) for j in (1, 2, 3)}


def test_isinstance_filter_converts_routed_experts_without_warnings(caplog):
    model = _TitanStyleMoE(n_layers=3)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    assert "nothing converted" not in caplog.text
    converted_names = {n for n, p in model.named_parameters() if type(p) is MXFP8ExpertWeight}
    assert converted_names == {f"layers.{i}.moe.experts.w{j}" for i in range(3) for j in (1, 2, 3)}


def test_quantize_again_reconfigures_in_place():
    """RCEIL, then FLOOR: the second config wins (the wrapper's config is swapped, nothing else)."""
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    fresh_floor = copy.deepcopy(model)
    quantize_(model, MXFP8MoEConfig(scale_mode="rceil"), filter_fn=EXPERTS)
    quantize_(fresh_floor, MXFP8MoEConfig(scale_mode="floor"), filter_fn=EXPERTS)
    x = torch.randn(64, 32, dtype=torch.bfloat16) * 50
    out_rceil = model(x)
    params = {n: p for n, p in model.named_parameters()}
    datas = {n: p._data for n, p in params.items() if type(p) is MXFP8ExpertWeight}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    quantize_(model, MXFP8MoEConfig(scale_mode="floor"), filter_fn=EXPERTS)
    modes = {n: p.config.scale_mode.value for n, p in model.named_parameters() if type(p) is MXFP8ExpertWeight}
    assert set(modes) == set(datas) and set(modes.values()) == {"floor"}
    # same Parameter objects (the optimizer still holds them), same wrapped tensors
    assert all(model.get_parameter(n) is p for n, p in params.items())
    assert all(model.get_parameter(n)._data is d for n, d in datas.items())
    assert opt.param_groups[0]["params"][0] is next(model.parameters())
    out_floor = model(x)
    assert torch.equal(out_floor, fresh_floor(x)) and not torch.equal(out_floor, out_rceil)
    assert all(m._mxfp8_config.scale_mode.value == "floor" for m in model.modules() if hasattr(m, "_mxfp8_config"))
    # and back, via FqnToConfig for a single parameter
    from torchao.quantization import FqnToConfig

    quantize_(model, FqnToConfig({"layers.0.moe.experts.w1": MXFP8MoEConfig(scale_mode="rceil")}), filter_fn=None)
    assert model.get_parameter("layers.0.moe.experts.w1").config.scale_mode.value == "rceil"
    assert model.get_parameter("layers.0.moe.experts.w2").config.scale_mode.value == "floor"


def test_reconfigured_weight_survives_state_dict_assign():
    mod = converted(scale_mode="rceil")
    convert_parameters(mod, MXFP8MoEConfig(scale_mode="floor"))
    sd = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.load_state_dict(sd, assign=True)
    assert type(mod.w) is MXFP8ExpertWeight and mod.w.config.scale_mode.value == "floor"


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_reconfiguring_an_fsdp2_sharded_weight_raises():
    """FSDP2 keeps an unsharded copy of the wrapper: swapping only the shard's config would be silently
    half-done, so it is refused (same config: still a no-op)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        experts = GroupedExperts(32, 64, 4)
        is_experts = lambda mod, fqn: isinstance(mod, GroupedExperts)  # noqa: E731
        quantize_(experts, MXFP8MoEConfig(), filter_fn=is_experts)
        fully_shard(experts, mesh=init_device_mesh("cpu", (1,)))
        assert type(experts.w1._local_tensor) is MXFP8ExpertWeight
        quantize_(experts, MXFP8MoEConfig(), filter_fn=is_experts)
        with pytest.raises(ValueError, match="before fully_shard"):
            quantize_(experts, MXFP8MoEConfig(scale_mode="floor"), filter_fn=is_experts)
        assert experts.w1._local_tensor.config.scale_mode.value == "rceil"
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- no_grad / inference_mode


def _trained_tiny_model():
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(64, 32, generator=g).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("prepare", ["as_is", "eval", "requires_grad_false"])
def test_trained_model_evaluates_in_no_grad_and_inference_mode(prepare):
    model, opt = _trained_tiny_model()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    if prepare == "eval":
        model.eval()
    elif prepare == "requires_grad_false":
        model.requires_grad_(False)
    with torch.no_grad():
        ref = model(x)
    with torch.inference_mode():
        out = model(x)
        w = model.layers[0].moe.experts.w1
        views = [w.transpose(-2, -1), w.mT, w.detach(), w[1:3], w.view(4, -1), w.float(), w.clone()]
    assert out.is_inference() and torch.equal(out, ref)
    assert all(type(v) is MXFP8ExpertWeight for v in views)
    assert not views[0].is_inference() and views[-1].is_inference()  # a view of a normal tensor stays normal
    # MXFP8 still serves the call: not the plain bf16 op
    a, offs = operands(k=w.shape[-1])
    with torch.inference_mode():
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    assert torch.equal(out, mxfp8_grouped_mm(a, w._data.transpose(-2, -1), offs))
    # and training goes on afterwards in the same process
    model.train().requires_grad_(True)
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    assert not fallback_counts()


def test_wrapper_made_in_inference_mode_works_outside_it():
    with torch.inference_mode():
        w = MXFP8ExpertWeight(torch.randn(E, N, K, dtype=torch.bfloat16), MXFP8MoEConfig())
        inner = w.transpose(-2, -1)
    outer = w.transpose(-2, -1)
    assert inner.is_inference() and outer.is_inference() and type(outer) is MXFP8ExpertWeight
    a, offs = operands()
    with torch.no_grad():
        out = torch._grouped_mm(a, outer, offs=offs)
    assert torch.equal(out, mxfp8_grouped_mm(a, w._data.transpose(-2, -1), offs))


def test_unwrap_parameters_restores_plain():
    mod = converted()
    data = mod.w._data
    unwrap_parameters(mod)
    assert type(mod.w) is nn.Parameter and mod.w.data_ptr() == data.data_ptr()
    assert mod.state_dict()["w"].data_ptr() == data.data_ptr()


# ----------------------------------------------------------------------------- interception


def _reference(w, a, offs, **kw):
    wp = w._data.detach().clone().requires_grad_()
    ap = a.detach().clone().requires_grad_()
    out = mxfp8_grouped_mm(ap, wp.transpose(-2, -1), offs, **kw)
    return ap, wp, out


CALLS = {
    "torch._grouped_mm kw": lambda a, wt, offs: torch._grouped_mm(a, wt, offs=offs),
    "torch._grouped_mm positional": lambda a, wt, offs: torch._grouped_mm(a, wt, offs),
    "torch._grouped_mm named": lambda a, wt, offs: torch._grouped_mm(input=a, mat2=wt, offs=offs),
    "F.grouped_mm": lambda a, wt, offs: F.grouped_mm(a, wt, offs=offs),
    "aten._grouped_mm": lambda a, wt, offs: torch.ops.aten._grouped_mm(a, wt, offs),
    "aten._grouped_mm.default": lambda a, wt, offs: torch.ops.aten._grouped_mm.default(a, wt, offs=offs),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_grouped_mm_runs_mxfp8_forward_and_backward(call, scale_mode):
    mod = converted(scale_mode=scale_mode)
    a, offs = operands()
    a = a.requires_grad_()
    out = CALLS[call](a, mod.w.transpose(-2, -1), offs)
    g = torch.randn_like(out)
    out.backward(g)
    ap, wp, ref = _reference(mod.w, a, offs, scale_mode=scale_mode)
    ref.backward(g)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert torch.equal(out, ref)
    assert torch.equal(a.grad, ap.grad)
    assert type(mod.w.grad) is torch.Tensor and torch.equal(mod.w.grad, wp.grad)
    # and it is not the bf16 op
    plain = torch._grouped_mm(a.detach(), mod.w._data.transpose(-2, -1), offs=offs)
    assert not torch.equal(out, plain)
    assert not fallback_counts()


def test_fp32_input_and_out_dtype():
    mod = converted()
    a, offs = operands(dtype=torch.float32)
    out = torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=offs)  # like the plain op: out dtype = input dtype
    assert out.dtype == torch.float32
    assert torch.equal(out, mxfp8_grouped_mm(a, mod.w._data.transpose(-2, -1), offs, out_dtype=torch.float32))
    a16 = a.to(torch.bfloat16)
    out = torch._grouped_mm(a16, mod.w.transpose(-2, -1), offs=offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    mod = converted(out_dtype=torch.float32)
    assert torch._grouped_mm(a16, mod.w.transpose(-2, -1), offs=offs).dtype == torch.float32
    assert not fallback_counts()


def test_fp32_weights_are_read_as_bf16():
    mod = converted()
    mod.float()
    assert type(mod.w) is MXFP8ExpertWeight and mod.w.dtype == torch.float32
    a, offs = operands(dtype=torch.float32)
    w32 = mod.w._data
    out = torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=offs)
    ref = mxfp8_grouped_mm(a, w32.to(torch.bfloat16).transpose(-2, -1), offs, out_dtype=torch.float32)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert mod.w.grad.dtype == torch.float32 and mod.w.grad.shape == (E, N, K)


def test_bias_is_never_dropped():
    mod = converted()
    a, offs = operands()
    base = torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=offs)
    bias = torch.randn(N, dtype=torch.bfloat16, requires_grad=True)
    out = torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=offs, bias=bias)
    assert torch.equal(out, base + bias)
    out.sum().backward()
    assert torch.equal(bias.grad, torch.full((N,), float(M), dtype=torch.bfloat16))
    per_expert = torch.randn(E, N, dtype=torch.bfloat16)
    out = F.grouped_mm(a, mod.w.transpose(-2, -1), offs=offs, bias=per_expert)
    group = torch.tensor([0] * 17 + [2] * 33 + [3] * 30)
    assert torch.equal(out, base + per_expert[group])


# ----------------------------------------------------------------------------- fallbacks


def _plain_w(mod):
    return mod.w._data.transpose(-2, -1)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("3d", "3D x 3D"),
        ("no_offs", "without offs"),
        ("fp16", "float16"),
        ("k_not_32", "not multiples of 32"),
    ],
)
def test_fallback_runs_plain_op_and_is_counted_and_logged_once(case, reason, caplog):
    mod = converted()
    a, offs = operands()
    if case == "3d":
        args, kwargs = (torch.randn(E, 8, K, dtype=torch.bfloat16),), {}
        wt, ref_w = mod.w.transpose(-2, -1), _plain_w(mod)
    elif case == "no_offs":  # 2D x 3D without offs: the plain op rejects it too
        args, kwargs, wt, ref_w = (a,), {}, mod.w.transpose(-2, -1), _plain_w(mod)
    elif case == "fp16":
        mod.half()
        args, kwargs, wt, ref_w = (a.half(),), {"offs": offs}, mod.w.transpose(-2, -1), _plain_w(mod)
    else:
        torch.manual_seed(0)
        mod = Experts(shape=(E, N, 40))
        convert_parameters(mod, MXFP8MoEConfig())
        args, kwargs = (torch.randn(M, 40, dtype=torch.bfloat16),), {"offs": offs}
        wt, ref_w = mod.w.transpose(-2, -1), _plain_w(mod)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        try:
            expected = torch._grouped_mm(*args, ref_w, **kwargs)
        except RuntimeError as err:  # the plain op refuses: so must the fallback, with the same error
            with pytest.raises(RuntimeError, match=re.escape(str(err)[:30])):
                torch._grouped_mm(*args, wt, **kwargs)
            expected = None
        else:
            for _ in range(3):
                out = torch._grouped_mm(*args, wt, **kwargs)
            assert torch.equal(out, expected)
    counts = fallback_counts()
    assert len(counts) == 1 and reason in next(iter(counts))
    assert next(iter(counts.values())) == (1 if expected is None else 3)
    assert caplog.text.count("fallback") == 1


def test_fallback_keeps_autograd_and_bias():
    mod = converted()
    a3 = torch.randn(E, 8, K, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    out = torch._grouped_mm(a3, mod.w.transpose(-2, -1), bias=bias)
    g = torch.randn_like(out)
    out.backward(g)
    wp = mod.w._data.detach().clone().requires_grad_()
    ap = a3.detach().clone().requires_grad_()
    ref = torch._grouped_mm(ap, wp.transpose(-2, -1)) + bias.unsqueeze(1)
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(mod.w.grad, wp.grad) and torch.equal(a3.grad, ap.grad)


def test_allow_fallback_false_raises():
    mod = converted(allow_fallback=False)
    with pytest.raises(ValueError, match="3D x 3D.*allow_fallback=False"):
        torch._grouped_mm(torch.randn(E, 8, K, dtype=torch.bfloat16), mod.w.transpose(-2, -1))


# ----------------------------------------------------------------------------- bmm (HF Llama4)

T = 24  # tokens per expert, not a multiple of 32


def converted_ekn(dtype=torch.bfloat16, k=K, **cfg):
    """A converted (E, K, N) weight, the layout Llama4 multiplies with torch.bmm."""
    torch.manual_seed(0)
    mod = Experts(dtype=dtype, shape=(E, k, N))
    convert_parameters(mod, MXFP8MoEConfig(**cfg))
    return mod


BMM_CALLS = {
    "torch.bmm": lambda x, w: torch.bmm(x, w),
    "torch.bmm named": lambda x, w: torch.bmm(input=x, mat2=w),
    "Tensor.bmm": lambda x, w: x.bmm(w),
    "torch.matmul": lambda x, w: torch.matmul(x, w),
    "@": lambda x, w: x @ w,
    "aten.bmm.default": lambda x, w: torch.ops.aten.bmm.default(x, w),
}


@pytest.mark.parametrize("call", list(BMM_CALLS))
def test_bmm_is_mxfp8_grouped_mm_with_uniform_groups(call):
    mod = converted_ekn()
    torch.manual_seed(2)
    x = torch.randn(E, T, K, dtype=torch.bfloat16, requires_grad=True)
    out = BMM_CALLS[call](x, mod.w)
    g = torch.randn_like(out)
    out.backward(g)
    xp = x.detach().clone().requires_grad_()
    wp = mod.w._data.detach().clone().requires_grad_()
    offs = torch.arange(1, E + 1, dtype=torch.int32) * T
    ref = mxfp8_grouped_mm(xp.reshape(E * T, K), wp, offs).view(E, T, N)
    ref.backward(g)
    assert type(out) is torch.Tensor and out.shape == (E, T, N) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref) and torch.equal(x.grad, xp.grad)
    assert type(mod.w.grad) is torch.Tensor and torch.equal(mod.w.grad, wp.grad)
    assert not torch.equal(out, torch.bmm(xp.detach(), wp.detach()))  # not the bf16 op
    assert not fallback_counts()


def test_bmm_fp32_follows_the_grouped_mm_rules():
    mod = converted_ekn(dtype=torch.float32)  # fp32 master weights: read as bf16, output fp32 like the plain op
    x = torch.randn(E, T, K)
    offs = torch.arange(1, E + 1, dtype=torch.int32) * T
    ref = mxfp8_grouped_mm(x.reshape(E * T, K), mod.w._data.to(torch.bfloat16), offs, out_dtype=torch.float32)
    assert torch.equal(torch.bmm(x, mod.w), ref.view(E, T, N))
    assert not fallback_counts()


@pytest.mark.parametrize(
    "case, reason",
    [
        ("weight_first", "not the second operand"),
        ("2d_slice", "MXFP8 serves (E, T, K) x (E, K, N)"),  # x @ w[e], as a per-expert loop does
        ("broadcast_batch", "MXFP8 serves (E, T, K) x (E, K, N)"),
        ("k_not_32", "not multiples of 32"),
        ("fp16", "float16"),
        ("out", "keyword arguments ['out']"),
    ],
)
def test_bmm_forms_mxfp8_cannot_serve_fall_back(case, reason, caplog):
    mod = converted_ekn(k=40 if case == "k_not_32" else K)
    if case == "fp16":
        mod.half()
    w, data = mod.w, mod.w._data.detach()
    x = torch.randn(E, T, w.shape[1], dtype=w.dtype)
    calls = {
        "weight_first": lambda w: torch.bmm(w, torch.randn(E, N, 8, dtype=torch.bfloat16, generator=gen)),
        "2d_slice": lambda w: x[0] @ w[1],
        "broadcast_batch": lambda w: torch.matmul(x[:1], w),
        "k_not_32": lambda w: torch.bmm(x, w),
        "fp16": lambda w: torch.bmm(x, w),
        "out": lambda w: bmm_out(x, w),
    }

    @torch.no_grad()  # out= takes no autograd, for the plain op too
    def bmm_out(x, w):
        return torch.bmm(x, w, out=torch.empty(E, T, N, dtype=torch.bfloat16))

    gen = torch.Generator().manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        for _ in range(2):
            gen.manual_seed(3)
            out = calls[case](w)
    gen.manual_seed(3)
    expected = calls[case](data)
    assert type(out) is torch.Tensor and torch.equal(out, expected)
    counts = fallback_counts()
    assert len(counts) == 1 and reason in next(iter(counts)), counts
    assert next(iter(counts.values())) == 2 and caplog.text.count("fallback") == 1
    conversion._reconfigure(mod, "w", mod.w, dataclasses.replace(mod.w.config, allow_fallback=False))
    with pytest.raises(ValueError, match=re.escape(reason) + ".*allow_fallback=False"):
        calls[case](mod.w)


def test_bmm_fallback_keeps_autograd():
    mod = converted_ekn()
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    out = x @ mod.w[1]  # a per-expert slice: counted, runs the plain op, gradients reach the parameter
    g = torch.randn_like(out)
    out.backward(g)
    wp = mod.w._data.detach().clone().requires_grad_()
    xp = x.detach().clone().requires_grad_()
    (xp @ wp[1]).backward(g)
    assert torch.equal(x.grad, xp.grad) and torch.equal(mod.w.grad, wp.grad)
    x[:5].detach() @ mod.w[2]  # another token count: the same reason (logged once, not once per shape)
    assert list(fallback_counts().values()) == [2]


def test_grouped_mm_below_torch_function_is_counted():
    mod = converted()
    a, offs = operands()
    with torch._C.DisableTorchFunctionSubclass():
        out = torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=offs)
    assert type(out) is torch.Tensor
    assert torch.equal(out, torch._grouped_mm(a, _plain_w(mod), offs=offs))
    assert any("__torch_dispatch__" in r for r in fallback_counts())


def test_bad_offs_raise_clear_errors():
    mod = converted()
    a, _ = operands()
    with pytest.raises(TypeError, match="offs"):
        torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=torch.tensor([10, 20, 30, M]))  # int64
    with pytest.raises(ValueError, match="offs"):
        torch._grouped_mm(a, mod.w.transpose(-2, -1), offs=torch.tensor([10, 20], dtype=torch.int32))
    with pytest.raises(TypeError, match="unexpected keyword"):
        torch._grouped_mm(a, mod.w.transpose(-2, -1), offsets=torch.tensor([M] * E, dtype=torch.int32))


# ----------------------------------------------------------------------------- tensor behaviour


def test_views_and_copies_keep_the_wrapper():
    mod = converted()
    w, data = mod.w, mod.w._data
    keep = {
        "transpose": (lambda t: t.transpose(-2, -1)),
        "mT": (lambda t: t.mT),
        "permute": (lambda t: t.permute(0, 2, 1)),
        "view": (lambda t: t.view(E, -1)),
        "reshape": (lambda t: t.reshape(-1)),
        "getitem": (lambda t: t[1:3]),
        "select": (lambda t: t[0]),
        "split": (lambda t: t.split(2)[1]),
        "detach": (lambda t: t.detach()),
        "clone": (lambda t: t.clone()),
        "contiguous": (lambda t: t.transpose(1, 2).contiguous()),
        "to float": (lambda t: t.to(torch.float32)),
        "float()": (lambda t: t.float()),
        "to cpu": (lambda t: t.to("cpu", copy=True)),
        "empty_like": (lambda t: torch.empty_like(t)),
        "new_zeros": (lambda t: t.new_zeros(t.shape)),
    }
    for name, fn in keep.items():
        out = fn(w)
        assert type(out) is MXFP8ExpertWeight, name
        assert out.config == w.config, name
        if name not in ("empty_like", "new_zeros"):
            assert torch.equal(out._data, fn(data)), name
    # views share storage with the wrapped tensor
    assert w.transpose(-2, -1)._data.data_ptr() == data.data_ptr()
    assert w.detach()._data.data_ptr() == data.data_ptr()
    assert w.clone()._data.data_ptr() != data.data_ptr()


def test_other_ops_return_plain_tensors_with_plain_values():
    mod = converted()
    w, data = mod.w, mod.w._data.detach()
    x = torch.randn(K, 8, dtype=torch.bfloat16)
    ops = {
        "add": (lambda t: t + 1),
        "mul": (lambda t: t * t),
        "sum": (lambda t: t.sum()),
        "linear": (lambda t: F.linear(x.t(), t[0])),
        "linear+bias": (lambda t: F.linear(x.t(), t[0], torch.ones(N, dtype=torch.bfloat16))),
        "zeros_like": (lambda t: torch.zeros_like(t)),
        "norm": (lambda t: t.float().norm()),
        "eq": (lambda t: t == t),
    }
    for name, fn in ops.items():
        out = fn(w)
        assert type(out) is torch.Tensor, name
        assert torch.equal(out, fn(data)), name
    assert not fallback_counts()


def test_inplace_ops_update_the_wrapped_tensor():
    mod = converted()
    w = mod.w
    src = torch.randn(E, N, K, dtype=torch.bfloat16)
    with torch.no_grad():
        r = w.copy_(src)
        assert r is w and torch.equal(w._data, src)
        w.mul_(2).add_(1)
        assert torch.equal(w._data, src * 2 + 1)
        w[0].zero_()
        assert torch.equal(w._data[0], torch.zeros(N, K, dtype=torch.bfloat16))
        nn.init.normal_(w)
        assert w._data.std() > 0.5
    plain = torch.empty(E, N, K, dtype=torch.bfloat16)
    plain.copy_(w)
    assert torch.equal(plain, w._data)


def test_deepcopy_module_to_and_pickle():
    mod = converted()
    cp = copy.deepcopy(mod)
    assert type(cp.w) is MXFP8ExpertWeight and isinstance(cp.w, nn.Parameter)
    assert torch.equal(cp.w._data, mod.w._data) and cp.w._data.data_ptr() != mod.w._data.data_ptr()
    mod.to(torch.float32)
    assert type(mod.w) is MXFP8ExpertWeight and mod.w._data.dtype == torch.float32
    assert mod.b.dtype == torch.float32
    buf = io.BytesIO()
    torch.save(cp.w, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back) is MXFP8ExpertWeight and torch.equal(back._data, cp.w._data)


def test_meta_init_then_to_empty():
    with torch.device("meta"):
        model = MoE(64, 96, 4, 2)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    assert model.experts.w1.is_meta and type(model.experts.w1) is MXFP8ExpertWeight
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.experts.init_weights()
    nn.init.normal_(model.router.gate.weight, std=0.02)
    model.to(torch.bfloat16)
    assert type(model.experts.w1) is MXFP8ExpertWeight and model.experts.w1.device.type == "cpu"
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    model(x).float().pow(2).mean().backward()
    assert torch.isfinite(model.experts.w1.grad).all() and model.experts.w1.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("opt_kwargs", [dict(foreach=False), dict(foreach=True), dict(fused=True), dict()])
def test_adamw_updates_match_plain_parameters(opt_kwargs):
    torch.manual_seed(0)
    plain = MoE(64, 96, 4, 2).to(torch.bfloat16)
    conv = copy.deepcopy(plain)
    quantize_(conv, MXFP8MoEConfig(), filter_fn=EXPERTS)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, **opt_kwargs)
    opt_c = torch.optim.AdamW(conv.parameters(), lr=1e-2, weight_decay=0.1, **opt_kwargs)
    for step in range(3):
        x = torch.randn(128, 64, dtype=torch.bfloat16)
        conv(x).float().pow(2).mean().backward()
        # the same gradients on both, so only the optimizer step is compared
        for p, c in zip(plain.parameters(), conv.parameters()):
            p.grad = c.grad.clone()
        opt_p.step()
        opt_c.step()
        opt_p.zero_grad()
        opt_c.zero_grad()
    for (n, p), c in zip(plain.named_parameters(), conv.parameters()):
        if "experts" in n:
            assert type(c) is MXFP8ExpertWeight, n
            assert not torch.equal(c._data, p.new_zeros(()).expand_as(p))
            c = c._data
        assert torch.equal(p, c), n
    for state in opt_c.state.values():  # optimizer state stays plain (checkpointable)
        assert all(type(v) is torch.Tensor for v in state.values())


# ----------------------------------------------------------------------------- state_dict


def test_state_dict_round_trip_with_unconverted_model():
    torch.manual_seed(0)
    conv = TinyMoEModel(32, 64, 96, 4, 2, 1, 32).to(torch.bfloat16)
    plain = copy.deepcopy(conv)
    quantize_(conv, MXFP8MoEConfig(), filter_fn=EXPERTS)
    with torch.no_grad():
        for p in conv.parameters():
            p.add_(0.5)
    sd = conv.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    # converted checkpoint -> unconverted model
    plain.load_state_dict(loaded)
    for (n, p), v in zip(plain.named_parameters(), loaded.values()):
        assert type(p) is nn.Parameter and torch.equal(p, v), n
    # unconverted checkpoint -> fresh converted model (copy and assign)
    for assign in (False, True):
        torch.manual_seed(1)
        fresh = TinyMoEModel(32, 64, 96, 4, 2, 1, 32).to(torch.bfloat16)
        quantize_(fresh, MXFP8MoEConfig(scale_mode="floor"), filter_fn=EXPERTS)
        fresh.load_state_dict(plain.state_dict(), assign=assign)
        for n, p in fresh.named_parameters():
            data = p._data if "experts" in n else p
            if "experts" in n:
                assert type(p) is MXFP8ExpertWeight and p.config.scale_mode.value == "floor", (n, assign)
            assert torch.equal(data, sd[n]), (n, assign)
    # keep_vars returns the parameters themselves
    assert type(conv.state_dict(keep_vars=True)["layers.0.moe.experts.w1"]) is MXFP8ExpertWeight
