"""torchtitan 0.3.0's own MoE code converted with quantize_ (optional: skipped without torchtitan).

Install with ``pip install -e ".[titan]"``. ``GroupedExperts`` alone against an explicit MXFP8 SwiGLU,
then torchtitan's DeepSeek-V3 (debug flavor, cut to 2 layers) trained bf16 vs converted through
``examples/torchtitan_train.py``, and that script's command line.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from repo_subprocess import ROOT, run_python
from torch import nn
from torchao.quantization import quantize_

from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm
from moe_quant.conversion import converted_class, fallback_counts, is_converted


def _load_example():
    spec = importlib.util.spec_from_file_location("torchtitan_train", ROOT / "examples" / "torchtitan_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _load_example()
example.stub_missing_fsdp_names()  # torchtitan 0.3.0 imports a name that older torch lacks
try:
    import torchtitan
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as exc:  # not installed, or a dependency of it (e.g. triton) missing
    pytest.skip(f"torchtitan not importable ({exc}); pip install -e '.[titan]'", allow_module_level=True)

TITAN_PATH = Path(torchtitan.__file__).resolve().parents[1]
ISINSTANCE = lambda mod, fqn: isinstance(mod, GroupedExperts)  # noqa: E731


class _Holder(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts


def _swiglu(x, w1, w2, w3, offs, gmm):
    h = F.silu(gmm(x, w1.transpose(-2, -1), offs)) * gmm(x, w3.transpose(-2, -1), offs)
    return gmm(h, w2.transpose(-2, -1), offs)


def test_grouped_experts_run_mxfp8_forward_and_backward(mxfp8_calls):
    torch.manual_seed(0)
    dim, hidden, n_exp = 64, 96, 4
    experts = GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=n_exp).build()
    with torch.no_grad():
        for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
            w.normal_(std=0.05)
    plain = [w.detach().clone().requires_grad_() for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD)]
    quantize_(_Holder(experts), MXFP8MoEConfig(), filter_fn=ISINSTANCE)
    assert is_converted(experts) and all(type(w) is nn.Parameter for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))

    counts = torch.tensor([40, 0, 57, 31])  # an empty expert included
    x = torch.randn(int(counts.sum()), dim, dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = experts(x, counts)
    g = torch.randn_like(out)
    out.backward(g)
    assert len(mxfp8_calls) == 3 and not fallback_counts()

    # the same SwiGLU written with moe_quant's MXFP8 grouped GEMM on the plain weights
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gmm = lambda a, wt, o: mxfp8_grouped_mm(a, wt.bfloat16(), o)  # noqa: E731
    ref = _swiglu(xr, *plain, offs, gmm)
    ref.backward(g)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert torch.equal(x.grad, xr.grad)
    for w, p in zip((experts.w1_EFD, experts.w2_EDF, experts.w3_EFD), plain):
        assert type(w.grad) is torch.Tensor and torch.equal(w.grad, p.grad)
    assert plain[0].grad[1].abs().sum() == 0  # the empty expert
    # and it is not torchtitan's plain bf16 path
    bf16 = _swiglu(x.detach(), *(p.detach() for p in plain), offs,
                   lambda a, wt, o: torch._grouped_mm(a, wt.bfloat16(), offs=o))
    assert not torch.equal(out, bf16)
    assert (out.float() - bf16.float()).norm() < 0.1 * bf16.float().norm()


def _args(**kw):
    argv = ["--flavor", "debugmodel", "--layers", "2", "--tokens", "128", "--seq-len", "32", "--steps", "3",
            "--warmup", "1", "--device", "cpu"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return example.parse_args(argv)


@pytest.fixture(scope="module")
def bf16_run():
    """The bf16 (unconverted) run both training tests compare with: the same config, arguments and batches
    (``via`` only matters when converting), and the MXFP8 GEMM calls made during it (none)."""
    import moe_quant.autograd

    args = _args()
    torch.set_num_threads(1)
    cfg = example.model_config(args.flavor, args.layers, args.attn)
    data = example.batches(cfg.vocab_size, args.tokens, args.seq_len, args.steps, args.seed)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("mxfp8_grouped_mm", "mxfp8_swiglu_experts"):
            real = getattr(moe_quant.autograd, name)
            mp.setattr(moe_quant.autograd, name, lambda *a, _real=real, **k: calls.append(a) or _real(*a, **k))
        result = example.train(cfg, args, data, convert=False, compiled=False)
    return {"cfg": cfg, "data": data, "result": result, "mxfp8_calls": len(calls)}


def test_deepseek_v3_converted_trains_close_to_bf16(mxfp8_calls, bf16_run):
    args = _args()
    torch.set_num_threads(1)
    cfg = example.model_config(args.flavor, args.layers, args.attn)
    assert sum(layer.moe is not None for layer in cfg.layers) == 1  # debugmodel: layer 0 dense, layer 1 MoE
    data = example.batches(cfg.vocab_size, args.tokens, args.seq_len, args.steps, args.seed)
    assert all(torch.equal(a, b) for x, y in zip(data, bf16_run["data"]) for a, b in zip(x, y))
    bf16 = bf16_run["result"]
    assert bf16_run["mxfp8_calls"] == 0 and bf16["converted_weights"] == 0
    mx = example.train(cfg, args, data, convert=True, compiled=False)
    assert mx["converted_weights"] == 3 and mx["fallbacks"] == 0
    assert len(mxfp8_calls) == 3 * args.steps  # w1, w3, w2 per forward
    assert mx["params"] == bf16["params"]
    assert mx["losses"][0] != bf16["losses"][0]  # MXFP8 noise, not the bf16 path
    for a, b in zip(mx["losses"], bf16["losses"]):
        assert abs(a - b) <= 0.01 * abs(b), (mx["losses"], bf16["losses"])


@pytest.mark.filterwarnings("ignore:.*autocast.*:UserWarning")  # torchtitan's router asks CPU autocast for fp32
def test_name_filter_converts_the_experts_inside_routed_experts(caplog):
    """``"experts" in fqn`` (torchao's MoE docs' filter) matches torchtitan's RoutedExperts container before its
    GroupedExperts: the GroupedExperts inside are converted, the container and the shared experts (a warning) stay;
    the model's loss is the one of converting with the isinstance filter, bit for bit."""
    import logging

    from moe_quant.conversion import handler

    handler._WARNED_NOTHING_CONVERTED.clear()
    cfg = example.model_config("debugmodel", 2, "sdpa")
    by_name = example.build_model(cfg, "cpu", seed=0, convert=False)
    by_type = example.build_model(cfg, "cpu", seed=0, convert=True)
    with caplog.at_level(logging.WARNING, logger="moe_quant.conversion"):
        quantize_(by_name, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    converted = {n for n, m in by_name.named_modules() if is_converted(m)}
    assert converted == {n for n, m in by_type.named_modules() if is_converted(m)}
    assert converted and all(n.endswith("routed_experts.inner_experts") for n in converted)
    assert any("nothing converted" in r.getMessage() for r in caplog.records)  # shared_experts
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    assert torch.equal(by_name(x), by_type(x))


def test_converted_config_builds_a_converted_module():
    """torchtitan builds modules from their nested Config: the converted class has one too, and a
    converted module's Config still builds (torchtitan's machinery, e.g. copying a model config)."""
    cls = converted_class(GroupedExperts)
    built = cls.Config(dim=64, hidden_dim=96, num_experts=4).build()
    assert type(built) is cls and isinstance(built, GroupedExperts)
    assert isinstance(cls.Config(dim=64, hidden_dim=96, num_experts=4), GroupedExperts.Config)
    plain = GroupedExperts.Config(dim=64, hidden_dim=96, num_experts=4).build()
    assert type(plain) is GroupedExperts
    counts = torch.tensor([8, 0, 16, 8])
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        for w in built.parameters():
            w.normal_(std=0.05)
    assert built(x, counts).shape == (32, 64) and not fallback_counts()


def test_stub_only_when_missing(monkeypatch):
    import torch.distributed.fsdp as fsdp

    assert example.stub_missing_fsdp_names() == []  # present now (real, or stubbed at import above)
    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert example.stub_missing_fsdp_names() == [example.STUBBED_NAME]
    with pytest.raises(RuntimeError, match="placeholder"):
        fsdp.DataParallelMeshDims()


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "100", "--seq-len", "64"], "multiple of --seq-len"),
    (["--modes", "fast"], "--modes"),
    (["--steps", "3", "--warmup", "3"], "--warmup"),
])
def test_script_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        example.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_script_cpu_smoke(tmp_path):
    out = tmp_path / "tt.json"
    proc = run_python("examples/torchtitan_train.py", "--flavor", "debugmodel", "--layers", "2", "--tokens", "64",
                      "--seq-len", "32", "--steps", "2", "--warmup", "1", "--device", "cpu", "--modes", "eager",
                      "--json", str(out), pythonpath=False, extra_paths=[TITAN_PATH], timeout=600, warm=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("eager    mxfp8") and "fallbacks 0" in line for line in lines), proc.stdout
    record = json.loads(out.read_text())
    assert [(r["convert"], r["compiled"]) for r in record["runs"]] == [(False, False), (True, False)]
    assert record["runs"][1]["converted_weights"] == 3
    assert all(len(r["losses"]) == 2 for r in record["runs"])


def test_converter_entry_point_converts_experts_and_dispatcher(mxfp8_calls, bf16_run):
    """moe_quant's torchtitan model converter (``model_registry(..., converters=[converter_config()])``):
    the built model has converted experts and moe_quant's dispatcher (local: EP off), and trains close
    to bf16 through the MXFP8 GEMMs."""
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.deepseek_v3 import model_registry

    from moe_quant.ep.titan import converter_config, dispatcher_class

    spec = model_registry("debugmodel", converters=[converter_config()])  # torchtitan's own entry point
    routed = [cfg for _, cfg, _, _ in spec.model.traverse(RoutedExperts.Config)]
    assert routed and all(isinstance(r.token_dispatcher, dispatcher_class().Config) for r in routed)

    args = _args(via="converter")
    torch.set_num_threads(1)
    cfg = example.model_config(args.flavor, args.layers, args.attn)
    model = example.build_model(cfg, "cpu", 0, True, "converter")
    dispatchers = [m.token_dispatcher for m in model.modules() if isinstance(m, RoutedExperts)]
    assert dispatchers and all(isinstance(d, dispatcher_class()) and d.is_local for d in dispatchers)
    assert sum(p.ndim == 3 for m in model.modules() if is_converted(m) for p in m.parameters()) == 3
    data = example.batches(cfg.vocab_size, args.tokens, args.seq_len, args.steps, args.seed)
    mx = example.train(cfg, args, data, convert=True, compiled=False)
    assert mx["converted_weights"] == 3 and mx["fallbacks"] == 0 and len(mxfp8_calls) == 3 * args.steps
    assert repr(cfg) == repr(bf16_run["cfg"])
    assert all(torch.equal(a, b) for x, y in zip(data, bf16_run["data"]) for a, b in zip(x, y))
    bf16 = bf16_run["result"]  # the same unconverted run (arguments, config, batches)
    for a, b in zip(mx["losses"], bf16["losses"]):
        assert a != b and abs(a - b) <= 0.01 * abs(b), (mx["losses"], bf16["losses"])


def test_summary_reports_the_bf16_eager_vs_compiled_noise_floor():
    """With both modes the summary reads the MXFP8-vs-bf16 loss differences against how far the bf16 eager and
    compiled runs drift apart (max relative difference over the steps), and gives the same drift of the MXFP8
    runs."""
    def run(convert, compiled, losses):
        return dict(convert=convert, compiled=compiled, losses=losses, step_s=[1.0, 1.0], peak_gib=None, fallbacks=0)

    runs = [run(False, False, [4.0, 2.0]), run(True, False, [4.0, 2.02]),
            run(False, True, [4.0, 2.05]), run(True, True, [4.04, 2.05])]
    lines = example.summarize(runs, warmup=0)
    assert "max |dloss|/loss vs bf16 1.000% (median 0.500%)" in lines[1]
    assert "max |dloss|/loss vs bf16 1.000% (median 0.500%)" in lines[3]
    assert lines[-2] == "noise floor: bf16 compiled vs bf16 eager, max |dloss|/loss 2.500%"
    # and the MXFP8 runs' own eager-vs-compiled drift: max(0.04/4.0, 0.03/2.02)
    assert lines[-1] == "mxfp8 compiled vs mxfp8 eager, max |dloss|/loss 1.485%"
    assert not any("noise floor" in line or "mxfp8 compiled" in line
                   for line in example.summarize(runs[:2], warmup=0))


def test_profile_kinds_of_kernel_names():
    """``--profile`` splits kernel time by name: moe_quant's CuTe-DSL kernels first (their names also carry
    "cutlass"), then GEMMs, then the rest."""
    kind = example.kernel_kind
    assert kind("kernel_cutlass_kernel_moe_quantkernelsquantize_blockQuantizeBlockKernel_object_at__t") == "moe_quant"
    assert kind("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind("void cutlass::device_kernel<at::cuda::detail::GroupedGemmKernel>") == "gemm"
    assert kind("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "other"


def test_profile_names_moe_quant_kernels_by_class_and_input_dtype():
    name = example.moe_quant_kernel
    assert name("kernel_cutlass_kernel_moe_quantkernelsquantize_1x32Quantize1x32Kernel_object_at__tensorptrf32gmemalign16"
                "odiv32i64div321_tensorptrbf16gmemalign16") == "Quantize1x32Kernel f32"
    assert name("kernel_cutlass_kernel_moe_quantkernelsquantize_blockQuantizeBlockKernel_object_at__tensorptrbf16gmem"
                "align16odiv32i64div321_None_None_tensorptrf8E4M3FN") == "QuantizeBlockKernel bf16"
    assert name("kernel_cutlass_kernel_moe_quant_something_else") == "other"
