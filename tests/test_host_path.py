"""Host-time fast paths of mxfp8_grouped_mm (issue 20), each checked against the plain computation on inputs
where a wrong shortcut would differ."""

import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_quant import backends, layouts, mxfp8_grouped_mm
from moe_quant.autograd import grouped_mm as gm
from moe_quant.backends import GemmBackend


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(64, 64, generator=g).bfloat16().requires_grad_()
    W = torch.randn(3, 32, 64, generator=g).bfloat16().requires_grad_()
    offs = torch.tensor([10, 10, 64], dtype=torch.int32)
    return A, W, offs, torch.randn(64, 32, generator=g).bfloat16()


def _spy(monkeypatch, cls):
    calls = []
    apply = cls.apply

    def spy(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(cls, "apply", spy)
    return calls


def test_eager_call_binds_no_signature(monkeypatch):
    """torch.autograd.Function.apply runs inspect.signature on every call of a Function with setup_context;
    the eager path uses the ctx form and must not, with the same values and gradients as the transform form."""
    A, W, offs, g = _problem()
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)
    want = (out, *torch.autograd.grad(out, (A, W), g))
    eager, transforms = _spy(monkeypatch, gm._MXFP8GroupedMM), _spy(monkeypatch, gm._MXFP8GroupedMMTransforms)
    n_sig = []
    real = inspect.signature
    monkeypatch.setattr(torch.autograd.function.inspect, "signature", lambda *a, **k: n_sig.append(1) or real(*a, **k))
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)
    got = (out, *torch.autograd.grad(out, (A, W), g))
    assert len(eager) == 1 and not transforms  # the MXFP8 path ran, in the eager form
    assert not n_sig
    ref = gm._MXFP8GroupedMMTransforms.apply(A, W.transpose(-2, -1), offs, gm.ScaleMode.RCEIL, torch.bfloat16,
                                             GemmBackend.EMULATED)
    ref = (ref, *torch.autograd.grad(ref, (A, W), g))
    for a, b, c in zip(got, want, ref):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_transforms_take_the_setup_context_form(monkeypatch):
    A, W, offs, g = _problem(1)
    eager, transforms = _spy(monkeypatch, gm._MXFP8GroupedMM), _spy(monkeypatch, gm._MXFP8GroupedMMTransforms)
    W_t = W.detach().transpose(-2, -1)
    dA = torch.func.grad(lambda a: (mxfp8_grouped_mm(a, W_t, offs).float() * g.float()).sum())(A.detach())
    assert transforms and not eager
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)
    assert torch.equal(dA, torch.autograd.grad((out.float() * g.float()).sum(), A)[0])
    assert eager


def _sanitize_plain(offs, total):
    return offs.to(torch.int64).clamp(0, total).cummax(0).values.to(torch.int32)


@given(st.lists(st.integers(-2**31, 2**31 - 1), max_size=40), st.integers(0, 2**40))
def test_int32_sanitize_equals_the_int64_definition(values, total):
    offs = torch.tensor(values, dtype=torch.int32)
    got = layouts.sanitize_offsets(offs, total, torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, _sanitize_plain(offs, total))
    assert torch.equal(layouts.sanitize_offsets(offs, total), _sanitize_plain(offs, total).long())


def test_int32_sanitize_is_two_ops_without_conversions():
    offs = torch.tensor([5, -3, 100, 7], dtype=torch.int32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layouts.sanitize_offsets(offs, 50, torch.int32)
    names = [e.name for e in prof.events() if e.cpu_parent is None]
    assert names == ["aten::clamp", "aten::cummax"], names


@pytest.fixture
def fresh_decisions(monkeypatch):
    """Empty dispatch caches and simulated CUDA devices: cuda:0 is SM90, cuda:1 SM100, cuda:2 SM80."""
    monkeypatch.setattr(backends, "_RESOLVED", {})
    monkeypatch.setattr(backends, "_KERNELS_ON", {})
    caps = {0: (9, 0), 1: (10, 0), 2: (8, 0)}
    monkeypatch.setattr(backends, "_CAPABILITY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i])
    monkeypatch.setattr(backends, "cutedsl_importable", lambda: True)
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return current


def test_cached_backend_decision_follows_the_device(fresh_decisions):
    dev = [torch.device("cuda", i) for i in range(3)]
    for _ in range(2):  # first call computes, second hits the cache: same answers
        assert backends.resolve_gemm_backend("auto", dev[0]) is GemmBackend.EMULATED
        assert backends.resolve_gemm_backend("auto", dev[1]) is GemmBackend.SCALED
        assert backends.resolve_gemm_backend(GemmBackend.AUTO, dev[1]) is GemmBackend.SCALED
        assert backends.resolve_gemm_backend("scaled", dev[1]) is GemmBackend.SCALED
        assert backends.resolve_gemm_backend("auto", torch.device("cpu")) is GemmBackend.EMULATED
        with pytest.raises(ValueError, match="backend='scaled' needs"):  # errors are never cached
            backends.resolve_gemm_backend("scaled", dev[0])
        with pytest.raises(ValueError, match="backend must be one of"):
            backends.resolve_gemm_backend("bogus", dev[1])
        assert [backends.use_quant_kernels(SimpleNamespace(device=d)) for d in dev] == [True, True, False]
        assert not backends.use_quant_kernels(SimpleNamespace(device=torch.device("cpu")))


def test_device_without_index_is_decided_for_the_current_device(fresh_decisions):
    """``cuda`` without an index means whichever device is current: never cached."""
    cuda = torch.device("cuda")
    fresh_decisions[0] = 0
    assert backends.resolve_gemm_backend("auto", cuda) is GemmBackend.EMULATED
    assert backends.use_quant_kernels(SimpleNamespace(device=cuda))
    fresh_decisions[0] = 1
    assert backends.resolve_gemm_backend("auto", cuda) is GemmBackend.SCALED
    fresh_decisions[0] = 2
    assert not backends.use_quant_kernels(SimpleNamespace(device=cuda))


def _no_cutlass(monkeypatch):
    """nvidia-cutlass-dsl missing, and its warning not given yet in this process."""
    monkeypatch.setattr(backends, "cutedsl_importable", lambda: False)
    monkeypatch.setattr(backends, "cutedsl_import_error", lambda: "ModuleNotFoundError: No module named 'cutlass'")
    monkeypatch.setattr(backends, "_SAID_NO_KERNELS", [])
    monkeypatch.delenv(backends.DISABLE_KERNELS, raising=False)


def _said(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "nvidia-cutlass-dsl does not import" in r.getMessage()]


def test_hopper_without_the_kernels_says_so_once_with_the_pip_line(fresh_decisions, monkeypatch, caplog):
    """Issue 56: on a Hopper-or-newer GPU without nvidia-cutlass-dsl the reference quantizers run (correct, slower);
    a warning says so once, with the pip line. Not on a GPU the kernels never serve, nor where
    MOE_QUANT_DISABLE_KERNELS=1 chose the reference."""
    _no_cutlass(monkeypatch)
    dev = [torch.device("cuda", i) for i in range(3)]  # SM90, SM100, SM80
    with caplog.at_level(logging.WARNING, logger="moe_quant"):
        assert not backends.use_quant_kernels(SimpleNamespace(device=dev[2]))
        assert not _said(caplog)
        for _ in range(2):
            assert [backends.use_quant_kernels(SimpleNamespace(device=d)) for d in dev] == [False, False, False]
            backends._KERNELS_ON.clear()
    (said,) = _said(caplog)
    assert "pip install 'nvidia-cutlass-dsl>=4.8,<4.9' 'apache-tvm-ffi>=0.1.15,<0.2'" in said
    assert "No module named 'cutlass'" in said and "reference" in said
    caplog.clear()
    monkeypatch.setattr(backends, "_SAID_NO_KERNELS", [])
    monkeypatch.setenv(backends.DISABLE_KERNELS, "1")
    with caplog.at_level(logging.WARNING, logger="moe_quant"):
        assert not backends.use_quant_kernels(SimpleNamespace(device=dev[0]))
    assert not _said(caplog)


def test_the_warning_without_kernels_is_no_graph_break(monkeypatch, caplog):
    """The decision is taken inside traced forwards: the warning runs while Dynamo traces, fullgraph holds."""
    _no_cutlass(monkeypatch)
    monkeypatch.setattr(backends, "device_capability", lambda device: (9, 0))  # a CPU tensor poses as an SM90 one
    monkeypatch.setattr(backends, "_KERNELS_ON", {})
    torch._dynamo.reset()

    def f(x):
        return x + 1 if backends.use_quant_kernels(x) else x - 1

    with caplog.at_level(logging.WARNING, logger="moe_quant"):
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(torch.zeros(2))
    assert torch.equal(out, torch.full((2,), -1.0)) and len(_said(caplog)) == 1


def test_gemm_checks_its_operands_once(monkeypatch):
    """The quantizers the GEMMs call skip the public functions' checks (mxfp8_grouped_mm checked A, W_t, offs;
    autograd hands back grad_out in the output's shape and dtype); the public functions still check."""
    from moe_quant import quantize as q
    from moe_quant import validation as v

    checks, passes = [], []
    for name in ("check_operand_2d", "check_group_offsets"):  # the quantizers' own checks
        monkeypatch.setattr(v, name, lambda *a, _f=getattr(v, name), _n=name, **k: checks.append(_n) or _f(*a, **k))
    for name in ("fake_rowwise", "fake_colwise_k_groups", "fake_3d", "fake_quantize_3d"):
        monkeypatch.setattr(q, name, lambda *a, _f=getattr(q, name), _n=name, **k: passes.append(_n) or _f(*a, **k))
    A, W, offs, g = _problem(2)
    out = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)
    torch.autograd.grad(out, (A, W), g)
    # precondition: A and grad_out both ways, W along K and along N; the public weight quantizer (which parses
    # the mode again and checks W) is not on the path
    assert sorted(passes) == ["fake_3d"] * 2 + ["fake_colwise_k_groups"] * 2 + ["fake_rowwise"] * 2
    assert not checks
    with pytest.raises(ValueError, match="multiple of 32"):
        q.fake_quantize_rowwise(torch.randn(4, 33), "rceil")
    assert checks
