"""transformers' SwiGLU experts (concatenated ``gate_up_proj``, the default gate, silu, no bias) run the fused
block :func:`moe_quant.mxfp8_swiglu_experts_w13` once converted, and equal their per-GEMM conversion (the
experts-interface forward through two MXFP8 grouped GEMMs, ``_apply_gate`` between) bit for bit: loss and
every gradient. Modules that are not that block (GPT-OSS: biases and its own gate; Llama4: bmm) keep the
per-GEMM path."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchao.quantization import quantize_  # noqa: E402

from examples.hf_train import EXPERTS_FILTER, build_config, build_model  # noqa: E402
from moe_quant import MXFP8MoEConfig, fallback_counts  # noqa: E402
from moe_quant.autograd import grouped_mm as gm  # noqa: E402
from moe_quant.autograd import swiglu_block as sb  # noqa: E402
from moe_quant.conversion import hf  # noqa: E402

PLAIN = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")  # transformers' default gate over gate_up_proj
LAYERS, EXPERTS, TOP_K, BATCH, SEQ, VOCAB = 2, 16, 2, 2, 8, 128


def tiny(family):
    return build_config(family, hidden=64, intermediate=32, experts=EXPERTS, top_k=TOP_K, layers=LAYERS, vocab=VOCAB)


@pytest.fixture
def calls(monkeypatch):
    """Forward calls of the block's and of the per-GEMM autograd functions."""
    seen = {"block": 0, "gemm": 0}
    for key, cls in (("block", sb._SwiGLUExperts), ("gemm", gm._MXFP8GroupedMM)):
        def spy(*args, _apply=cls.apply, _key=key):
            seen[_key] += 1
            return _apply(*args)

        monkeypatch.setattr(cls, "apply", spy)
    return seen


def experts_modules(model):
    return [m for n, m in model.named_modules() if EXPERTS_FILTER(m, n)]


def step(model, device):
    """Loss and every gradient of one forward + backward (the parameters' grads are reset first)."""
    for p in model.parameters():
        p.grad = None
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)).to(device)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # every byte


def check_block_equals_per_gemm(family, calls, monkeypatch, device):
    ref = build_model(tiny(family), seed=1, device=device, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    assert all(hf.is_plain_swiglu(m) for m in experts_modules(model))
    loss, grads = step(model, device)
    assert calls == {"block": LAYERS, "gemm": 0} and fallback_counts() == {}

    # the per-GEMM conversion of the same modules: transformers' experts forward, its _apply_gate between
    monkeypatch.setattr(hf, "is_plain_swiglu", lambda module: False)
    calls.update(block=0, gemm=0)
    loss_pg, grads_pg = step(model, device)
    assert calls == {"block": 0, "gemm": 2 * LAYERS}
    assert_same_bits(loss, loss_pg)
    experts_grads = [n for n in grads if ".experts." in n]
    assert len(experts_grads) == 2 * LAYERS and all(grads[n].abs().sum() > 0 for n in experts_grads)
    for name in grads:
        assert_same_bits(grads[name], grads_pg[name])
    loss_bf16, _ = step(ref, device)
    assert abs(loss.item() - loss_bf16.item()) < 1e-2 * loss_bf16.item()  # MXFP8, close to bf16


@pytest.mark.parametrize("family", PLAIN)
def test_plain_swiglu_families_run_the_block_bit_equal_to_their_per_gemm_conversion(family, calls, monkeypatch):
    check_block_equals_per_gemm(family, calls, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", PLAIN)
def test_plain_swiglu_families_run_the_block_bit_equal_on_cuda(family, calls, monkeypatch):
    assert torch.cuda.is_available()
    check_block_equals_per_gemm(family, calls, monkeypatch, "cuda")


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_other_experts_keep_the_per_gemm_path(family, calls):
    model = build_model(tiny(family), seed=1, dtype=torch.bfloat16)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    if family == "gpt_oss":  # biases and its own clamped gate
        assert not any(hf.is_plain_swiglu(m) for m in experts_modules(model))
    step(model, "cpu")
    assert calls["block"] == 0 and calls["gemm"] == 2 * LAYERS


def test_fused_block_false_keeps_per_gemm_with_the_same_bits(calls):
    model = build_model(tiny("qwen3_moe"), seed=1, dtype=torch.bfloat16)
    per_gemm = copy.deepcopy(model)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    quantize_(per_gemm, MXFP8MoEConfig(fused_block=False), filter_fn=EXPERTS_FILTER)
    loss, grads = step(model, "cpu")
    assert calls == {"block": LAYERS, "gemm": 0}
    calls.update(block=0, gemm=0)
    loss_pg, grads_pg = step(per_gemm, "cpu")
    assert calls == {"block": 0, "gemm": 2 * LAYERS}
    assert_same_bits(loss, loss_pg)
    for name in grads:
        assert_same_bits(grads[name], grads_pg[name])


def test_transposed_weights_give_the_same_block(calls):
    """A module storing ``gate_up_proj`` as ``(E, D, 2H)`` and ``down_proj`` as ``(E, H, D)`` (``is_transposed``)
    computes what the ``(E, 2H, D)`` / ``(E, D, H)`` module computes, and its gradients are the transposes."""
    model = build_model(tiny("mixtral"), seed=1, dtype=torch.bfloat16)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    mod = experts_modules(model)[0]
    flipped = copy.deepcopy(mod)
    flipped.is_transposed = True
    flipped.gate_up_proj = torch.nn.Parameter(mod.gate_up_proj.detach().transpose(1, 2).contiguous())
    flipped.down_proj = torch.nn.Parameter(mod.down_proj.detach().transpose(1, 2).contiguous())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, generator=g).bfloat16()
    idx = torch.randint(0, EXPERTS, (12, TOP_K), generator=g)
    wts = torch.rand(12, TOP_K, generator=g).bfloat16()
    outs = []
    for m in (mod, flipped):
        out = m(x, idx, wts)
        out.float().square().sum().backward()
        outs.append(out)
    assert calls["block"] == 2 and calls["gemm"] == 0
    assert_same_bits(outs[0], outs[1])
    assert_same_bits(mod.gate_up_proj.grad, flipped.gate_up_proj.grad.transpose(1, 2).contiguous())
    assert_same_bits(mod.down_proj.grad, flipped.down_proj.grad.transpose(1, 2).contiguous())
    assert mod.gate_up_proj.grad.abs().sum() > 0


def test_compiled_model_equals_eager(calls):
    """``torch.compile`` of a converted Qwen3-MoE model: one block per MoE layer in the graph (its forward op;
    per GEMM it would be two autograd functions), and loss and gradients equal eager's bit for bit."""
    from torch._dynamo.backends.common import aot_autograd  # noqa: F401  (aot_eager's machinery)
    from torch._dynamo.backends.debugging import aot_eager

    model = build_model(tiny("qwen3_moe"), seed=1, dtype=torch.bfloat16)
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    loss, grads = step(model, "cpu")
    assert calls == {"block": LAYERS, "gemm": 0}
    blocks, functions = [], []

    def counting(gm, example_inputs):
        blocks.extend(n for n in gm.graph.nodes if n.target is torch.ops.moe_quant.swiglu_block_fwd.default)
        functions.extend(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.autograd_function_apply)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    loss_c, grads_c = step(torch.compile(model, backend=counting), "cpu")
    assert len(blocks) == LAYERS and not functions
    assert_same_bits(loss, loss_c)
    for name in grads:
        assert_same_bits(grads[name], grads_c.get(name, grads_c.get("_orig_mod." + name)))


def test_classes_the_block_check_saw_are_not_kept_alive(calls):
    """``is_plain_swiglu`` looks at the module's class (its gate): a class made at run time (a factory, a notebook
    cell run again) is collected once nothing else uses it (issue 55; a cache keyed by class would hold each one)."""
    import gc
    import weakref

    from moe_quant.conversion import convert

    experts_class = type(experts_modules(build_model(tiny("qwen3_moe"), seed=1))[0])

    def run_once():
        cls = type("MadeAtRunTime", (experts_class,), {})
        mod = cls(tiny("qwen3_moe")).to(torch.bfloat16)
        convert(mod, MXFP8MoEConfig())
        x = torch.randn(8, mod.gate_up_proj.shape[-1], dtype=torch.bfloat16)
        mod(x, torch.randint(0, EXPERTS, (8, TOP_K)), torch.rand(8, TOP_K, dtype=torch.bfloat16))
        assert hf.is_plain_swiglu(mod)
        return weakref.ref(cls)

    ref = run_once()
    assert calls["block"] == 1
    gc.collect()
    assert ref() is None
