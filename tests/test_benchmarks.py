"""CPU checks of the benchmark helpers whose real use is on the GPU: kernel categories of the
layer breakdown, aligned ragged offsets, the MoE benchmark's balanced routing, the layer plot."""

import contextlib
import argparse
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_grouped_mm as bgm
from benchmarks import bench_moe
from moe_quant.moe import MoE

ROOT = Path(__file__).resolve().parents[1]

ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>"
REDUCE = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxNanFunctor<float>>>"
BWD = "autograd::engine::evaluate_function: _MXFP8GroupedMMBackward"


@pytest.mark.parametrize(
    "name, scopes, category",
    [
        # CuTe-DSL kernels: by name, by the custom op, or launched from a quantize range directly
        ("kernel_cutlass_kernel_moe_quantkernelsquantize_1x32Quantize1x32Kernel_object_at_0", (), bgm.CAT_CUTE),
        ("kernel_0", ("moe_quant::fake_quantize_1x32", "moe_quant.quantize.fake_quantize_rowwise"), bgm.CAT_CUTE),
        ("kernel_0", ("moe_quant.quantize.fake_quantize_rowwise", BWD), bgm.CAT_CUTE),
        # reference quantization: aten kernels inside a quantize range
        (ELEMENTWISE, ("aten::mul", "moe_quant.quantize.fake_quantize_3d", BWD), bgm.CAT_REF),
        (REDUCE, ("aten::amax", "aten::max", "moe_quant.quantize.fake_quantize_colwise_k_groups"), bgm.CAT_REF),
        # GEMMs, by kernel name or by the grouped-mm op that launched them
        ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<>>", ("aten::_grouped_mm",), bgm.CAT_GEMM),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", (), bgm.CAT_GEMM),
        ("aten::mm", ("aten::mm", "aten::_grouped_mm"), bgm.CAT_GEMM),  # CPU: the grouped mm's loop
        # everything else
        (ELEMENTWISE, ("aten::where", BWD), bgm.CAT_OTHER),
        ("Memset (Device)", (), bgm.CAT_OTHER),
    ],
)
def test_kernel_categories(name, scopes, category):
    assert bgm.categorize(name, scopes, scopes_known=True) == category


def test_kernel_categories_without_profiler_links_fall_back_to_names():
    assert bgm.categorize(ELEMENTWISE, (), scopes_known=False) == bgm.CAT_REF
    assert bgm.categorize("nvjet_tst_128x256", (), scopes_known=False) == bgm.CAT_GEMM
    assert bgm.categorize("Memset (Device)", (), scopes_known=False) == bgm.CAT_OTHER


def test_breakdown_on_cpu_attributes_quantization_and_gemm():
    torch.manual_seed(0)
    A = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(2, 32, 64) / 8).to(torch.bfloat16).requires_grad_()
    offs = bgm.ragged_offsets(128, 2, device="cpu")
    go = torch.randn(128, 32, dtype=torch.bfloat16)

    def step():
        out = bgm.moe_quant_emulated(A, W.transpose(-2, -1), offs)
        torch.autograd.grad(out, (A, W), go)

    bd = bgm.breakdown(step, "cpu", iters=1)
    cats = bd["categories_ms_per_iter"]
    assert bd["scopes_known"] and set(cats) == set(bgm.CATEGORIES)
    assert cats[bgm.CAT_REF] > 0 and cats[bgm.CAT_GEMM] > 0 and cats[bgm.CAT_CUTE] == 0
    assert bd["kernels"] and all(k["category"] in bgm.CATEGORIES for k in bd["kernels"])
    import moe_quant.quantize as q

    assert not hasattr(q.fake_quantize_3d, "__wrapped__")  # the profiler ranges are gone again


def test_ragged_offsets_are_aligned_and_cover_m():
    for m in (256, 1024, 131072):
        offs = bgm.ragged_offsets(m, 8, device="cpu")
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert offs[-1] == m and bool((sizes % bgm.ALIGN == 0).all()) and bool((sizes >= 0).all())


def test_shapes_to_run():
    ns = argparse.Namespace(shapes=["dsv3", "llama4", "dsv3_small"], m=None, tiny=False)
    assert bgm.shapes_to_run(ns) == [("dsv3", "dsv3", 131072), ("llama4", "llama4", 131072), ("dsv3_small", "dsv3", 16384)]
    ns = argparse.Namespace(shapes=["dsv3", "dsv3_small"], m=[16384, 32768], tiny=False)
    assert bgm.shapes_to_run(ns) == [("dsv3 M=16384", "dsv3", 16384), ("dsv3 M=32768", "dsv3", 32768)]
    with pytest.raises(ValueError, match="multiple of 32"):
        bgm.shapes_to_run(argparse.Namespace(shapes=["dsv3"], m=[1000], tiny=False))


@pytest.mark.parametrize("tokens, experts, top_k", [(256, 8, 2), (96, 4, 3), (64, 8, 1)])
def test_balanced_routing_goes_through_the_router(tokens, experts, top_k):
    moe = MoE(64, 32, experts, top_k).to(torch.bfloat16)
    x = torch.randn(tokens, 64, dtype=torch.bfloat16)
    bench_moe.balanced_routing_(moe, x)
    scores, selected, counts = moe.router(x)
    assert counts.tolist() == [tokens * top_k // experts] * experts
    t = torch.arange(tokens)
    for j in range(top_k):
        assert torch.equal(selected[:, j], (t + j) % experts)


def load_plot_script():
    spec = importlib.util.spec_from_file_location("plot_layer_time", ROOT / "scripts" / "plot_layer_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_layer_time(tmp_path):
    pytest.importorskip("matplotlib")
    plot = load_plot_script()
    rows = []
    for fam, (k, n) in {"dsv3": (7168, 2048), "llama4": (5120, 8192)}.items():
        for m in (16384, 32768, 65536, 131072):
            for impl, factor in (("bf16", 1.0), ("moe_quant", 1.2), ("torchao", 5.0)):
                rows.append({"family": fam, "m": m, "k": k, "n": n, "g": 8, "impl": impl,
                             "ms": factor * 6 * m * k * n / 600e12 * 1e3})
    rows.append({"family": "dsv3", "m": 65536, "k": 7168, "n": 2048, "g": 8, "impl": "torchao", "ms": None})
    record = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.x", "rows": rows}
    src = tmp_path / "layer.json"
    src.write_text(json.dumps(record))
    out = tmp_path / "layer_time.png"
    plot.main([str(src), "--out", str(out)])
    assert out.stat().st_size > 10_000
    data = plot.series(record)
    assert set(data) == {"dsv3", "llama4"} and math.isclose(data["dsv3"]["moe_quant"][16384] / data["dsv3"]["bf16"][16384], 1.2)
    # CPU / tiny numbers never go to docs/ by default
    src.write_text(json.dumps(dict(record, device="cpu")))
    with pytest.raises(SystemExit, match="refusing"):
        plot.main([str(src)])


def test_profile_device_ops_on_the_cpu_lists_ops_not_ranges():
    from benchmarks import timing

    def fn():
        with torch.profiler.record_function("moe_quant.ep::dispatch"):  # a range named like an op
            torch.ones(64, 64).sum()

    trace = timing.profile_trace(fn, "cpu", iters=2)
    ops = trace["ops"]
    names = [op["name"] for op in ops]
    assert names.count("aten::sum") == 2 and "moe_quant.ep::dispatch" not in names
    ranges = [h for h in trace["host"] if h["name"] == "moe_quant.ep::dispatch"]
    assert len(ranges) == 2
    for op in ops:
        assert op["scopes"][0] == op["name"] and op["scopes"][-1] == "moe_quant.ep::dispatch"
        assert 0 <= op["us"] <= op["end_us"] - op["start_us"] + 1e-3 and op["stream"] is None
        assert any(r["start_us"] <= op["start_us"] <= op["end_us"] <= r["end_us"] for r in ranges), op


def test_profile_device_ops_links_gpu_kernels_to_their_cpu_ranges(monkeypatch):
    # The CUDA branch on a synthetic event list shaped like torch.profiler's: CPU ops and ranges
    # (linked id 0), a runtime launch event (linked to its op, and sharing its id), kernels.
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from benchmarks import timing

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    rng = NS(id=1, name="moe_quant.quantize.fake_quantize_3d", device_type=cpu, linked_correlation_id=0, cpu_parent=None,
             time_range=NS(start=1.0, end=9.0))
    op = NS(id=2, name="aten::mul", device_type=cpu, linked_correlation_id=0, cpu_parent=rng,
            time_range=NS(start=2.0, end=8.0))
    launch = NS(id=2, name="cudaLaunchKernel", device_type=cpu, linked_correlation_id=2, cpu_parent=op,
                time_range=NS(start=3.0, end=4.0))
    k1 = NS(id=9, name=ELEMENTWISE, device_type=gpu, linked_correlation_id=2, time_range=NS(start=10.0, end=15.0),
            device_resource_id=7)
    k2 = NS(id=0, name="Memset (Device)", device_type=gpu, linked_correlation_id=0, time_range=NS(start=20.0, end=21.0))
    # a record_function range's GPU row (gpu_user_annotation): not a kernel
    k3 = NS(id=0, name="moe_quant.quantize.fake_quantize_3d", device_type=gpu, linked_correlation_id=0,
            time_range=NS(start=10.0, end=21.0), is_user_annotation=True)

    class FakeProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [rng, op, launch, k1, k2, k3]

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    ops = timing.profile_device_ops(lambda: calls.append(1), "cuda", iters=2)
    assert calls == [1, 1]
    assert ops == [
        {"name": ELEMENTWISE, "us": 5.0, "scopes": ("aten::mul", "moe_quant.quantize.fake_quantize_3d"), "linked": True,
         "start_us": 10.0, "end_us": 15.0, "stream": 7},
        {"name": "Memset (Device)", "us": 1.0, "scopes": (), "linked": False, "start_us": 20.0, "end_us": 21.0,
         "stream": None},
    ]
    # the same run's host side: ranges, ops and runtime API calls, in the kernels' clock
    trace = timing.profile_trace(lambda: None, "cuda", iters=1)
    assert trace["ops"] == ops
    assert trace["host"] == [{"name": rng.name, "start_us": 1.0, "end_us": 9.0},
                             {"name": "aten::mul", "start_us": 2.0, "end_us": 8.0},
                             {"name": "cudaLaunchKernel", "start_us": 3.0, "end_us": 4.0}]
    assert bgm.categorize(ops[0]["name"], ops[0]["scopes"], True) == bgm.CAT_REF


def test_bench_grouped_mm_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    # the whole flow at toy sizes: every implementation, a failing peer, targets, breakdown, JSON
    monkeypatch.setitem(bgm.TINY_FAMILIES, "dsv3", (64, 32, 2))
    monkeypatch.setitem(bgm.TINY_M, "dsv3", 128)

    def broken_torchao():
        def f(A, W_t, offs):
            raise RuntimeError("peer broke")

        return f

    monkeypatch.setattr(bgm, "torchao_emulated", broken_torchao)
    out = tmp_path / "layer.json"
    args = argparse.Namespace(shapes=["dsv3"], m=None, compile=False, no_torchao=False, breakdown=True,
                              breakdown_iters=1, rounds=2, json=str(out), device="cpu", tiny=True)
    bgm.run(args)
    record = json.loads(out.read_text())
    rows = {r["impl"]: r for r in record["rows"]}
    assert set(rows) == {"bf16", "moe_quant", "moe_quant_reused", "moe_quant_ref", "torchao"}
    assert len(rows["moe_quant"]["ms_rounds"]) == 2  # interleaved rounds, median reported
    assert rows["torchao"]["ms"] is None and "peer broke" in rows["torchao"]["error"]
    for impl in ("bf16", "moe_quant", "moe_quant_ref"):
        r = rows[impl]
        assert r["ms"] > 0 and r["error"] is None and r["peak_gib"] is None and (r["m"], r["k"], r["n"]) == (128, 64, 32)
    assert rows["moe_quant"]["sqnr_db"] > 25 and rows["bf16"]["sqnr_db"] is None  # exact: inf -> null in JSON
    assert [t["target"] for t in record["targets"]] == ["time vs bf16", "peak memory over inputs"]
    (bd,) = record["breakdown"]
    assert bd["moe_quant"]["categories_ms_per_iter"][bgm.CAT_REF] > 0
    text = capsys.readouterr().out
    assert "layer targets" in text and "top 10 moe_quant kernels" in text and "peer broke" in text


def test_bench_moe_reports_a_failing_compile_and_goes_on(tmp_path, monkeypatch):
    def failing_compile(model, **kwargs):
        def fn(x):
            raise RuntimeError("inductor said no\nsecond line")

        return fn

    monkeypatch.setattr(torch, "compile", failing_compile)
    out = tmp_path / "moe.json"
    args = argparse.Namespace(tokens=[64], dim=64, hidden=32, experts=4, top_k=2, routing="balanced",
                              variants=["bf16", "mxfp8"], no_compile=False, fullgraph=False, compile_mode=None,
                              json=str(out), device="cpu", tiny=False)
    bench_moe.run(args)
    rows = {(r["model"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("bf16", "eager"), ("bf16", "compile"), ("mxfp8", "eager"), ("mxfp8", "compile")}
    for model in ("bf16", "mxfp8"):
        assert rows[(model, "compile")]["error"] == "compile failed: RuntimeError: inductor said no"
        assert rows[(model, "eager")]["ms"] > 0 and rows[(model, "eager")]["error"] is None
    assert rows[("bf16", "eager")]["tokens_per_expert"] == [32, 32, 32, 32]
    assert rows[("mxfp8", "eager")]["x_bf16_eager"] > 0


# ----------------------------------------------------------------------------- command lines


def _cli_error(module, argv, monkeypatch, capsys) -> str:
    """``module.main()`` with ``argv`` ends with exit status 2 before the benchmark starts; its stderr."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    if hasattr(module, "run"):
        monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail(f"{argv} started the benchmark"))
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    return capsys.readouterr().err


CLI_ERRORS = [
    ("bench_moe", ["--device", "cpu", "--tokens", "abc"], "argument --tokens"),
    ("bench_moe", ["--device", "cpu", "--tokens", "64,0"], "argument --tokens"),
    ("bench_moe", ["--device", "cpu", "--experts", "0"], "argument --experts"),
    ("bench_moe", ["--device", "cpu", "--json", "no_such_dir/moe.json"], "argument --json"),
    ("bench_moe", ["--device", "cpu", "--variants", "bf16,fp4"], "argument --variants"),
    ("bench_moe", ["--device", "cpu", "--experts", "2", "--top-k", "3"], "--top-k (3) must not exceed"),
    ("bench_moe", ["--device", "cpu", "--dim", "4", "--experts", "8"], "dim >= experts"),
    ("bench_grouped_mm", ["--device", "cpu", "--rounds", "0"], "argument --rounds"),
    ("bench_grouped_mm", ["--device", "cpu", "--breakdown-iters", "x"], "argument --breakdown-iters"),
    ("bench_grouped_mm", ["--device", "cpu", "--m", "1000"], "argument --m"),
    ("bench_grouped_mm", ["--device", "cpu", "--m", "abc"], "argument --m"),
    ("bench_grouped_mm", ["--device", "cpu", "--shapes", "dsv3,gpt5"], "argument --shapes"),
    ("bench_grouped_mm", ["--device", "cpu", "--json", "no_such_dir/layer.json"], "argument --json"),
    ("bench_quantize", ["--m", "0"], "argument --m"),
    ("bench_quantize", ["--k", "48"], "argument --k"),
    ("bench_quantize", ["--kinds", "int4"], "argument --kinds"),
    ("bench_quantize", ["--tiles", "128"], "argument --tiles"),
    ("bench_quantize_32x1", ["--r", "33"], "argument --r"),
    ("bench_quantize_32x1", ["--w", "8x100x64"], "argument --w"),
    ("bench_quantize_32x1", ["--groups", "0"], "argument --groups"),
    ("bench_quantize_32x1", ["--kernels", "2x2"], "argument --kernels"),
    ("bench_fingerprint", ["--w", "8x2048"], "argument --w"),
    ("bench_fingerprint", ["--variants", "default,t9"], "argument --variants"),
    ("bench_fingerprint", ["--ctas-per-sm", "8,0"], "argument --ctas-per-sm"),
    ("bench_fingerprint", ["--weights", "0"], "argument --weights"),
    ("bench_per_expert", ["--device", "cpu", "--variants", "loop,fp4"], "argument --variants"),
    ("bench_per_expert", ["--device", "cpu", "--m", "0"], "argument --m"),
]


@pytest.mark.parametrize("bench, argv, message", CLI_ERRORS)
def test_benchmark_argument_errors_at_parse_time(bench, argv, message, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{bench}")
    err = _cli_error(module, argv, monkeypatch, capsys)
    assert message in err and "Traceback" not in err, err


_BAD_DEVICES = ["meta", "garbage"] + ([] if torch.cuda.is_available() else ["cuda:0", "cuda:1"])


@pytest.mark.parametrize("bench", ["bench_moe", "bench_grouped_mm"])
@pytest.mark.parametrize("device", _BAD_DEVICES)
def test_benchmark_unusable_device_is_one_line(bench, device, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{bench}")
    lines = _cli_error(module, ["--device", device], monkeypatch, capsys).strip().splitlines()
    assert len(lines) == 1 and f"--device {device}" in lines[0].replace("'", ""), lines


@pytest.mark.parametrize("device", ["cpu", *_BAD_DEVICES])
def test_bench_fingerprint_off_cuda_is_one_line(device, monkeypatch, capsys):
    from benchmarks import bench_fingerprint

    lines = _cli_error(bench_fingerprint, ["--device", device], monkeypatch, capsys).strip().splitlines()
    assert len(lines) == 1 and f"--device {device}" in lines[0].replace("'", ""), lines


def test_plot_script_rejects_an_unwritable_out_before_reading(tmp_path, capsys):
    plot = load_plot_script()
    with pytest.raises(SystemExit) as exc:
        plot.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "no_such_dir" / "layer.png")])
    assert exc.value.code == 2 and "argument --out" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["fused+reuse", "unfused+reuse", "fused+reuse-fp8"])
def test_bench_block_reuse_variants_quantize_weights_once_per_step(variant, monkeypatch):
    """A ``+reuse`` step runs its micro-batches in one reuse scope: every weight operand the scope holds (the
    forward ones with the default hold, "bf16-fwd"; with "fp8" the dgrad ones too) after the first micro-batch's is
    served from the scope."""
    from benchmarks import bench_block

    scopes = []
    real = bench_block.reuse_quantized_weights

    @contextlib.contextmanager
    def spy(weights, **kw):
        with real(weights, **kw) as scope:
            scopes.append(scope)
            yield scope

    monkeypatch.setattr(bench_block, "reuse_quantized_weights", spy)
    inputs = bench_block.make_inputs(64, 64, 32, 2, torch.device("cpu"))
    mbs = bench_block.micro_batches_of(variant, 3)
    bench_block.step_fn(bench_block.VARIANTS[variant], *inputs, micro_batches=mbs, hold=bench_block.hold_of(variant))()
    assert mbs == 3 and len(scopes) == 1
    held = 6 if variant.endswith("-fp8") else 3  # fwd and dgrad operands of w1, w3, w2, or the fwd ones
    assert scopes[0].misses == held and scopes[0].hits == 2 * held


@pytest.mark.parametrize("fake", [True, False])
@pytest.mark.parametrize("op", ["dual", "swiglu", "swiglu rows", "swiglu cols", "dswiglu"])
def test_block_kernel_bytes_are_the_ops_inputs_and_outputs(op, fake):
    """bench_block_kernels' byte count is every input once plus every output the op returns (its reference path
    on the CPU returns the same tensors as the kernel), padding included: TB/s over the right bytes."""
    from benchmarks import bench_block_kernels as bbk
    from moe_quant import block_quantize as bq

    m, r, g = 300, 96, 5
    offs = torch.tensor([0, 40, 41, 200, 300], dtype=torch.int32)
    xs = [torch.randn(m, r, dtype=torch.bfloat16) for _ in range(bbk.N_INPUTS[op])]
    got = getattr(bq, bbk.FUSED.get(op, op))(*xs, bbk.MODE, offs, fake)
    if op in bbk.FORMS:  # one form: the rowwise one without the padded offsets, the colwise one with them
        tensors = got if op == "swiglu rows" else got[:-1]
    else:
        forms = [got] if op != "dswiglu" else list(got)
        assert len(forms) == bbk.N_OUTPUTS[op]
        tensors = [t for row, col in forms for t in (*row, *col[:-1])]
    written = sum(t.numel() * t.element_size() for t in tensors) + 4 * g
    assert bbk.op_bytes(op, m, r, g, fake) == 2 * m * r * len(xs) + written


def test_block_kernel_bytes_of_the_cols_fp8_ops_are_their_outputs():
    """``--out fp8cols``: the cols_fp8 ops' bytes (dual, dswiglu), their inputs once and every buffer each returns (its fake
    outputs: bf16 rowwise values, fp8 colwise data, plain K-groups scales, padded offsets)."""
    from benchmarks import bench_block_kernels as bbk
    from moe_quant.kernels.block import ops as ops_block

    m, r, g = 300, 96, 5
    offs = torch.tensor([0, 40, 41, 200, 300], dtype=torch.int32)
    for op in bbk.FP8COLS_OPS:
        outs = ops_block._fake_outputs(op, torch.empty(m, r, dtype=torch.bfloat16), offs, True, False, True)
        written = sum(t.numel() * t.element_size() for t in outs)
        assert bbk.op_bytes(op, m, r, g, True, cols_fp8=True) == 2 * m * r * bbk.N_INPUTS[op] + written
        assert bbk.op_bytes(op, m, r, g, True, cols_fp8=True) < bbk.op_bytes(op, m, r, g, True)


def test_block_kernel_shapes_argument():
    from benchmarks import bench_block_kernels as bbk

    assert bbk.shapes_arg("98304x1408x64, 16x32x1") == [(98304, 1408, 64), (16, 32, 1)]
    for bad in ("", "98304x1400x64", "1x32", "0x32x1", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError):
            bbk.shapes_arg(bad)


def test_bench_per_expert_loop_computes_the_stacked_block_and_runs_end_to_end(capsys):
    """The benchmark compares like with like: its per-expert loop converted computes the stacked experts' converted
    block bit for bit (and the bf16 loop the bf16 block); every variant runs on the CPU."""
    from benchmarks import bench_per_expert as bpe

    x, w1, w3, w2, offs, _, _ = bpe.make_inputs(64, 64, 32, 2, torch.device("cpu"))
    out = {v: bpe.forward_fn(v, x, w1, w3, w2, offs)[0]().detach() for v in bpe.VARIANTS}
    assert torch.equal(out["loop"], out["fused"]) and torch.equal(out["loop-bf16"], out["bf16"])
    assert not torch.equal(out["loop"], out["loop-bf16"])
    assert bpe.main(["--device", "cpu", "--tiny", "--shapes", "qwen3", "--experts", "2", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    assert all(f" {v} " in table for v in bpe.VARIANTS), table


def test_loop_us_times_calls_back_to_back_without_a_gpu(monkeypatch):
    """``timing.loop_us``: a warm-up batch, then ``reps`` batches of ``calls`` calls, the median per call (off CUDA,
    by the wall clock): a batch whose calls get slower moves the median, not the count."""
    from benchmarks import timing

    count = []

    def fn():
        count.append(1)

    times = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.010])  # batches of 4 calls: 1000, 500, 2500 us per call
    monkeypatch.setattr("time.perf_counter", lambda: next(times))
    assert timing.loop_us(fn, "cpu", calls=4, reps=3) == 1000.0
    assert len(count) == 4 + 3 * 4


def test_profile_block_kernel_families():
    """``scripts/profile_block.py``'s per-family sums: moe_quant's CuTe-DSL kernels by their class names (the block
    kernel's class subclasses the 32x1 kernel's, and every DSL kernel's name says "cutlass"), torch's grouped GEMM
    and cuBLAS as GEMMs, the rest "other"."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_block_under_test", ROOT / "scripts" / "profile_block.py")
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    dsl = "kernel_cutlass_kernel_moe_quantkernels{}kernel{}_object_at__tensorptrbf16gmemalign16odiv32i64div321"
    assert pb.kernel_family(dsl.format("quantize_1x32", "Quantize1x32Kernel")).startswith("quantize 1x32")
    assert pb.kernel_family(dsl.format("quantize_32x1", "Quantize32x1Kernel")).startswith("quantize 32x1")
    assert pb.kernel_family(dsl.format("block", "QuantizeBlockKernel")).startswith("block passes")
    assert pb.kernel_family(dsl.format("fingerprint", "FingerprintKernel")).startswith("byte fingerprint")
    assert pb.kernel_family("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
                            "kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<") == "GEMMs"
    assert pb.kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMMs"
    assert pb.kernel_family("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel") == "other"


def test_bench_block_modes_routed_x_and_reuse_hold(tmp_path, monkeypatch):
    """bench_block's compiled mode (not for +reuse variants: a scope never serves a compiled graph), its ratios to
    bf16 in the same mode, the routed x (a fresh copy each step, its gradient handed on unchanged) and the
    ``fused+reuse-bf16`` variant's scope holding bf16 operands."""
    import json

    from benchmarks import bench_block

    out = tmp_path / "block.json"
    assert bench_block.main(["--device", "cpu", "--tiny", "--rounds", "1", "--shapes", "ds16b", "--m", "128",
                             "--variants", "bf16,fused,fused+reuse-bf16", "--modes", "eager,compiled",
                             "--micro-batches", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["mode"]) for r in res] == [("bf16", "eager"), ("fused", "eager"),
                                                        ("fused+reuse-bf16", "eager"), ("bf16", "compiled"),
                                                        ("fused", "compiled")]
    assert res[3]["ratio_to_bf16"] == 1.0 and res[4]["ratio_to_bf16"] > 0 and res[2]["micro_batches"] == 2
    assert all(r["x"] == "routed" and r["kept_bytes"] is None for r in res)  # no CUDA: no memory columns

    x = torch.randn(8, 32, requires_grad=True)
    routed = bench_block.Routed.apply(x)
    assert routed.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and torch.equal(routed, x)
    g = torch.randn(8, 32)
    routed.backward(g)
    assert torch.equal(x.grad, g)

    holds = []
    real = bench_block.reuse_quantized_weights

    @contextlib.contextmanager
    def spy(weights, **kw):
        with real(weights, **kw) as scope:
            holds.append(scope.hold)
            yield scope

    monkeypatch.setattr(bench_block, "reuse_quantized_weights", spy)
    inputs = bench_block.make_inputs(64, 64, 32, 2, torch.device("cpu"))
    variants = ("fused+reuse", "fused+reuse-fp8", "fused+reuse-bf16")
    for variant in variants:
        bench_block.step_fn(bench_block.VARIANTS[variant], *inputs, micro_batches=2, routed=True,
                            hold=bench_block.hold_of(variant))()
    assert holds == ["bf16-fwd", "fp8", "bf16"]  # the scope's default, then the named ones


def test_bench_block_breakdown_attributes_the_step_to_its_operand_passes(tmp_path, capsys):
    """bench_block_breakdown on the CPU (the reference quantization, the host's clock): per variant a table of the
    step by operand pass whose rows add up to the marked step, each pass of the block named (the weights' forward and
    dgrad operands, the reuse scope's fp8 forms made and read back and its fingerprint, x's passes, the SwiGLU
    passes) and none in the bf16 block; a table of its kernels (aten ops) by family; the summary and weight-pass
    tables."""
    from benchmarks import bench_block_breakdown as bbd

    out = tmp_path / "bd.json"
    assert bbd.main(["--device", "cpu", "--tiny", "--shapes", "ds16b", "--experts", "2", "--m", "64",
                     "--micro-batches", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())["results"]
    steps = {r["variant"]: r for r in res if "variant" in r}
    assert list(steps) == ["bf16", "fused", "fused+reuse", "fused+reuse-fp8"]
    assert [steps[v]["micro_batches"] for v in steps] == [1, 1, 2, 2]
    for v, r in steps.items():
        assert r["step_ms"] > 0 and r["wall_ms"] > 0 and r["idle_ms"] is None and r["host_ms"] is None
        assert math.isclose(sum(c["ms"] for c in r["operands"]), r["step_ms"], rel_tol=1e-9), v
        outside = [c for c in r["operands"] if c["operand"] == bbd.OUTSIDE]
        assert len(outside) == 1 and outside[0]["ms"] > 0, v  # the GEMMs at least
        assert all(c["ms"] >= 0 for c in r["operands"]), r["operands"]  # nested passes counted apart, once
        assert math.isclose(sum(f["ms"] for f in r["families"]), r["kernel_ms"], rel_tol=1e-9)
        assert "GEMM" in {f["family"] for f in r["families"]}
        assert f"ds16b M=64 E=2 {v}: the step by operand pass" in text
    ops = {v: {c["operand"] for c in r["operands"]} for v, r in steps.items()}
    calls = {v: {c["operand"]: c["calls"] for c in r["operands"]} for v, r in steps.items()}
    assert ops["bf16"] == {bbd.OUTSIDE}
    passes = {"weights fwd", "weights dgrad", "x rowwise and kept", "x colwise read back", "grad_y dual",
              "swiglu", "swiglu colwise", "dswiglu"}
    assert ops["fused"] == passes | {bbd.OUTSIDE}
    assert calls["fused"]["weights fwd"] == calls["fused"]["weights dgrad"] == 3  # w1, w3, w2
    # the default scope: the forward operands made once a step, nothing in fp8; the exit check's fingerprints
    assert {"weights fwd / fingerprint", "fingerprint"} <= ops["fused+reuse"]
    assert not any("fp8 form" in o for o in ops["fused+reuse"])
    # hold="fp8": each weight's fp8 forms made on the first micro-batch and read back at every use
    assert {"weights fwd / fp8 form made", "weights dgrad / fp8 form made", "weights fwd / fp8 form read back",
            "weights dgrad / fp8 form read back", "weights fwd / fingerprint", "fingerprint"} <= ops["fused+reuse-fp8"]
    assert calls["fused+reuse-fp8"]["weights dgrad / fp8 form read back"] == 3  # per micro-batch
    assert calls["fused+reuse-fp8"]["weights dgrad / fp8 form made"] == 1.5  # 3 a step of 2 micro-batches
    # every operand table ends with the step row, whose % is the rows' sum over the step
    assert sum(line.split()[:1] == ["step"] for line in text.splitlines()) == 4
    for line in text.splitlines():
        if line.strip().startswith("step ") or line.strip().startswith("kernels "):
            assert line.split()[-1] == "100.0", line
    (passes_rec,) = [r for r in res if "weight_passes" in r]
    names = [p["name"] for p in passes_rec["weight_passes"]]
    assert len(names) == 12 and names[0] == "bf16 operand along K (fwd)"
    assert all(p["bytes"] > 0 and p["ms"] > 0 and p["memcpy_ms"] > 0 for p in passes_rec["weight_passes"])
    assert "wall vs bf16" in text and "% of memcpy" in text


@pytest.mark.parametrize("path, operand", [
    (("weights fwd",), "weights fwd"),
    (("swiglu colwise", "swiglu"), "swiglu colwise"),  # the outermost pass names it
    (("weights dgrad", "fp8 form read back"), "weights dgrad / fp8 form read back"),
    (("weights fwd", "fingerprint"), "weights fwd / fingerprint"),
    (("fingerprint",), "fingerprint"),  # the scope's exit check
])
def test_bench_block_breakdown_operand_of_nested_spans(path, operand):
    from benchmarks import bench_block_breakdown as bbd

    assert bbd.operand(path) == operand


@pytest.mark.parametrize("name, family", [
    ("kernel_cutlass_kernel_moe_quantkernelsquantize_1x32Quantize1x32Kernel_object_at_0", "1x32"),
    ("kernel_cutlass_kernel_moe_quantkernelsblockQuantizeBlockKernel_object_at_0", "block"),
    ("kernel_cutlass_kernel_moe_quantkernelsquantize_32x1Quantize32x1Kernel_object_at_0", "32x1"),
    ("kernel_cutlass_kernel_moe_quantkernelspermutePermuteMxfp8Kernel_object_at_0", "dequant (permute)"),
    ("kernel_cutlass_kernel_moe_quantkernelsfingerprintFingerprintKernel_object_at_0", "fingerprint"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<",
     "GEMM"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", "GEMM"),
    (ELEMENTWISE, "torch kernel"),
    ("Memcpy DtoD (Device -> Device)", "torch copy"),
])
def test_bench_block_breakdown_kernel_families(name, family):
    from benchmarks import bench_block_breakdown as bbd

    assert bbd.family(name) == family
