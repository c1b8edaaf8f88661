"""Compiling a converted model warns about nothing in moe_quant: dynamo warns once per process about each
``functools.lru_cache``-wrapped function it traces into (and ignores the cache), so no function the converted
forwards call while traced may carry one (``backends.device_capability`` on CUDA, the transformers forward's
gate checks)."""

import warnings

import pytest
import torch
from torchao.quantization import quantize_

from moe_quant import MXFP8MoEConfig, backends
from moe_quant.moe import MoE


@pytest.fixture
def dynamo_warnings(monkeypatch):
    """The warnings raised from here on, as dynamo raises them in a fresh process (its warn-once memory empty)."""
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen
    torch._dynamo.reset()


def about_moe_quant(seen) -> list[str]:
    return [str(w.message) for w in seen if "moe_quant" in f"{w.message} {w.filename}"]


def test_compiled_converted_moe_warns_nothing_about_moe_quant(dynamo_warnings):
    torch.manual_seed(0)
    moe = MoE(64, 96, 4, 2).to(torch.bfloat16)
    quantize_(moe, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    torch.compile(moe, backend="aot_eager", fullgraph=True)(torch.randn(32, 64).to(torch.bfloat16)).sum().backward()
    assert moe.experts.w1.grad is not None
    assert not about_moe_quant(dynamo_warnings), about_moe_quant(dynamo_warnings)


def test_compiled_converted_transformers_model_warns_nothing_about_moe_quant(dynamo_warnings):
    pytest.importorskip("transformers")
    from examples.hf_train import EXPERTS_FILTER, build_config, build_model
    from moe_quant.conversion import hf

    model = build_model(build_config("mixtral", hidden=64, intermediate=32, experts=4, top_k=2, layers=1, vocab=128))
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    experts = [m for n, m in model.named_modules() if EXPERTS_FILTER(m, n)]
    assert experts and all(hf.is_plain_swiglu(m) for m in experts)  # the forward runs the gate checks
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    assert not about_moe_quant(dynamo_warnings), about_moe_quant(dynamo_warnings)


def test_device_capability_traces_without_a_cache_warning(dynamo_warnings, monkeypatch):
    """On CUDA the traced forwards ask ``backends`` about the device (kernels or reference, scaled or emulated
    GEMM, zero-filled empty groups), which asks for its compute capability. Here a CPU-only process answers
    for ``cuda:0`` as an H100 does; the question is asked while dynamo traces, uncached."""
    asked = []

    def h100(index=None):
        asked.append(index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", h100)
    monkeypatch.setattr(backends, "_CAPABILITY", {})
    cuda = torch.device("cuda", 0)

    def f(x):
        kernels_ok = backends.device_capability(cuda) >= (9, 0)
        scaled = backends.supports_scaled_grouped_mm(cuda)
        zero_filled = backends.grouped_mm_zero_fills_empty_groups(cuda)
        return x + (1 if kernels_ok else 0) + (10 if scaled else 0) + (100 if zero_filled else 0)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.zeros(2))
    assert asked, "the capability was not asked for while tracing"
    assert torch.equal(out, torch.full((2,), 101.0))
    assert not about_moe_quant(dynamo_warnings), about_moe_quant(dynamo_warnings)
    assert backends._CAPABILITY == {}  # not filled by the trace (dynamo would guard on it)
