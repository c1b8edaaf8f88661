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


def test_matched_module_without_experts_warns(caplog):
    model = nn.Sequential(nn.Linear(32, 32))
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: fqn == "")  # no 3-D weight, no experts list
    assert "nothing converted" in caplog.text  # moe_quant.convert raises instead (tests/test_convert.py)


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


class MySwiGLUExperts(GroupedExperts):
    """A user's subclass, defined at module level (pickle finds it by name)."""


def test_converted_class_reads_mxfp8_and_its_name():
    """Issue 56: a converted class is called ``MXFP8<Name>`` where a user reads it (the module's repr, PyTorch's
    error messages); its ``__qualname__`` is the key pickle resolves, so the class, an instance and a copy still
    pickle."""
    torch.manual_seed(0)
    mod = convert(MySwiGLUExperts(K, N, E).bfloat16(), MXFP8MoEConfig())
    cls = type(mod)
    assert cls.__name__ == "MXFP8MySwiGLUExperts" and repr(mod).startswith("MXFP8MySwiGLUExperts(")
    with pytest.raises(AttributeError, match="'MXFP8MySwiGLUExperts' object has no attribute 'w4'"):
        mod.w4
    assert pickle.loads(pickle.dumps(cls)) is cls and type(copy.deepcopy(mod)) is cls
    assert type(pickle.loads(pickle.dumps(mod))) is cls
    assert unconvert(mod).__class__ is MySwiGLUExperts


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


# ----------------------------------------------------------------------------- the converted-class cache


def _subclass_named_experts(act):
    class Experts(GroupedExperts):  # the same module and qualname for every act: a factory
        def forward(self, x, counts):
            return act(super().forward(x, counts))

    return Experts


def test_classes_of_one_name_get_their_own_converted_classes():
    """A factory (and a notebook cell run twice, importlib.reload) makes classes of one module:qualname; each gets
    its own converted class: isinstance holds and its own forward runs."""
    relu_cls, tanh_cls = _subclass_named_experts(torch.relu), _subclass_named_experts(torch.tanh)
    assert relu_cls.__qualname__ == tanh_cls.__qualname__ and relu_cls is not tanh_cls
    torch.manual_seed(0)
    a, b = relu_cls(K, N, E).bfloat16(), tanh_cls(K, N, E).bfloat16()
    convert(a, MXFP8MoEConfig())
    convert(b, MXFP8MoEConfig())
    assert isinstance(a, relu_cls) and isinstance(b, tanh_cls) and not isinstance(b, relu_cls)
    x, offs = operands()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (b(x, counts) < 0).any() and not (a(x, counts) < 0).any()  # tanh's and relu's forwards


def test_converted_classes_are_collected_with_their_class():
    import gc
    import weakref

    cls = _subclass_named_experts(torch.relu)
    mod = convert(cls(K, N, E), MXFP8MoEConfig())
    refs = weakref.ref(cls), weakref.ref(type(mod))
    del cls, mod
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def _module_defining(name, source):
    import sys
    import types

    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(source, module.__dict__)
    return module


SOURCE = """
import torch
from moe_quant.moe import GroupedExperts

class Experts(GroupedExperts):
    def forward(self, x, counts):
        return SCALE * super().forward(x, counts)
"""


def test_redefined_class_pickles_as_plain_pickle_does():
    """A converted module pickles as its own class does: it loads converted while its class is importable; once the
    class is redefined, pickling an instance of the old one raises pickle's own error, as for the plain module."""
    import sys

    name = "moe_quant_test_redefined"
    try:
        module = _module_defining(name, SOURCE.replace("SCALE", "2.0"))
        torch.manual_seed(0)
        old = module.Experts(K, N, E).bfloat16()
        old_plain = copy.deepcopy(old)
        convert(old, MXFP8MoEConfig())
        x, offs = operands()
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        back = pickle.loads(pickle.dumps(old))
        assert type(back) is type(old) and torch.equal(back(x, counts), old(x, counts))
        exec(SOURCE.replace("SCALE", "3.0"), module.__dict__)  # the cell run again
        new = convert(module.Experts(K, N, E).bfloat16(), MXFP8MoEConfig())
        assert type(new) is not type(old) and isinstance(new, module.Experts) and not isinstance(old, module.Experts)
        for obj in (old_plain, old):
            with pytest.raises(pickle.PicklingError, match="not the same object as moe_quant_test_redefined.Experts"):
                pickle.dumps(obj)
        assert type(pickle.loads(pickle.dumps(new))) is type(new)
    finally:
        sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- containers


class _Holder(nn.Module):
    """A user's container around the experts (torchtitan's RoutedExperts holds inner_experts so)."""

    def __init__(self):
        super().__init__()
        self.inner_experts = GroupedExperts(32, 64, 4)
        self.shared = _FeedForward()
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x, counts):
        return self.inner_experts(x, counts) * self.scale + self.shared.w2(self.shared.w1(x))


def test_matched_container_converts_the_experts_modules_inside(caplog):
    """A name filter such as '"experts" in fqn' matches a container before the experts module in it: the expert
    modules inside it are converted (only those), the container keeps its class and forward."""
    torch.manual_seed(0)
    model = nn.Module()
    model.routed_experts = _Holder()
    model.shared_experts = _FeedForward()
    plain = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS)
    assert {n for n, m in model.named_modules() if is_converted(m)} == {"routed_experts.inner_experts"}
    assert type(model.routed_experts) is _Holder
    warnings = [r.getMessage() for r in caplog.records if "nothing converted" in r.getMessage()]
    assert len(warnings) == 1 and "_FeedForward" in warnings[0]  # shared_experts, as before
    x = torch.randn(40, 32)
    counts = torch.tensor([10, 0, 20, 10], dtype=torch.int32)
    inner = convert(copy.deepcopy(plain.routed_experts.inner_experts), MXFP8MoEConfig())
    holder = plain.routed_experts
    ref = inner(x, counts) * holder.scale + holder.shared.w2(holder.shared.w1(x))
    assert torch.equal(model.routed_experts(x, counts), ref)


def test_container_conversion_refuses_before_changing_anything():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = GroupedExperts(32, 64, 4)
            self.conv = nn.Conv1d(4, 4, 3)  # 3-D weight, a PyTorch layer: not an experts module

    model = Mixed()
    with pytest.raises(TypeError, match="cannot convert torch.nn.modules.conv.Conv1d"):
        convert(model, MXFP8MoEConfig())
    assert not any(is_converted(m) for m in model.modules())


# ----------------------------------------------------------------------------- classes layered above


class _Double(nn.Module):
    def forward(self, w):
        return w * 2


def _counts(offs):
    return torch.diff(offs, prepend=offs.new_zeros(1))


def _experts_and_doubled():
    """Experts, their w1, and a copy with w1 doubled (what a doubling parametrization of w1 computes)."""
    torch.manual_seed(0)
    mod = GroupedExperts(K, N, E).bfloat16()
    doubled = copy.deepcopy(mod)
    with torch.no_grad():
        doubled.w1.mul_(2)
    return mod, mod.w1.detach().clone(), doubled


def test_parametrization_registered_before_conversion_is_removable():
    """register_parametrization, convert, remove_parametrizations(leave_parametrized=True): the parametrization's
    class stays on top, so its removal works; the weight is written once and the module stays converted."""
    from torch.nn.utils import parametrize

    mod, w0, doubled = _experts_and_doubled()
    convert(doubled, MXFP8MoEConfig())
    parametrize.register_parametrization(mod, "w1", _Double())
    original = mod.parametrizations.w1.original
    convert(mod, MXFP8MoEConfig())
    x, offs = operands()
    assert torch.equal(mod(x, _counts(offs)), doubled(x, _counts(offs)))  # the parametrization and MXFP8 both ran
    parametrize.remove_parametrizations(mod, "w1", leave_parametrized=True)
    assert mod.w1 is original and torch.equal(mod.w1.detach(), w0 * 2)
    assert type(mod) is converted_class(GroupedExperts) and not parametrize.is_parametrized(mod)
    assert torch.equal(mod(x, _counts(offs)), doubled(x, _counts(offs)))


def test_parametrization_registered_after_conversion_survives_unconvert():
    """convert, register_parametrization (FSDP2 layers a class the same way), unconvert: only the converted class
    goes, the parametrization stays and removes cleanly to the plain class."""
    from torch.nn.utils import parametrize

    mod, w0, doubled = _experts_and_doubled()
    convert(mod, MXFP8MoEConfig())
    parametrize.register_parametrization(mod, "w1", _Double())
    unconvert(mod)
    assert not is_converted(mod) and parametrize.is_parametrized(mod, "w1")
    assert parametrize.type_before_parametrizations(mod) is GroupedExperts
    x, offs = operands()
    assert torch.equal(mod(x, _counts(offs)), doubled(x, _counts(offs)))  # plain, with the parametrization
    parametrize.remove_parametrizations(mod, "w1", leave_parametrized=True)
    assert type(mod) is GroupedExperts and torch.equal(mod.w1.detach(), w0 * 2)


def test_convert_then_unconvert_under_a_layer_restores_the_very_classes():
    from torch.nn.utils import parametrize

    mod = GroupedExperts(K, N, E)
    parametrize.register_parametrization(mod, "w2", _Double())
    layered = type(mod)
    convert(mod, MXFP8MoEConfig())
    assert type(mod) is not layered and type(mod).__bases__[0] is converted_class(GroupedExperts)
    assert type(mod).__name__ == f"Parametrized{converted_class(GroupedExperts).__name__}"
    convert(mod, MXFP8MoEConfig(scale_mode="floor"))  # re-configures, no new layer
    assert type(mod).__bases__[0] is converted_class(GroupedExperts) and mod._mxfp8_config.scale_mode.value == "floor"
    unconvert(mod)
    assert type(mod) is layered
