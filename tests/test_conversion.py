"""Model conversion: MXFP8MoEConfig + quantize_ convert expert modules in place (a generated subclass
whose expert GEMMs run in MXFP8; parameters untouched), the grouped-mm / bmm routing and its
fallbacks, re-configuration, unconversion, copies and pickles, optimizers, state_dict round trips."""

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization import quantize_

from moe_quant import mxfp8_grouped_mm, unconvert
from moe_quant.conversion import (
    MXFP8MoEConfig,
    convert,
    converted_class,
    fallback_counts,
    gemm,
    handler,
    is_converted,
    swiglu_experts,
)
from moe_quant.moe import GroupedExperts, TinyMoEModel

E, N, K, M = 4, 64, 96, 80
EXPERTS = lambda mod, fqn: "experts" in fqn  # noqa: E731


@pytest.fixture(autouse=True)
def _clean_warnings():
    handler._WARNED_NOTHING_CONVERTED.clear()  # "nothing converted" warns once per class and process


def operands(m=M, k=K, dtype=torch.bfloat16):
    torch.manual_seed(1)
    a = torch.randn(m, k, dtype=dtype)
    offs = torch.tensor([17, 17, 50, m], dtype=torch.int32)  # an empty group, sizes not multiples of 32
    return a, offs


def experts(dtype=torch.bfloat16, **cfg):
    torch.manual_seed(0)
    return convert(GroupedExperts(K, N, E).to(dtype), MXFP8MoEConfig(**cfg))


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
        (dict(cache_quantized_weights=True), TypeError, "cache_quantized_weights"),  # removed: reuse_quantized_weights
    ],
)
def test_config_rejects_bad_values(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        MXFP8MoEConfig(**kwargs)


def test_convert_rejects_other_configs():
    with pytest.raises(TypeError, match="MXFP8MoEConfig"):
        convert(GroupedExperts(K, N, E), object())


def test_config_module_imports_no_kernel():
    """No kernel, op, compile cache or cutlass module loads; a kernel family's ``config`` (plain constants, no
    cutlass: the fingerprint's definition reads its two from one) and the packages around it may."""
    import subprocess
    import sys

    code = ("import sys, moe_quant.conversion.config as c; "
            "print([m for m in sorted(sys.modules) if m.startswith(('moe_quant.kernels', 'cutlass'))"
            " and not hasattr(sys.modules[m], '__path__') and not m.endswith('.config')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- conversion


def test_quantize_converts_expert_modules_in_place():
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    converted = {n for n, m in model.named_modules() if is_converted(m)}
    assert converted == {f"layers.{i}.moe.experts" for i in range(2)}
    for name in converted:
        mod = model.get_submodule(name)
        assert isinstance(mod, GroupedExperts) and type(mod) is converted_class(GroupedExperts)
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    for n, p in after.items():  # the same Parameter objects, values untouched, plain
        assert p is params[n] and type(p) is nn.Parameter and torch.equal(p, before[n])
    assert model.state_dict().keys() == {n for n in params} | {k for k, _ in model.named_buffers()}


def test_converted_forward_is_swiglu_of_three_mxfp8_grouped_mms():
    torch.manual_seed(0)
    plain = GroupedExperts(K, N, E).to(torch.bfloat16)
    mod = convert(copy.deepcopy(plain), MXFP8MoEConfig(scale_mode="floor"))
    x, offs = operands(k=K)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    x.requires_grad_()
    out = mod(x, counts)
    g = torch.randn_like(out)
    out.backward(g)

    ref_w = {n: p.detach().clone().requires_grad_() for n, p in plain.named_parameters()}
    xr = x.detach().clone().requires_grad_()

    def gmm(a, w):
        return mxfp8_grouped_mm(a, w.transpose(-2, -1), offs, scale_mode="floor")

    ref = gmm(F.silu(gmm(xr, ref_w["w1"])) * gmm(xr, ref_w["w3"]), ref_w["w2"])
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(x.grad, xr.grad)
    for n, p in mod.named_parameters():
        assert torch.equal(p.grad, ref_w[n].grad), n
    assert not torch.equal(out, plain(x.detach(), counts))  # not the bf16 op
    assert not fallback_counts()


def test_fp32_weights_are_read_as_bf16():
    mod = experts(torch.float32)
    x, offs = operands(dtype=torch.float32)
    out = swiglu_experts(x, mod.w1, mod.w3, mod.w2, offs, MXFP8MoEConfig())
    bf = {n: p.detach().bfloat16() for n, p in mod.named_parameters()}
    ref = swiglu_experts(x, bf["w1"], bf["w3"], bf["w2"], offs, MXFP8MoEConfig(out_dtype=torch.float32))
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    out.sum().backward()
    assert mod.w1.grad.dtype == torch.float32 and mod.w1.grad.shape == mod.w1.shape


def test_unknown_module_class_names_what_is_supported():
    class Mine(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(E, N, K))

    with pytest.raises(TypeError, match=r"cannot convert .*Mine.*GroupedExperts.*_grouped_mm\(self, \*, A, B_t, offs\)"):
        quantize_(nn.Sequential(Mine()), MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, Mine))


class SeamExperts(nn.Module):
    """A user module: its forward calls the ``_grouped_mm`` seam for each expert GEMM."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(E, N, K, dtype=torch.bfloat16) * 0.1)

    def forward(self, a, offs):
        return self._grouped_mm(A=a, B_t=self.w.transpose(-2, -1), offs=offs)

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)


def test_grouped_mm_seam_of_any_module_runs_mxfp8():
    mod = SeamExperts()
    plain = copy.deepcopy(mod)
    quantize_(mod, MXFP8MoEConfig(), filter_fn=lambda m, fqn: isinstance(m, SeamExperts))
    a, offs = operands()
    assert torch.equal(mod(a, offs), mxfp8_grouped_mm(a, plain.w.detach().transpose(-2, -1), offs))
    pickle.loads(pickle.dumps(mod))  # a class defined in a test module pickles too


def test_fqn_to_config_of_a_single_parameter_is_refused():
    from torchao.quantization import FqnToConfig

    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="whole expert modules"):
        quantize_(model, FqnToConfig({"layers.0.moe.experts.w1": MXFP8MoEConfig()}), filter_fn=None)
    quantize_(model, FqnToConfig({r"re:layers\.1\.moe\.experts": MXFP8MoEConfig(scale_mode="floor")}),
              filter_fn=None)
    assert [n for n, m in model.named_modules() if is_converted(m)] == ["layers.1.moe.experts"]
    assert model.layers[1].moe.experts._mxfp8_config.scale_mode.value == "floor"


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
    assert {n for n, m in model.named_modules() if is_converted(m)} == {f"layers.{i}.moe.experts" for i in range(4)}


def test_isinstance_filter_converts_routed_experts_without_warnings(caplog):
    model = _TitanStyleMoE(n_layers=3)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    assert "nothing converted" not in caplog.text
    assert {n for n, m in model.named_modules() if is_converted(m)} == {f"layers.{i}.moe.experts" for i in range(3)}


def test_quantize_again_reconfigures_in_place():
    """RCEIL, then FLOOR: the second config wins; parameters and optimizer untouched."""
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    fresh_floor = copy.deepcopy(model)
    quantize_(model, MXFP8MoEConfig(scale_mode="rceil"), filter_fn=EXPERTS)
    quantize_(fresh_floor, MXFP8MoEConfig(scale_mode="floor"), filter_fn=EXPERTS)
    x = torch.randn(64, 32, dtype=torch.bfloat16) * 50
    out_rceil = model(x)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    quantize_(model, MXFP8MoEConfig(scale_mode="floor"), filter_fn=EXPERTS)
    assert all(model.get_parameter(n) is p for n, p in params.items())
    assert opt.param_groups[0]["params"][0] is next(model.parameters())
    out_floor = model(x)
    assert torch.equal(out_floor, fresh_floor(x)) and not torch.equal(out_floor, out_rceil)
    assert {m._mxfp8_config.scale_mode.value for m in model.modules() if is_converted(m)} == {"floor"}


# ----------------------------------------------------------------------------- routing and fallbacks


@pytest.mark.parametrize(
    "case, reason",
    [("3d", "3D x 3D"), ("no_offs", "without offs"), ("fp16", "float16"), ("k_not_32", "not a multiple of 32")],
)
def test_fallback_runs_plain_op_and_is_counted_and_logged_once(case, reason, caplog):
    torch.manual_seed(0)
    w_t = (torch.randn(E, N, K, dtype=torch.bfloat16) * 0.1).transpose(-2, -1)
    a, offs = operands()
    if case == "3d":
        a, offs = torch.randn(E, 8, K, dtype=torch.bfloat16), None
    elif case == "no_offs":
        offs = None
    elif case == "fp16":
        a, w_t = a.half(), w_t.half()
    else:
        a, w_t = a[:, :40].contiguous(), w_t[:, :40]
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        try:
            expected = torch._grouped_mm(a, w_t, offs=offs)
        except RuntimeError:  # the plain op refuses: so does the fallback
            with pytest.raises(RuntimeError):
                gemm.grouped_mm(a, w_t, offs, MXFP8MoEConfig())
            expected = None
        else:
            for _ in range(3):
                out = gemm.grouped_mm(a, w_t, offs, MXFP8MoEConfig())
            assert torch.equal(out, expected)
    counts = fallback_counts()
    assert len(counts) == 1 and reason in next(iter(counts)), counts
    assert next(iter(counts.values())) == (1 if expected is None else 3)
    assert caplog.text.count("fallback to the plain op") == 1, caplog.text
    with pytest.raises(ValueError, match="allow_fallback=False"):
        gemm.grouped_mm(a, w_t, offs, MXFP8MoEConfig(allow_fallback=False))


T = 24  # tokens per expert, not a multiple of 32


def test_bmm_is_mxfp8_grouped_mm_with_uniform_groups():
    torch.manual_seed(0)
    w = (torch.randn(E, K, N, dtype=torch.bfloat16) * 0.1).requires_grad_()
    x = torch.randn(E, T, K, dtype=torch.bfloat16, requires_grad=True)
    out = gemm.bmm(x, w, MXFP8MoEConfig())
    offs = torch.arange(1, E + 1, dtype=torch.int32) * T
    ref = mxfp8_grouped_mm(x.reshape(E * T, K), w, offs).view(E, T, N)
    assert out.shape == (E, T, N) and torch.equal(out, ref)
    assert not fallback_counts()
    with pytest.raises(ValueError, match="allow_fallback=False"):
        gemm.bmm(torch.randn(E, T, K + 1, dtype=torch.bfloat16), w, MXFP8MoEConfig(allow_fallback=False))


def test_bad_offs_raise_clear_errors():
    mod = experts()
    x = torch.randn(M, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offs"):
        mod(x, torch.tensor([10, -20, 30, 40], dtype=torch.int32))


# ----------------------------------------------------------------------------- no_grad / inference_mode


@pytest.mark.parametrize("prepare", ["as_is", "eval", "requires_grad_false"])
def test_trained_model_evaluates_in_no_grad_and_inference_mode(prepare):
    torch.manual_seed(0)
    model = TinyMoEModel(32, 64, 96, 4, 2, 2, 32).to(torch.bfloat16)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    if prepare == "eval":
        model.eval()
    elif prepare == "requires_grad_false":
        model.requires_grad_(False)
    with torch.no_grad():
        ref = model(x)
    with torch.inference_mode():
        out = model(x)
    assert out.is_inference() and torch.equal(out, ref)
    model.train().requires_grad_(True)
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    assert not fallback_counts()


# ----------------------------------------------------------------------------- unconvert, copies, pickles


def test_unconvert_restores_the_class_and_keeps_the_parameters():
    mod = experts()
    params = dict(mod.named_parameters())
    unconvert(mod)
    assert type(mod) is GroupedExperts and "_mxfp8_config" not in mod.__dict__
    assert all(mod.get_parameter(n) is p for n, p in params.items())


def test_deepcopy_to_save_load_and_pickle():
    mod = experts()
    a, offs = operands()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    ref = mod(a, counts)
    copies = [copy.deepcopy(mod), pickle.loads(pickle.dumps(mod)), mod.float().bfloat16()]
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    copies.append(torch.load(buf, weights_only=False))
    for c in copies:
        assert type(c) is type(mod) and c._mxfp8_config == mod._mxfp8_config
        assert torch.equal(c(a, counts), ref)
    c = copies[0]
    with torch.no_grad():
        c.w1.mul_(2)
    assert not torch.equal(c.w1, mod.w1)  # independent


def test_meta_init_then_to_empty():
    with torch.device("meta"):
        model = TinyMoEModel(32, 64, 96, 4, 2, 1, 32)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    model.to_empty(device="cpu")
    for mod in model.modules():
        if isinstance(mod, GroupedExperts):
            mod.init_weights()
    model(torch.randn(16, 32)).sum().backward()
    assert is_converted(model.layers[0].moe.experts) and not fallback_counts()


@pytest.mark.parametrize("opt_kwargs", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_adamw_updates_match_plain_parameters(opt_kwargs):
    torch.manual_seed(0)
    plain = GroupedExperts(K, N, E)
    conv = convert(copy.deepcopy(plain), MXFP8MoEConfig())
    grads = {n: torch.randn_like(p) for n, p in plain.named_parameters()}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, **opt_kwargs) for m in (plain, conv)]
    for m, opt in zip((plain, conv), opts):
        for n, p in m.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    for (n, p), q in zip(plain.named_parameters(), conv.parameters()):
        assert torch.equal(p, q), n


def test_state_dict_round_trip_with_unconverted_model():
    torch.manual_seed(0)
    conv = TinyMoEModel(32, 64, 96, 4, 2, 1, 32).to(torch.bfloat16)
    quantize_(conv, MXFP8MoEConfig(), filter_fn=EXPERTS)
    sd = conv.state_dict()
    assert all(type(t) is torch.Tensor for t in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True
    plain = TinyMoEModel(32, 64, 96, 4, 2, 1, 32).to(torch.bfloat16)
    plain.load_state_dict(loaded)
    for (n, p), q in zip(plain.named_parameters(), conv.parameters()):
        assert torch.equal(p, q), n
    for assign in (False, True):
        conv.load_state_dict(plain.state_dict(), assign=assign)
        assert is_converted(conv.layers[0].moe.experts)
