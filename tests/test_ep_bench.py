"""CPU checks of the EP measurements whose real use is on GPUs: ``benchmarks/bench_ep.py`` end to end on two
gloo ranks (every row, its record), and the slow-wire model of ``scripts/ep_wire_fit.py`` on records made
from a known model (it must give that model back, flag a point it cannot predict, and project the gains)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from background import BackgroundCommands
from repo_subprocess import ROOT, run_python, warm_ranks

sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "probes")]
import ep_timeline  # noqa: E402
import ep_wire_fit  # noqa: E402
from p2p_probe import FORMS  # noqa: E402
from benchmarks import bench_ep  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_torchrun")  # torchrun's ranks warm: conftest

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
_MAKE = {  # test -> make(folder) of its 2-rank job (tests/background.py), which writes folder/out.json
    "test_bench_ep_runs_every_row_on_two_gloo_ranks": lambda f: (
        [*TORCHRUN_2, "-m", "benchmarks.bench_ep", "--device", "cpu", "--rounds", "2", "--steps", "1", "--json",
         f / "out.json"], 600.0),
    "test_p2p_probe_times_every_form_on_two_gloo_ranks": lambda f: (
        [*TORCHRUN_2, "scripts/probes/p2p_probe.py", "--mb", "1,2", "--iters", "1", "--rounds", "1", "--json",
         f / "out.json"], 300.0),
    "test_bench_ep_timelines_of_every_rank_and_their_peers_view": lambda f: (
        [*TORCHRUN_2, "-m", "benchmarks.bench_ep", "--device", "cpu", "--rows", "bf16,p2p_c2", "--rounds", "1",
         "--steps", "1", "--timeline", "--json", f / "out.json"], 600.0),
}
JOBS = BackgroundCommands("ep_bench_jobs_")


def start_in_background(selected) -> None:
    """The torchrun jobs of the selected tests start now, behind the other tests (``tests/conftest.py``)."""
    for test in _MAKE:
        if test in selected:
            JOBS.submit(test, _MAKE[test], env=warm_ranks(), stderr_apart=True)


def stop_background() -> None:
    JOBS.stop()


def _ran(test: str):
    """The result of ``test``'s job (queued now where it was not) and its JSON output's path."""
    JOBS.submit(test, _MAKE[test], env=warm_ranks(), stderr_apart=True)
    return JOBS.result(test, 1800.0), JOBS.folder(test) / "out.json"

D = 7168
MX_ROW, BF16_ROW = D + D // 32, 2 * D
LEGS = ("dispatch", "combine", "combine backward", "dispatch backward")


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_bench_ep_runs_every_row_on_two_gloo_ranks():
    res, out = _ran("test_bench_ep_runs_every_row_on_two_gloo_ranks")
    assert res.rc == 0, res.tail()
    record = json.loads(out.read_text())
    rows = {r["row"]: r for r in record["rows"]}
    want = {"bf16", "conv_bf16", "conv_mxfp8", "p2p", "p2p_c2", "p2p_c4", "p2p_c4_sm4", "sync_free", "sync_free_c2"}
    assert want <= set(rows) and (set(rows) - want <= {"titan"}), set(rows)
    assert "titan" in rows or "titan" in record["notes"]  # run, or said why not
    assert record["world"] == 2 and record["rounds"] == 2
    d = record["sizes"]["dim"]
    for name, r in rows.items():
        assert len(r["samples"]) == 2 and r["round_min"] <= r["ms"] <= r["round_max"], (name, r)
        assert r["vs_bf16"] == pytest.approx(r["ms"] / rows["bf16"]["ms"]), name
        assert len(r["ms_per_rank"]) == 2
        rows_sent = r["wire"]["dispatch"]["rows"]
        if "capacity_factor" in r["settings"]:  # sync-free: every slot, filled or not
            assert rows_sent >= 2 * record["sizes"]["tokens"] and r["dropped"] == 0, (name, r["wire"])
        else:
            assert rows_sent == 2 * record["sizes"]["tokens"], (name, r["wire"])  # top-2 copies of each token
        mx = r["settings"].get("wire") == "mxfp8"
        assert r["wire"]["dispatch"]["bytes"] == rows_sent * ((d + d // 32) if mx else 2 * d), (name, r["wire"])
        assert r["wire"]["combine"]["bytes"] == r["wire"]["combine"]["rows"] * 2 * d, (name, r["wire"])
        # the backward legs mirror the forward ones: the gradient of the expert output on the dispatch's wire,
        # the input gradient in bf16
        assert r["wire"]["combine backward"] == r["wire"]["dispatch"], (name, r["wire"])
        assert r["wire"]["dispatch backward"] == r["wire"]["combine"], (name, r["wire"])
    assert [p["wire"] for p in record["legs_alone"]] == ["bf16"] * 3 + ["mxfp8"] * 3
    for p in record["legs_alone"]:
        assert p["bytes_to_others"] == p["bytes"] // 2 and p["ms"] > 0
    assert "EP MoE block fwd + bwd" in res.stdout and "One leg alone" in res.stdout
    # where each row's profiled step goes: CPU aten ops here (no kernels), consistent within the step
    for name, r in rows.items():
        b = r["breakdown"]
        assert b["available"] and b["source"].startswith("CPU") and b["profiled_step"] == bench_ep.PROFILED_STEPS
        assert set(b["kinds_ms"]) == set(bench_ep.KINDS), name
        assert 0 < b["busy_ms"] <= b["wall_ms"] and b["idle_ms"] == pytest.approx(b["wall_ms"] - b["busy_ms"]), name
        assert sum(b["kinds_ms"].values()) == pytest.approx(b["kernel_sum_ms"]) and b["kernel_sum_ms"] <= b["busy_ms"]
        assert b["kinds_ms"]["gemm"] > 0 and b["kinds_ms"]["nccl"] > 0, (name, b["kinds_ms"])  # aten::mm, c10d ops
        assert b["overlap_ms"] is None and b["d2h_copies"] == 0 and b["host_syncs"] == 0, name
        assert b["kernels"] > 0 and 0 < len(b["top"]) <= bench_ep.TOP_KERNELS, name
        assert [k["us"] for k in b["top"]] == sorted((k["us"] for k in b["top"]), reverse=True)
        assert all(k["kind"] == bench_ep.kernel_kind(k["full"]) and len(k["name"]) <= 60 for k in b["top"]), name
        assert not any(k["full"].startswith("moe_quant.ep::") for k in b["top"]), name  # ranges are no ops
    assert "Where the step goes" in res.stdout and "Top kernels of (i) bf16 model" in res.stdout
    table = res.stdout[res.stdout.index("Where the step goes"):]
    assert {line.split()[0] for line in table.splitlines()[3:3 + len(rows)]} == set(rows), table
    assert table.splitlines()[1].split()[-6:] == list(bench_ep.KINDS), table


# kernel (and CPU op) names as the profiler gives them, made up after real ones
KIND_CASES = [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),  # "gather", still nccl
    ("c10d::alltoall_base_", "nccl"),
    ("_c10d_functional::wait_tensor", "nccl"),
    ("kernel_cutlass_kernel_moe_quantkernelsquantize_1x32Quantize1x32Kernel_object_at__tensorptrf32gmem", "moe_quant"),
    ("kernel_cutlass_kernel_moe_quantkernelspermutePermuteMxfp8Kernel_object_at__tensorptrbf16gmem", "moe_quant"),
    ("kernel_cutlass_kernel_moe_quantkernelsfingerprintFingerprintKernel_object_at__tensorptri32gmem", "moe_quant"),
    ("kernel_cutlass_kernel_QuantizeBlockKernel_object_at__tensorptrbf16gmem", "moe_quant"),  # class alone
    ("moe_quant::quantize_1x32", "moe_quant"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<>>>",
     "gemm"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("aten::mm", "gemm"),
    ("aten::_grouped_mm", "gemm"),
    ("aten::_scaled_grouped_mm", "gemm"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<>>", "index"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     "index"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long>>",
     "index"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8>", "index"),
    ("void at::native::tensor_kernel_scan_innermost_dim<long, std::plus<long> >", "index"),
    ("void at::cuda::kernelHistogram1D<float, float, long, 1, 2, -1, 1>", "index"),
    ("aten::cumsum", "index"),
    ("aten::bincount", "index"),
    ("aten::index_copy_", "index"),
    ("Memcpy DtoH (Device -> Pinned)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::"
     "OpaqueType<2>>", "copy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>", "copy"),
    ("aten::cat", "copy"),
    ("aten::copy_", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxNanFunctor<float>>>", "other"),
    ("triton_poi_fused_mul_silu_0", "other"),
    ("aten::mul", "other"),
    ("aten::empty", "other"),
    ("aten::commit", "other"),  # "mm" inside a word is no matmul
    ("slow_wire_spin_kernel", "nccl"),  # benchmarks.slow_wire: the emulated wire's time is communication time
]


@pytest.mark.parametrize("name, kind", KIND_CASES)
def test_kernel_kind(name, kind):
    assert bench_ep.kernel_kind(name) == kind


def test_slow_wire_counts_the_bytes_each_rank_puts_on_the_wire():
    """benchmarks.slow_wire holds an exchange for the bytes this rank sends to others: not its own block of an
    all-to-all, not what it receives, not a send to itself."""
    from types import SimpleNamespace

    import torch

    from benchmarks.slow_wire import a2a_bytes_to_others, p2p_bytes_to_others

    x = torch.zeros(10, 4, dtype=torch.bfloat16)  # 8 bytes a row
    assert a2a_bytes_to_others(x, [3, 5, 2], rank=1, world=3) == 5 * 8
    assert a2a_bytes_to_others(x, [3, 5, 2], rank=2, world=3) == 8 * 8
    assert a2a_bytes_to_others(x, None, rank=0, world=2) == 40  # even split
    assert a2a_bytes_to_others(x[:0], [0, 0], rank=0, world=2) == 0

    def op(kind, tensor, peer):
        return SimpleNamespace(op=kind, tensor=tensor, peer=peer, group=None, group_peer=None)

    ops = [op(dist.isend, torch.zeros(6, dtype=torch.uint8), 1), op(dist.irecv, torch.zeros(7, dtype=torch.uint8), 1),
           op(dist.isend, torch.zeros(2, 3), 2), op(dist.isend, torch.zeros(5, dtype=torch.uint8), 0)]
    assert p2p_bytes_to_others(ops, rank=0) == 6 + 24
    assert p2p_bytes_to_others(ops, rank=1) == 24 + 5


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_p2p_probe_times_every_form_on_two_gloo_ranks():
    """scripts/probes/p2p_probe.py (on GPUs: which forms of exchange NCCL moves how fast) on two gloo ranks: a row
    per form, a record per form and size; without torchrun, one line and exit status 2."""
    res, out = _ran("test_p2p_probe_times_every_form_on_two_gloo_ranks")
    assert res.rc == 0, res.tail()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["form"], r["bytes_per_peer"]) for r in rows} == {(f, m << 20) for f in FORMS for m in (1, 2)}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    table = [line.split()[0] for line in res.stdout.splitlines()[2:]]
    assert table == list(FORMS), res.stdout
    bare = run_python("scripts/probes/p2p_probe.py", pythonpath=False)
    assert bare.returncode == 2 and "run it under torchrun" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--wire-gbps", "50"], "--wire-gbps needs --device cuda"),
    (["--wire-gbps", "50", "--rows", "bf16,titan"], "leave the titan row out"),
    (["--wire-gbps", "0"], "greater than 0"),
    (["--wire-gbps", "inf"], "greater than 0"),
    (["--wire-gbps", "fast"], "expected a number"),
])
def test_bench_ep_wire_gbps_is_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_ep.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_moe_quant_kernel_class_is_told_by_its_name():
    import re

    classes = set()
    for path in (ROOT / "moe_quant" / "kernels").rglob("*.py"):
        classes |= set(re.findall(r"^class (\w+Kernel)\b", path.read_text(), re.M))
    assert classes and classes <= set(bench_ep.MOE_QUANT_KERNELS), classes - set(bench_ep.MOE_QUANT_KERNELS)
    for cls in classes:  # cute's name: the module path, then the class
        assert bench_ep.kernel_kind(f"kernel_cutlass_kernel_moe_quantkernelsx{cls}_object_at__tensorptrbf16gmem") == \
            "moe_quant"
        assert bench_ep.kernel_kind(f"kernel_cutlass_kernel_{cls}_object_at__t") == "moe_quant"


def test_short_kernel_names():
    short = bench_ep.short_kernel_name
    assert short("kernel_cutlass_kernel_moe_quantkernelsquantize_blockQuantizeBlockKernel_object_at__tensorptrbf16gmem"
                 "align16odiv32i64div321_None_None_tensorptrf8E4M3FNgmemalign16_tensorptrbf16gmem") == \
        "QuantizeBlockKernel bf16,f8E4M3FN"
    assert short("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, "
                 "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<c10::BFloat16>, "
                 "at::detail::Array<char*, 1>)") == "vectorized_elementwise_kernel<4, FillFunctor<BFloat16>, A..."
    assert short("aten::mm") == "aten::mm" and short("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == \
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    assert all(len(short(n)) <= 60 for n, _ in KIND_CASES)


def test_breakdown_of_a_gpu_shaped_trace():
    """Two profiled steps; the breakdown takes the second: its window runs from its range's start to its last
    kernel's end, busy counts two overlapping streams once, the host syncs inside the range are counted."""
    def op(name, a, b, stream=7):
        return {"name": name, "us": b - a, "scopes": (), "linked": True, "start_us": a, "end_us": b, "stream": stream}

    def host(name, a, b):
        return {"name": name, "start_us": a, "end_us": b}

    gemm, nccl = "nvjet_tst_128x256_64x4_2x1_v_bz_TNT", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    trace = {
        "ops": [op(gemm, 5, 50), op(nccl, 20, 60, stream=9),  # step 1: not counted
                op(gemm, 110, 150), op(nccl, 120, 170, stream=9),  # overlap 120-150: busy 110-170 = 60
                op("Memcpy DtoH (Device -> Pinned)", 180, 182),  # idle 170-180
                op(gemm, 200, 230), op(gemm, 230, 240)],  # idle 182-200; window ends at 240
        "host": [host(bench_ep.STEP_RANGE, 0, 70), host("cudaDeviceSynchronize", 70, 75),  # after step 1's range
                 host(bench_ep.STEP_RANGE, 100, 220), host("cudaLaunchKernel", 101, 102),
                 host("cudaStreamSynchronize", 182, 190), host("cudaEventSynchronize", 190, 195),
                 host("cudaDeviceSynchronize", 220, 240)],  # the sync after the range: not the step's
    }
    b, ops = bench_ep._breakdown(trace, cuda=True)
    assert len(ops) == 5 and b["profiled_step"] == 2
    assert b["wall_ms"] == pytest.approx(0.140) and b["busy_ms"] == pytest.approx(0.102)
    assert b["idle_ms"] == pytest.approx(0.038) and b["kernel_sum_ms"] == pytest.approx(0.132)
    assert b["overlap_ms"] == pytest.approx(0.030) and b["kernels"] == 5 and b["streams"] == 2
    assert b["d2h_copies"] == 1 and b["host_syncs"] == 2 and b["sync_wait_ms"] == pytest.approx(0.013)
    assert b["syncs"] == {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 1, "cudaDeviceSynchronize": 0}
    assert b["kinds_ms"] == pytest.approx({"gemm": 0.080, "moe_quant": 0.0, "nccl": 0.050, "copy": 0.002,
                                           "index": 0.0, "other": 0.0})
    assert [(k["name"], k["count"], k["us"]) for k in b["top"]] == [
        (gemm, 3, 80.0), (nccl, 1, 50.0), ("Memcpy DtoH (Device -> Pinned)", 1, 2.0)]
    assert bench_ep._legs_from_profile(ops, 1) == {"unattributed": pytest.approx(0.050)}
    assert bench_ep._breakdown({"ops": trace["ops"], "host": []}, cuda=True) == (
        {"available": False, "reason": f"no {bench_ep.STEP_RANGE} range in the profile"}, [])


def test_breakdown_table_prints_every_row_and_the_top_kernels(capsys):
    b = {"available": True, "source": "CUDA kernels", "profiled_step": 2, "wall_ms": 26.7, "busy_ms": 25.0,
         "idle_ms": 1.7, "kernel_sum_ms": 26.0, "overlap_ms": 1.0, "kernels": 400, "streams": 3, "d2h_copies": 1,
         "syncs": {}, "host_syncs": 1, "sync_wait_ms": 0.4,
         "kinds_ms": dict(zip(bench_ep.KINDS, (15.0, 0.0, 8.0, 1.0, 1.0, 1.0))),
         "top": [{"name": "nvjet_tst_128x256", "kind": "gemm", "count": 6, "us": 15000.0, "full": "nvjet_tst_128x256"}]}
    rows = [{"row": r, "label": bench_ep.LABELS[r], "ms": 26.7, "breakdown": b} for r in ("bf16", "titan", "conv_bf16")]
    rows.append({"row": "p2p", "label": bench_ep.LABELS["p2p"], "ms": 28.4,
                 "breakdown": {"available": False, "reason": "no bench_ep.step range in the profile"}})
    bench_ep._print_breakdown({"rows": rows})
    out = capsys.readouterr().out
    assert "p2p: no breakdown (no bench_ep.step range in the profile)" in out
    assert "by GPU kernels" in out and "idle = step - busy" in out
    lines = out.splitlines()
    assert any(line.split()[:6] == ["bf16", "26.70", "26.70", "25.00", "1.70", "1.00"] for line in lines), out
    assert out.count("Top kernels of") == 2 and "Top kernels of (ii) torchtitan" in out  # bf16, titan; p2p had none
    assert any(line.split() == ["nvjet_tst_128x256", "gemm", "6", "15000", "56.2"] for line in lines), out


def _record(fixed_ms, gbps, rows, world=2, scale=None):
    """A bench_ep record whose every number follows the model with the given transport and rows
    ``(name, compute ms, row bytes of the MXFP8-able legs, chunks)``; ``scale``: {row: factor} off the model."""
    legs_alone = []
    for wire, rb in (("bf16", BF16_ROW), ("mxfp8", MX_ROW)):
        for n in (8192, 16384, 32768):
            to_others = n * rb * (world - 1) // world
            legs_alone.append({"wire": wire, "rows": n, "bytes": n * rb, "bytes_to_others": to_others,
                               "ms": fixed_ms + to_others / (gbps * 1e6)})
    out = []
    for name, compute, rb, chunks in rows:
        wire = {"dispatch": rb, "combine": BF16_ROW, "combine backward": rb, "dispatch backward": BF16_ROW}
        wire = {leg: {"rows": 32768, "bytes": 32768 * b} for leg, b in wire.items()}
        wire["counts"] = {"rows": world, "bytes": 8 * world}
        nbytes = sum(wire[leg]["bytes"] for leg in LEGS) * (world - 1) / world
        ms = compute + (1 + 4 * chunks) * fixed_ms + nbytes / (gbps * 1e6)
        out.append({"row": name, "label": name, "ms": ms * (scale or {}).get(name, 1.0), "wire": wire,
                    "settings": {"chunks": chunks}})
    return {"world": world, "sizes": {"dim": D, "hidden": 2048, "experts_per_rank": 8, "top_k": 2, "tokens": 16384},
            "rows": out, "legs_alone": legs_alone}


ROWS = [("bf16", 20.0, BF16_ROW, 1), ("conv_bf16", 21.0, BF16_ROW, 1), ("conv_mxfp8", 21.6, MX_ROW, 1),
        ("p2p_c2", 19.0, MX_ROW, 2)]
WIRES = {"nvlink": (0.03, 150.0), "shm": (0.06, 20.0), "socket": (0.2, 2.0)}


def _records(**kw):
    return {t: _record(f, b, ROWS, **kw) for t, (f, b) in WIRES.items()}


def test_fit_gives_the_model_back_and_predicts_every_point():
    model = ep_wire_fit.fit(_records())
    for t, (f, b) in WIRES.items():
        assert model["wires"][t]["fixed_ms"] == pytest.approx(f, rel=1e-6)
        assert model["wires"][t]["gbps"] == pytest.approx(b, rel=1e-6)
    for name, compute, _, chunks in ROWS:
        info = model["rows"][name]
        assert info["fitted"] == (chunks == 1), name  # overlapped rows are measured, not modelled
        if chunks == 1:
            assert info["compute_ms"] == pytest.approx(compute, rel=1e-6)
            assert max(abs(e) for e in info["error"].values()) < 1e-6
    assert model["ok"]


def test_wire_log_records_legs_sent_from_other_threads():
    """On CUDA autograd runs the backward legs on its device threads: the log must see them."""
    import threading

    from moe_quant.ep import WireLog

    with WireLog() as log:
        WireLog.record_rows("dispatch", 3, 30)
        t = threading.Thread(target=WireLog.record_rows, args=("combine backward", 5, 50))
        t.start()
        t.join()
    WireLog.record_rows("dispatch", 7, 70)  # after the scope: not recorded
    assert log.by_leg("dispatch") == (3, 30)
    assert log.by_leg("combine backward") == (5, 50)


def test_fit_takes_compute_from_the_fastest_transport_and_predicts_the_others():
    records = _records()
    off = copy.deepcopy(records["nvlink"])
    off["rows"][2]["ms"] += 2.0  # conv_mxfp8 on NVLink: 2 ms more compute than the other transports show
    records["nvlink"] = off
    model = ep_wire_fit.fit(records)
    assert model["compute_from"] == "nvlink"  # the highest fitted bandwidth
    assert model["rows"]["conv_mxfp8"]["compute_ms"] == pytest.approx(21.6 + 2.0, rel=1e-9)
    assert model["rows"]["conv_mxfp8"]["error"]["nvlink"] == pytest.approx(0.0, abs=1e-9)
    assert model["rows"]["conv_mxfp8"]["error"]["shm"] > 0.01  # shm and socket predicted 2 ms too slow
    by_socket = ep_wire_fit.fit(records, compute_from="socket")
    assert by_socket["rows"]["conv_mxfp8"]["compute_ms"] == pytest.approx(21.6, rel=1e-9)
    assert by_socket["rows"]["conv_mxfp8"]["error"]["nvlink"] < -0.01
    with pytest.raises(ValueError, match="compute_from must be one of"):
        ep_wire_fit.fit(records, compute_from="ib")


def test_fit_flags_a_point_it_cannot_predict():
    records = _records()
    off = copy.deepcopy(records["shm"])
    off["rows"][2]["ms"] *= 1.5  # conv_mxfp8 on shm: far off the sum model
    records["shm"] = off
    model = ep_wire_fit.fit(records)
    assert not model["ok"]
    assert max(abs(e) for e in model["rows"]["conv_mxfp8"]["error"].values()) > 0.10


def test_projection_gains_and_crossover():
    model = ep_wire_fit.fit(_records())
    proj = ep_wire_fit.at_bandwidths(model, "nvlink")
    gains = {(mx, ref): (g, cross) for mx, ref, g, cross in proj["gains"]}
    w_bf16 = 32768 * BF16_ROW * 4 / 2
    w_mx = 32768 * (2 * MX_ROW + 2 * BF16_ROW) / 2
    for b in ep_wire_fit.BANDWIDTHS:
        want = (21.0 + 5 * 0.03 + w_bf16 / (b * 1e6)) / (21.6 + 5 * 0.03 + w_mx / (b * 1e6))
        assert gains[("conv_mxfp8", "conv_bf16")][0][b] == pytest.approx(want, rel=1e-9)
    # MXFP8 costs 0.6 ms of compute and saves w_bf16 - w_mx bytes: faster below their ratio
    assert gains[("conv_mxfp8", "conv_bf16")][1] == pytest.approx((w_bf16 - w_mx) / 0.6 / 1e6, rel=1e-6)
    assert ep_wire_fit.crossover_gbps({"compute_ms": 1.0, "bytes": 1e6, "exchanges": 5},
                                      {"compute_ms": 2.0, "bytes": 2e6, "exchanges": 5}, 0.1) is None


def test_script_writes_table_and_plot(tmp_path):
    paths = []
    for t, rec in _records().items():
        p = tmp_path / f"{t}.json"
        p.write_text(json.dumps(rec))
        paths.append(f"{t}={p}")
    md, png = tmp_path / "fit.md", tmp_path / "fit.png"
    res = run_python("scripts/ep_wire_fit.py", *paths, "--md", str(md), "--png", str(png), warm=True)
    assert res.returncode == 0, res.stderr
    text = md.read_text()
    assert "within 10%" in text and "gain at 50 GB/s" in text and "crossover" in text
    assert png.stat().st_size > 10_000


def test_script_rejects_mixed_world_sizes_and_bad_arguments(tmp_path):
    a, b = _record(0.03, 150.0, ROWS), _record(0.06, 20.0, ROWS, world=4)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    res = run_python("scripts/ep_wire_fit.py", f"nvlink={tmp_path / 'a.json'}", f"shm={tmp_path / 'b.json'}", warm=True)
    assert res.returncode == 2 and "world size" in res.stderr, res.stderr
    res = run_python("scripts/ep_wire_fit.py", str(tmp_path / "a.json"), warm=True)
    assert res.returncode == 2 and "NAME=FILE" in res.stderr, res.stderr
    res = run_python("-m", "benchmarks.bench_ep", "--device", "cpu", "--rows", "bf16,fp4", warm=True)
    assert res.returncode == 2 and "argument --rows" in res.stderr and "fp4" in res.stderr, res.stderr
    assert Path(ROOT / "scripts" / "ep_wire_runs.sh").exists()


def test_timeline_summary_and_listing(tmp_path):
    """``scripts/ep_timeline.py``: short and long gaps between kernels (overlapping kernels leave none), the
    experts' first GEMM (the first GEMM after the first communication kernel, not the router's before it), the
    communication kernels; a JSON without timelines is refused with one line."""
    tl = ep_timeline

    def k(kind, start, us, name="k"):
        return {"name": name, "kind": kind, "start_us": start, "us": us, "stream": 7, "scopes": []}

    timeline = [k("gemm", 0, 60, "router"), k("other", 90, 10),  # gap 30 (short)
                k("nccl", 300, 50), k("index", 320, 5),  # gap 200 (long), then inside the collective: no gap
                k("gemm", 400, 1000, "expert"), k("nccl", 1400, 100), k("copy", 1550, 10)]  # gaps 50, 0, 50
    s = tl.summary(timeline, short_us=100)
    assert s["kernels"] == 7 and s["span_ms"] == pytest.approx(1.56)
    assert s["short_gaps"] == 3 and s["short_gaps_ms"] == pytest.approx(0.13)
    assert s["long_gaps_ms"] == pytest.approx(0.2) and s["first_expert_gemm_ms"] == pytest.approx(0.4)
    assert s["comm"] == [(pytest.approx(0.3), pytest.approx(0.05)), (pytest.approx(1.4), pytest.approx(0.1))]
    lines = tl.listing(timeline)
    assert len(lines) == 7 and "gap     30.0" in lines[1] and "expert" in lines[4]
    rec = {"device": "cpu", "world": 2, "torch": "x", "rows": [{"row": "bf16", "timeline": timeline},
                                                                 {"row": "titan", "timeline": None}]}
    (tmp_path / "t.json").write_text(json.dumps(rec))
    res = run_python("scripts/ep_timeline.py", str(tmp_path / "t.json"), "--list", "bf16", warm=True)
    assert res.returncode == 0 and "experts start" in res.stdout and "expert" in res.stdout.splitlines()[-3], res.stderr
    res = run_python("scripts/ep_timeline.py", str(tmp_path / "t.json"), "--rows", "titan", warm=True)
    assert res.returncode == 2 and "no timeline for row(s) ['titan']" in res.stderr
    rec["rows"] = [{"row": "bf16", "timeline": None}]
    (tmp_path / "t.json").write_text(json.dumps(rec))
    res = run_python("scripts/ep_timeline.py", str(tmp_path / "t.json"), warm=True)
    assert res.returncode == 2 and "run benchmarks.bench_ep with --timeline" in res.stderr


def test_timeline_of_two_titan_traces(tmp_path):
    """``scripts/ep_timeline.py --traces A B`` (two profiled steps of torchtitan's trainer, issue 53): the GPU
    kernels and copies of each chrome trace in start order from its first (CPU ops and runtime calls left out),
    each kernel name's count and time in A and B with the largest difference first, the longest gaps; a missing
    trace or no input at all is refused with one line."""
    import gzip

    def ev(cat, name, ts, dur):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}

    a = [ev("kernel", "nvjet_gemm", 1000, 50), ev("kernel", "ncclDevKernel_SendRecv", 1100, 30),
         ev("cuda_runtime", "cudaStreamSynchronize", 1135, 20), ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)",
                                                                   1140, 2), ev("cpu_op", "aten::mm", 900, 400)]
    b = a[:2] + [ev("kernel", "ncclDevKernel_SendRecv", 1200, 30), ev("kernel", "nvjet_gemm", 1500, 70)]
    paths = []
    for name, events in (("a.json.gz", a), ("b.json", b)):
        path = tmp_path / name
        with (gzip.open(path, "wt") if name.endswith(".gz") else open(path, "w")) as f:
            json.dump({"traceEvents": events}, f)
        paths.append(str(path))
    tl = ep_timeline.trace_timeline(paths[0])
    assert [(k["kind"], k["start_us"], k["us"]) for k in tl] == [("gemm", 0, 50.0), ("nccl", 100, 30.0),
                                                                  ("copy", 140, 2.0)]
    rows = ep_timeline.compare(tl, ep_timeline.trace_timeline(paths[1]))
    assert rows[0]["kind"] == "gemm" and rows[0]["n"] == [1, 2] and rows[0]["diff_ms"] == pytest.approx(0.07)
    assert [(r["kind"], r["n"]) for r in rows[1:]] == [("nccl", [1, 2]), ("copy", [1, 0])]  # 0.03, then 0.002 ms
    assert ep_timeline.longest_gaps(tl) == [(50.0, 100, "ncclDevKernel_SendRecv"), (10.0, 140, a[3]["name"])]
    res = run_python("scripts/ep_timeline.py", "--traces", *paths, warm=True)
    assert res.returncode == 0 and "B - A ms" in res.stdout and "longest gaps of B" in res.stdout, res.stderr
    res = run_python("scripts/ep_timeline.py", "--traces", paths[0], str(tmp_path / "none.json"), warm=True)
    assert res.returncode == 2 and "no trace at" in res.stderr
    res = run_python("scripts/ep_timeline.py", warm=True)
    assert res.returncode == 2 and "--traces A B" in res.stderr


def test_peers_lines_up_every_ranks_communication_kernels():
    """``ep_timeline.peers``: the ranks' kernels on one clock (each rank's first kernel at its own wall-clock
    start), each rank's wait for the last rank's start, and the time with every rank in the collective."""

    def k(kind, start, us):
        return {"name": "k", "kind": kind, "start_us": start, "us": us, "stream": 7, "scopes": []}

    r0 = {"start_us": 1_000_000.0, "kernels": [k("gemm", 0, 50), k("nccl", 100, 500), k("nccl", 1000, 200)]}
    # rank 1 starts its step 300 us later: its first collective starts 400 us after rank 0's
    r1 = {"start_us": 1_000_300.0, "kernels": [k("nccl", 100, 200), k("gemm", 400, 10), k("nccl", 500, 300),
                                               k("nccl", 2000, 10)]}
    pr = ep_timeline.peers([r0, r1])
    assert pr["kernels"] == 2 and pr["counts"] == [2, 3]
    first, second = pr["rows"]
    assert first["start_ms"] == [pytest.approx(0.1), pytest.approx(0.4)]
    assert first["wait_ms"] == [pytest.approx(0.3), 0] and first["after_ms"] == pytest.approx(0.2)
    assert second["start_ms"] == [pytest.approx(1.0), pytest.approx(0.8)]
    assert second["wait_ms"] == [0, pytest.approx(0.2)] and second["after_ms"] == pytest.approx(0.2)
    assert pr["kernel_ms"] == [pytest.approx(0.7), pytest.approx(0.5)]
    assert pr["wait_ms"] == [pytest.approx(0.3), pytest.approx(0.2)] and pr["after_ms"] == pytest.approx(0.4)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_bench_ep_timelines_of_every_rank_and_their_peers_view():
    """``bench_ep --timeline`` records every rank's profiled step with its wall-clock start (the same clock on
    one host: the ranks' starts lie within the step), and ``ep_timeline.py --peers`` reads them."""
    res, out = _ran("test_bench_ep_timelines_of_every_rank_and_their_peers_view")
    assert res.rc == 0, res.tail()
    record = json.loads(out.read_text())
    for r in record["rows"]:
        tls = r["timelines"]
        assert len(tls) == 2 and tls[0]["kernels"] == r["timeline"], r["row"]  # rank 0's is the row's timeline
        assert all(t["start_us"] > 1e15 and t["kernels"] for t in tls)  # us since the epoch (2001 on)
        span_us = max(k["start_us"] + k["us"] for k in tls[0]["kernels"])
        assert abs(tls[0]["start_us"] - tls[1]["start_us"]) < span_us + 1e6, r["row"]
        counts = [sum(k["kind"] == "nccl" for k in t["kernels"]) for t in tls]
        assert counts[0] == counts[1] > 0, (r["row"], counts)
    res = run_python("scripts/ep_timeline.py", str(out), "--peers", "p2p_c2", warm=True)
    assert res.returncode == 0 and "waiting" in res.stdout and "rank 1: start" in res.stdout, res.stderr
