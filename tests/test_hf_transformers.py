"""Hugging Face transformers 5.x as a client: tiny random models of each MoE family converted with
``quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: fqn.endswith(".experts"))`` train in
MXFP8 (every expert GEMM through the MXFP8 autograd function, no fallback) close to the unconverted
model, and their checkpoints load into unconverted models. Skipped only where transformers is absent."""

import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchao.quantization import quantize_  # noqa: E402

from examples.hf_train import EXPERTS_FILTER, FAMILIES, build_config, build_model, parse_args  # noqa: E402
from moe_quant import MXFP8MoEConfig, fallback_counts  # noqa: E402
from moe_quant.autograd import grouped_mm as gm  # noqa: E402
from moe_quant.autograd import swiglu_block as sb  # noqa: E402
from moe_quant.conversion import is_converted  # noqa: E402
from repo_subprocess import run_python  # noqa: E402

LAYERS, HIDDEN, INTER, VOCAB = 2, 64, 32, 128
BATCH, SEQ = 2, 8
# grouped-mm families: 16 experts, top-2 over 16 tokens leaves some experts without tokens;
# Llama4 runs every expert on every token (bmm), so few experts
SIZES = {f: (16, 2) for f in FAMILIES} | {"llama4": (4, 1)}


def tiny(family):
    experts, top_k = SIZES[family]
    return build_config(family, hidden=HIDDEN, intermediate=INTER, experts=experts, top_k=top_k, layers=LAYERS,
                        vocab=VOCAB)


SEED = 1  # model and batch; routing of the MXFP8 model equals the reference's (asserted where it matters)


def ids(seed=SEED):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_of(model, seed=SEED):
    x = ids(seed)
    return model(input_ids=x, labels=x).loss


def convert(model):
    quantize_(model, MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    return model


@pytest.fixture
def mxfp8_calls(monkeypatch):
    """Every forward call of the MXFP8 grouped-GEMM autograd function: (A, W_t, offs)."""
    calls = []
    apply = gm._MXFP8GroupedMM.apply

    def spy(A, W_t, offs, *rest):
        calls.append((A.shape, W_t.detach(), offs.clone()))
        return apply(A, W_t, offs, *rest)

    monkeypatch.setattr(gm._MXFP8GroupedMM, "apply", spy)
    return calls


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record_routing(model):
    """Which tokens each expert module gets, recorded on every forward: the top-k indices (experts
    interface), or for Llama4 (every expert sees every token, unselected ones zeroed) the zero rows."""
    seen = []

    def hook(mod, args):
        seen.append(args[1].clone() if len(args) > 1 else args[0].detach().abs().sum(-1) == 0)

    for name, mod in model.named_modules():
        if EXPERTS_FILTER(mod, name):
            mod.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_in_mxfp8(family, mxfp8_calls):
    cfg = tiny(family)
    experts, top_k = SIZES[family]
    ref = build_model(cfg, seed=SEED)
    model = convert(copy.deepcopy(ref))
    routing_ref, routing = record_routing(ref), record_routing(model)
    expert_params = {n for n, p in ref.named_parameters() if n.rsplit(".", 2)[-2] == "experts" and p.ndim == 3}
    assert len(expert_params) == 2 * LAYERS, sorted(expert_params)  # gate_up_proj and down_proj per layer
    converted = {n for n, m in model.named_modules() if is_converted(m)}
    assert converted == {n.rsplit(".", 1)[0] for n in expert_params}
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())

    loss_ref, loss = loss_of(ref), loss_of(model)
    assert len(mxfp8_calls) == 2 * LAYERS  # both expert GEMMs of every layer, in MXFP8
    assert fallback_counts() == {}
    rows = BATCH * SEQ * top_k if family != "llama4" else experts * BATCH * SEQ
    sizes = torch.cat([torch.diff(offs, prepend=offs.new_zeros(1)) for _, _, offs in mxfp8_calls])
    for a_shape, w_t, offs in mxfp8_calls:
        assert a_shape[0] == rows and offs.numel() == experts and offs[-1] == rows
        # GPT-OSS and Llama4 store (E, K, N) row-major and pass the weight itself; the others pass W.mT
        assert w_t.is_contiguous() == (family in ("gpt_oss", "llama4"))
    if family == "llama4":  # bmm: E uniform groups of all tokens
        assert bool((sizes == BATCH * SEQ).all())
    else:  # histc offsets: unpadded, and some experts get no token (precondition of the test)
        assert bool((sizes == 0).any()) and bool((sizes % 32 != 0).any())

    # a precondition of comparing gradients: quantization noise flipped no routing decision
    assert len(routing) == LAYERS and all(torch.equal(a, b) for a, b in zip(routing, routing_ref))
    assert abs(loss.item() - loss_ref.item()) < 1e-3 * loss_ref.item()
    loss_ref.backward()
    loss.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == grads_ref.keys() and expert_params <= grads.keys()
    for name in grads:
        assert type(grads[name]) is torch.Tensor
        assert rel_err(grads[name], grads_ref[name]) < 0.1, name
    for name in expert_params:
        assert grads[name].abs().sum() > 0, name

    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in expert_params}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert {n for n, m in model.named_modules() if is_converted(m)} == converted
    for name, p in model.named_parameters():
        if name in expert_params:
            assert not torch.equal(p.detach(), before[name]), name
    mxfp8_calls.clear()
    after = loss_of(model)
    assert len(mxfp8_calls) == 2 * LAYERS and fallback_counts() == {}
    assert after.item() < loss.item()  # one AdamW step on the same batch lowers its loss


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_load_into_unconverted_models(family, tmp_path):
    cfg = tiny(family)
    ref = build_model(cfg)
    model = convert(copy.deepcopy(ref))
    sd = model.state_dict()
    assert all(type(t) is torch.Tensor for t in sd.values())
    assert sd.keys() == ref.state_dict().keys()

    plain = build_model(cfg, seed=1)  # other weights, then the converted model's checkpoint
    assert not torch.equal(plain.lm_head.weight, ref.lm_head.weight)
    plain.load_state_dict(sd, strict=True)
    for (name, p), q in zip(plain.named_parameters(), ref.parameters()):
        assert type(p) is torch.nn.Parameter and torch.equal(p, q), name
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids()).logits, ref(input_ids=ids()).logits)

    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path)
    for (name, p), q in zip(loaded.named_parameters(), ref.parameters()):
        assert type(p) is torch.nn.Parameter and torch.equal(p, q), name
    convert(loaded)
    with torch.no_grad():
        assert torch.equal(loss_of(loaded), loss_of(model))  # the same MXFP8 model again
    assert fallback_counts() == {}


def test_example_script_trains_both_copies():
    r = run_python("-m", "examples.hf_train", "--family", "qwen3_moe", "--layers", "1", "--experts", "8",
                   "--hidden", "64", "--intermediate", "32", "--vocab", "128", "--tokens", "64", "--seq", "32",
                   "--steps", "3", "--warmup", "1", "--every", "1", "--device", "cpu", warm=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("qwen3_moe: 1 layers, 8 experts top-2, hidden 64"), r.stdout
    assert "converted expert weights: 2; fallbacks: none" in lines, r.stdout
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "3"], r.stdout
    for _, bf16, mxfp8, _ in rows:
        assert abs(float(mxfp8) - float(bf16)) < 0.01 * float(bf16), r.stdout
    assert any(line.startswith("step ms (median of steps 2-3): bf16 ") and "ratio" in line for line in lines)


def test_example_script_runs_as_a_file():
    r = run_python("examples/hf_train.py", "--help", pythonpath=False, warm=True)
    assert r.returncode == 0 and "--family" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hidden", "48"], "multiples of 32"),
        (["--top-k", "9", "--experts", "8"], "--top-k must not exceed --experts"),
        (["--tokens", "100", "--seq", "32"], "--seq must divide --tokens"),
        (["--steps", "2", "--warmup", "2"], "--warmup must be in"),
        (["--layers", "0"], "--layers must be positive"),
        (["--device", "bogus"], "is not a device"),
        (["--device", "meta"], "not on 'meta'"),
    ]
    + ([(["--device", "cuda"], "needs a CUDA GPU")] if not torch.cuda.is_available() else []),
)
def test_example_script_checks_its_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_implementation_name_selects_mxfp8(family, mxfp8_calls, tmp_path):
    """``from_pretrained(..., experts_implementation="moe_quant_mxfp8")``: transformers' experts interface
    runs moe_quant's forward (default config), equal to converting the experts with quantize_."""
    from transformers import AutoModelForCausalLM

    import moe_quant

    name = moe_quant.register_experts_implementation()
    ref = build_model(tiny(family), seed=SEED)
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=name)
    assert model.config._experts_implementation == name
    assert not any(is_converted(m) for m in model.modules())  # no class swap: the interface dispatches
    loss = loss_of(model)
    assert len(mxfp8_calls) == 2 * LAYERS and fallback_counts() == {}
    mxfp8_calls.clear()
    assert torch.equal(loss, loss_of(convert(copy.deepcopy(ref))))
    assert len(mxfp8_calls) == 2 * LAYERS


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_implementation_name_runs_mxfp8_or_refuses_at_load(family, mxfp8_calls, tmp_path):
    """Every documented family, loaded with ``experts_implementation="moe_quant_mxfp8"``: its expert GEMMs run in
    MXFP8 (two per MoE layer, no fallback), or -- a model whose experts do not dispatch through transformers'
    experts interface, Llama4's ``torch.bmm`` experts -- the load raises, naming the route that works
    (issue 55 item 7: Llama4 loaded, said it ran the implementation, and ran bf16), and so does
    ``set_experts_implementation``."""
    from transformers import AutoModelForCausalLM

    import moe_quant

    name = moe_quant.register_experts_implementation()
    ref = build_model(tiny(family), seed=SEED)
    ref.save_pretrained(tmp_path)
    if family == "llama4":
        with pytest.raises(ValueError, match=r"Llama4ForCausalLM .*experts interface.*quantize_\(model, MXFP8MoEConfig"):
            AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=name)
        with pytest.raises(ValueError, match=r"experts interface.*quantize_"):
            ref.set_experts_implementation(name)
        assert ref.config._experts_implementation != name
        return
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=name)
    assert model.config._experts_implementation == name
    loss = loss_of(model)
    assert len(mxfp8_calls) == 2 * LAYERS and fallback_counts() == {}
    assert not torch.equal(loss, loss_of(ref))  # not the plain model's


@pytest.mark.parametrize("how", ["from_pretrained", "set_experts_implementation"])
def test_unconvert_restores_the_default_experts_implementation(how, mxfp8_calls, tmp_path):
    """A model running the ``"moe_quant_mxfp8"`` experts implementation: ``unconvert`` gives it the one
    transformers picks by default, so no expert GEMM runs in MXFP8 and the loss is the plain model's."""
    from transformers import AutoModelForCausalLM

    import moe_quant

    name = moe_quant.register_experts_implementation()
    ref = build_model(tiny("qwen3_moe"), seed=SEED)
    default = ref.config._experts_implementation
    if how == "from_pretrained":
        ref.save_pretrained(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=name)
    else:
        model = copy.deepcopy(ref)
        model.set_experts_implementation(name)
    assert model.config._experts_implementation == name
    plain = loss_of(ref)
    assert not torch.equal(loss_of(model), plain) and len(mxfp8_calls) == 2 * LAYERS  # precondition: MXFP8 ran
    mxfp8_calls.clear()
    assert moe_quant.unconvert(model) is model
    assert model.config._experts_implementation == default != name
    assert torch.equal(loss_of(model), plain) and not mxfp8_calls


def test_unconvert_of_a_part_of_a_model_running_the_implementation_is_refused():
    """The experts implementation is a setting of the whole model's config: unconvert of one layer would leave it
    running MXFP8, so it raises, saying how, and changes nothing."""
    import moe_quant

    model = build_model(tiny("qwen3_moe"), seed=SEED)
    model.set_experts_implementation(moe_quant.register_experts_implementation())
    quantize_(model.model.layers[1], MXFP8MoEConfig(), filter_fn=EXPERTS_FILTER)
    with pytest.raises(ValueError, match=r"whole model.*unconvert\(model\)"):
        moe_quant.unconvert(model.model.layers[0])
    assert is_converted(model.model.layers[1].mlp.experts)
    with pytest.raises(ValueError, match="unconvert"):
        moe_quant.unconvert(model.model.layers[1])
    assert is_converted(model.model.layers[1].mlp.experts)  # nothing changed


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_in_mxfp8_on_cuda(family, mxfp8_calls, monkeypatch):
    """bf16 on the GPU, as one trains: the unconverted and the converted model from the same weights."""
    assert torch.cuda.is_available()
    cfg = tiny(family)
    ref = build_model(cfg, seed=SEED, device="cuda", dtype=torch.bfloat16)
    model = convert(build_model(cfg, seed=SEED, device="cuda", dtype=torch.bfloat16))
    routing_ref, routing = record_routing(ref), record_routing(model)
    x = ids().cuda()
    loss_ref = ref(input_ids=x, labels=x).loss
    block_calls = []
    block_apply = sb._SwiGLUExperts.apply
    monkeypatch.setattr(sb._SwiGLUExperts, "apply", lambda *a: block_calls.append(a[1].shape) or block_apply(*a))
    loss = model(input_ids=x, labels=x).loss
    # transformers' SwiGLU experts run the fused block (tests/test_hf_block.py), the others per GEMM
    plain = family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
    assert (len(block_calls), len(mxfp8_calls)) == ((LAYERS, 0) if plain else (0, 2 * LAYERS))
    assert fallback_counts() == {}
    assert all(w_t.is_cuda and w_t.dtype == torch.bfloat16 for _, w_t, _ in mxfp8_calls)
    # the first layer sees the same bf16 input in both models; later layers see the first one's MXFP8
    # output, and in bf16 that can flip a near-tie of the router (seen on the H100 for DeepSeek-V3 and
    # GPT-OSS), after which per-expert gradients are not comparable
    assert torch.equal(routing[0], routing_ref[0])  # precondition of the comparison
    same_routing = all(torch.equal(a, b) for a, b in zip(routing, routing_ref))
    assert abs(loss.item() - loss_ref.item()) < 1e-2 * loss_ref.item()
    loss_ref.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.ndim == 3 and ".experts." in name:
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
            if same_routing:
                assert rel_err(p.grad, q.grad) < 0.15, name
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad(set_to_none=True)
    after = model(input_ids=x, labels=x).loss
    assert fallback_counts() == {} and after.item() < loss.item()


@pytest.mark.parametrize("version, ok", [("5.23.0", True), ("5.24.0", True), ("5.30.0.dev0", True),
                                         ("5.22.1", False), ("5.0.0", False), ("4.57.1", False),
                                         ("6.0.0", False), ("unknown", False)])
def test_transformers_version_range(version, ok, monkeypatch):
    from moe_quant.conversion import hf

    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # the module as imported now
    problem = hf.transformers_version_problem()
    assert (problem is None) == ok
    if not ok:
        assert "transformers>=5.23,<6" in problem and version in problem


def test_unsupported_transformers_is_named_not_an_attribute_error(monkeypatch):
    """An experts module of a transformers outside the supported range (whose modules lack ``has_gate`` ...):
    registering the implementation and converting such a module raise ``ImportError`` naming the range,
    instead of an ``AttributeError`` deep in the first forward; ``import moe_quant`` still works there."""
    import moe_quant
    from moe_quant.conversion import classes

    model = build_model(tiny("qwen3_moe"), seed=SEED)
    # transformers replaces its module object in sys.modules once a model is built: patch the current one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.0.0")
    monkeypatch.setattr(classes, "_CLASSES", {})  # the converted class is made (and checked) anew
    with pytest.raises(ImportError, match=r"transformers>=5\.23,<6.*found transformers 5\.0\.0"):
        moe_quant.register_experts_implementation()
    with pytest.raises(ImportError, match=r"transformers>=5\.23,<6"):
        convert(model)
    assert not any(is_converted(m) for m in model.modules())
    r = run_python("-c", "import transformers; transformers.__version__ = '5.0.0'; import moe_quant; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


LLAMA4_BUILD = """
import sys
{first}
from transformers import AutoModelForCausalLM
from examples.hf_train import build_config
config = build_config("llama4", hidden=64, intermediate=32, experts=4, top_k=1, layers=1, vocab=128)
try:
    AutoModelForCausalLM.from_config(config, experts_implementation="moe_quant_mxfp8")
except ValueError as e:
    assert "experts interface" in str(e) and "moe_quant.convert" in str(e), e
    print("refused")
"""


@pytest.mark.parametrize("first", ["import moe_quant", "import transformers, moe_quant",
                                   "import transformers.modeling_utils, moe_quant"])
def test_the_off_interface_check_whatever_the_import_order(first):
    """In a fresh interpreter, ``import moe_quant`` before transformers, after it, or after its modeling module: a
    Llama4 built with the implementation's name is refused (the check is installed after transformers'
    ``PreTrainedModel`` exists: the experts interface, where the name registers, is imported in the middle of it),
    and nothing is logged about it."""
    proc = run_python("-c", LLAMA4_BUILD.format(first=first))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("refused"), proc.stderr[-3000:]
    assert "could not register" not in proc.stderr, proc.stderr[-3000:]
