"""Expert parallelism, bf16 vs MXFP8 on the wire: the EP MoE block fwd + bwd in every variant, in one process.

    torchrun --nproc_per_node N -m benchmarks.bench_ep                    # N GPUs (nccl), N = 2 or 4
    torchrun --nproc_per_node N -m benchmarks.bench_ep --json ep.json     # the record scripts/ep_wire_fit.py reads
    python -m benchmarks.bench_ep --device cpu                            # smoke run (gloo, world 1, tiny sizes)
    options: --dim 7168 --hidden 2048 --experts-per-rank 8 --top-k 2 --tokens 16384
             --rows bf16,titan,conv_bf16,conv_mxfp8,p2p,p2p_c2,p2p_c4,p2p_c4_sm4,sync_free,sync_free_c2 --rounds 5
             --steps 4
             --timeline

Rows (``ROWS``; ``--rows`` picks some), each the EP block of the same weights, inputs and balanced routing:

====================  =========================================================================================
``bf16``              (i) ``moe_quant.moe.EPMoE``, bf16 experts, bf16 comms (all-to-all transport)
``titan``             (ii) torchtitan 0.3.0's ``RoutedExperts``: its ``AllToAllTokenDispatcher``, bf16 experts
``conv_bf16``         (iii) EPMoE, experts converted to MXFP8, bf16 comms
``conv_mxfp8``        (iv) EPMoE converted, MXFP8 comms (all-to-all transport)
``p2p``, ``p2p_cC``   (v) EPMoE converted, MXFP8 comms, point-to-point transport in C ranges of local experts
                      (``moe_quant.ep.blocks``: no pack/permute copies; C > 1 overlaps experts and exchange)
``p2p_cC_smN``        the same, the experts' GEMMs leaving N SMs to the exchange (``sm_carveout``; rows
                      p2p_c4_sm4/8/16/32, p2p_c2_sm4/8, p2p_c8_sm4,
                      sync_free_c2_sm8)
``*_merged``          the same rows posting one message per (peer, tensor) per range (``moe_quant.ep.blocks``:
                      the merged posting form, a candidate), rows p2p_merged, p2p_c2_sm4_merged, p2p_c4_sm4_merged
``conv_bf16_p2p_cC``  EPMoE converted, bf16 comms, point-to-point transport, C ranges
``sync_free[_c2]``    EPMoE converted, MXFP8 comms, sync-free mode (capacity factor 1.25, ``max_tokens`` the
                      tokens per rank), in 1 or 2 ranges
====================  =========================================================================================

Timing: ``--rounds`` rounds, each running ``--steps`` steps of every row in turn (interleaved, so drift hits
every row alike), after two warm-up steps per row; every step starts after a barrier and is timed with CUDA
events. Per row: the median step, its spread (min and max of the per-round medians), the ratios to rows
(i) and (ii), the peak memory of one step above what was allocated before it, the bytes each leg hands to
the transport per step (``moe_quant.ep.WireLog``), and each leg's communication kernel time in one
profiled step (``torch.profiler``: kernels whose name contains ``nccl``, attributed to the leg whose
``moe_quant.ep::<leg>`` range launched them; torchtitan's forward legs get the same ranges here, its
backward legs are left unattributed). Then one leg alone: ``all_to_all_single`` of bf16 and MXFP8 rows at
three sizes (the points the bandwidth fit of ``scripts/ep_wire_fit.py`` takes).

Where the step goes (``breakdown`` of each row, rank 0 prints it last): the profiled step is the second of
two run under the profiler (the first warms it up), each followed by a device sync. From it: the step's
window (its host range's start to its last kernel's end), the device's busy time (the union of the kernel
intervals on every stream) and idle time (window - busy: host-bound, or waiting on a host sync), the
kernels' summed time by kind (:func:`kernel_kind`: gemm, moe_quant, nccl, copy, index, other; concurrent
kernels each count, the excess over busy is the overlap), the kernel count, the host's
``cudaStream/Event/DeviceSynchronize`` calls and device-to-host copies, and the top kernels by total time
(printed for rows bf16, titan, conv_mxfp8 and p2p). ``legs_ms`` come from the same step. ``--timeline``: every
kernel of that step in the JSON (``timeline``: name, kind, start, time, stream, and the scopes that launched it
where the profiler links them), to compare rows kernel by kernel; ``timelines``: every rank's, each with its
wall-clock start (``scripts/ep_timeline.py --peers``: how long each rank's collectives waited for the others).
On the CPU: the aten ops' self time by the same kinds, busy = the union of the ops' spans.

``--json``: everything above, with the environment (world size, device, ``NCCL_P2P_DISABLE``,
``NCCL_SHM_DISABLE``). Without a GPU (and without ``--device cpu``) it prints one line, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.bench_moe import balanced_routing_
from benchmarks.timing import (call_ms, device_name, peak_memory_bytes, print_table, prog_name, profile_trace,
                               require_cuda, write_json)
from moe_quant import cli
from moe_quant.ep import WireLog, blocks, mxfp8_row_bytes
from moe_quant.ep.wire import PROFILE_PREFIX, all_to_all_mxfp8, all_to_all_rows, leg_range
from moe_quant.moe import EPMoE, MoE

GPU = dict(dim=7168, hidden=2048, experts_per_rank=8, top_k=2, tokens=16384)
CPU = dict(dim=64, hidden=96, experts_per_rank=4, top_k=2, tokens=64)
LEGS = ("counts", "dispatch", "combine", "combine backward", "dispatch backward")
CARVEOUTS = (4, 8, 16, 32)  # the p2p_c4_smN rows: SMs the experts' GEMMs leave to the exchange
# row -> EPMoE settings (convert, wire, transport, chunks), or "torchtitan"
ROWS = {
    "bf16": dict(convert=False, wire="bf16"),
    "titan": "torchtitan",
    "conv_bf16": dict(convert=True, wire="bf16"),
    "conv_mxfp8": dict(convert=True, wire="mxfp8"),
    "p2p": dict(convert=True, wire="mxfp8", transport="p2p"),
    "p2p_c2": dict(convert=True, wire="mxfp8", transport="p2p", chunks=2),
    "p2p_c4": dict(convert=True, wire="mxfp8", transport="p2p", chunks=4),
    **{f"p2p_c4_sm{n}": dict(convert=True, wire="mxfp8", transport="p2p", chunks=4, sm_carveout=n) for n in CARVEOUTS},
    "p2p_c2_sm8": dict(convert=True, wire="mxfp8", transport="p2p", chunks=2, sm_carveout=8),
    "p2p_c2_sm4": dict(convert=True, wire="mxfp8", transport="p2p", chunks=2, sm_carveout=4),
    "p2p_c8_sm4": dict(convert=True, wire="mxfp8", transport="p2p", chunks=8, sm_carveout=4),
    # the merged posting form (moe_quant.ep.blocks.POSTINGS): one message per peer and tensor per range
    "p2p_merged": dict(convert=True, wire="mxfp8", transport="p2p", posting="merged"),
    "p2p_c2_sm4_merged": dict(convert=True, wire="mxfp8", transport="p2p", chunks=2, sm_carveout=4, posting="merged"),
    "p2p_c4_sm4_merged": dict(convert=True, wire="mxfp8", transport="p2p", chunks=4, sm_carveout=4, posting="merged"),
    "conv_bf16_p2p_c2": dict(convert=True, wire="bf16", transport="p2p", chunks=2),
    "sync_free": dict(convert=True, wire="mxfp8", capacity_factor=1.25),
    "sync_free_c2": dict(convert=True, wire="mxfp8", capacity_factor=1.25, chunks=2),
    "sync_free_c2_sm8": dict(convert=True, wire="mxfp8", capacity_factor=1.25, chunks=2, sm_carveout=8),
}
LABELS = {
    "bf16": "(i) bf16 model, bf16 comms",
    "titan": "(ii) torchtitan AllToAllTokenDispatcher, bf16 experts",
    "conv_bf16": "(iii) converted, bf16 comms",
    "conv_mxfp8": "(iv) converted, MXFP8 comms",
    "p2p": "(v) converted, MXFP8 comms, p2p",
    "p2p_c2": "(v) converted, MXFP8 comms, p2p, 2 chunks",
    "p2p_c4": "(v) converted, MXFP8 comms, p2p, 4 chunks",
    **{f"p2p_c4_sm{n}": f"(v) p2p, 4 chunks, GEMMs leave {n} SMs" for n in CARVEOUTS},
    "p2p_c2_sm8": "(v) p2p, 2 chunks, GEMMs leave 8 SMs",
    "p2p_c2_sm4": "(v) p2p, 2 chunks, GEMMs leave 4 SMs",
    "p2p_c8_sm4": "(v) p2p, 8 chunks, GEMMs leave 4 SMs",
    "p2p_merged": "(v) p2p, one message per peer",
    "p2p_c2_sm4_merged": "(v) p2p, 2 chunks, GEMMs leave 4 SMs, one message per peer and range",
    "p2p_c4_sm4_merged": "(v) p2p, 4 chunks, GEMMs leave 4 SMs, one message per peer and range",
    "conv_bf16_p2p_c2": "converted, bf16 comms, p2p, 2 chunks",
    "sync_free": "converted, MXFP8 comms, sync-free (capacity 1.25)",
    "sync_free_c2": "converted, MXFP8 comms, sync-free (capacity 1.25), 2 chunks",
    "sync_free_c2_sm8": "sync-free (capacity 1.25), 2 chunks, GEMMs leave 8 SMs",
}
DEFAULT_ROWS = "bf16,titan,conv_bf16,conv_mxfp8,p2p,p2p_c2,p2p_c4,p2p_c4_sm4,sync_free,sync_free_c2"
LEG_FRACTIONS = (0.25, 0.5, 1.0)  # the leg-alone sizes, fractions of one dispatch's rows
# the step breakdown (``_breakdown``): the kinds of device time, in the order of the table
KINDS = ("gemm", "moe_quant", "nccl", "copy", "index", "other")
# moe_quant's CuTe-DSL kernel classes (moe_quant/kernels/*/kernel.py): cute names a kernel after its module path
# and class, kernel_cutlass_kernel_moe_quantkernelsquantize_1x32Quantize1x32Kernel_object_at__tensorptr...
MOE_QUANT_KERNELS = ("Quantize1x32Kernel", "Quantize32x1Kernel", "QuantizeBlockKernel", "SwiGLUMathKernel",
                     "PermuteMxfp8Kernel", "FingerprintKernel")
GEMM_MARKS = ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma")  # substrings of the lower-case name
GEMM_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear"}  # whole words: aten::mm, aten::_grouped_mm, ...
INDEX_MARKS = ("index", "scatter", "gather", "sort", "cumsum", "scan", "histc", "histogram", "bincount", "nonzero",
               "searchsorted", "unique", "repeat_interleave")
COPY_MARKS = ("memcpy", "memset", "copy", "fill")
COPY_OPS = {"cat", "clone", "contiguous", "zero", "zeros", "stack"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
STEP_RANGE = "bench_ep.step"  # no "::": on the CPU, not one of the ops itself
PROFILED_STEPS = 2  # the breakdown takes the last (the first warms the profiler up)
TOP_KERNELS = 12
TOP_ROWS = ("bf16", "titan", "conv_mxfp8", "p2p")  # the rows whose top kernels the printout lists


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for name in GPU:
        p.add_argument(f"--{name.replace('_', '-')}", type=cli.positive_int, default=None)
    p.add_argument("--rows", type=cli.comma_choices(*ROWS), default=DEFAULT_ROWS.split(","),
                   help=f"comma list of {', '.join(ROWS)} (default {DEFAULT_ROWS})")
    p.add_argument("--rounds", type=cli.positive_int, default=5)
    p.add_argument("--steps", type=cli.positive_int, default=4, help="timed steps of each row per round")
    p.add_argument("--json", type=cli.writable_file, default=None)
    p.add_argument("--wire-gbps", type=cli.positive_float, default=None,
                   help="hold every exchange to at least its bytes over this many GB/s per GPU (benchmarks.slow_wire: "
                        "a slower wire on NVLink, the same for every row; CUDA, not the torchtitan row)")
    p.add_argument("--timeline", action="store_true",
                   help="keep the profiled step's kernels of every row in the JSON (rank 0): name, start, time, "
                        "stream and the ops and ranges that launched it, to compare rows kernel by kernel")
    args = p.parse_args(argv)
    if args.wire_gbps is not None and args.device != "cuda":
        p.error("--wire-gbps needs --device cuda (it holds NCCL's exchanges on the GPU)")
    if args.wire_gbps is not None and "titan" in args.rows:
        p.error("--wire-gbps does not slow torchtitan's exchanges (functional collectives): leave the titan row out "
                "of --rows")
    return args


def _init(cuda: bool):
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    else:  # world size 1 without torchrun
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    """ms of one ``fn()`` started after a barrier (every rank issues the same collectives)."""
    dist.barrier()
    return call_ms(fn, device)


def _convert(model, mode="rceil"):
    from torchao.quantization import quantize_

    from moe_quant.conversion import MXFP8MoEConfig

    quantize_(model, MXFP8MoEConfig(scale_mode=mode), filter_fn=lambda mod, fqn: "experts" in fqn)
    return model


def _titan_block(base: MoE, device, world: int, rank: int):
    """torchtitan's RoutedExperts over this rank's experts of ``base`` with its AllToAllTokenDispatcher, the
    dispatcher's forward exchanges inside ``moe_quant.ep::`` profiler ranges; returns ``step_fn(x, grad)``
    that routes with ``base``'s router (the routing every row uses)."""
    from torch.distributed.device_mesh import init_device_mesh

    from examples.titan.launch import provide_missing_torch_names

    provide_missing_torch_names()  # torchtitan 0.3.0 on a released torch (2.11: its dispatcher calls a missing name)
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend("partial_dtensor")  # plain process groups (its default needs torchtitan's trainer)

    class Ranged(AllToAllTokenDispatcher):
        def _token_count_exchange(self, *a, **k):
            with leg_range("counts"):
                return super()._token_count_exchange(*a, **k)

        def _dispatch_token_exchange(self, *a, **k):
            with leg_range("dispatch"):
                return super()._dispatch_token_exchange(*a, **k)

        def _combine_token_exchange(self, *a, **k):
            with leg_range("combine"):
                return super()._combine_token_exchange(*a, **k)

    n = base.experts.num_experts // world
    w1 = base.experts.w1
    cfg = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=w1.shape[2], hidden_dim=w1.shape[1], num_experts=n),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=base.experts.num_experts, top_k=base.top_k))
    block = cfg.build()
    block.token_dispatcher.__class__ = Ranged
    block.to(device, torch.bfloat16)
    with torch.no_grad():
        for mine, theirs in (("w1_EFD", "w1"), ("w2_EDF", "w2"), ("w3_EFD", "w3")):
            getattr(block.inner_experts, mine).copy_(getattr(base.experts, theirs)[rank * n:(rank + 1) * n])
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    block.token_dispatcher.wire_meshes(ep_mesh=mesh)
    router = base.router

    def forward(x):
        scores, ids, counts = router(x)
        t, k = ids.shape
        return block(x.view(1, t, -1), scores.view(1, t, k), ids.view(1, t, k), counts).view(t, -1)

    return block, forward


def _build(row: str, base: MoE, device, world: int, rank: int, tokens: int):
    """``(module, forward)`` of one row."""
    spec = ROWS[row]
    if spec == "torchtitan":
        return _titan_block(base, device, world, rank)
    spec = dict(spec)
    convert = spec.pop("convert")
    spec.pop("posting", None)  # applied around each step (_step_fn)
    if "capacity_factor" in spec:
        spec["max_tokens"] = tokens
    model = EPMoE.from_moe(base, **spec)
    if convert:
        _convert(model)
    return model, model


def _step_fn(module, forward, x, grad, posting: str | None = None):
    """One fwd + bwd of the row; ``posting``: the p2p transport's posting form for it (``moe_quant.ep.blocks``)."""

    def step():
        xi = x.detach().requires_grad_()
        with blocks.posting(posting or blocks.POSTINGS[0]):
            forward(xi).backward(grad)
        for p in module.parameters():
            p.grad = None

    return step


def _legs_from_profile(ops: list[dict], steps: int) -> dict:
    """ms per step of the communication kernels of each leg (kind ``nccl``: :func:`kernel_kind`), by the
    ``moe_quant.ep::<leg>`` range that launched them; ``unattributed`` for the rest."""
    out = {}
    for op in ops:
        if kernel_kind(op["name"]) != "nccl":
            continue
        leg = next((s[len(PROFILE_PREFIX):] for s in op["scopes"] if s.startswith(PROFILE_PREFIX)), "unattributed")
        out[leg] = out.get(leg, 0.0) + op["us"] / 1e3 / steps
    return out


def kernel_kind(name: str) -> str:
    """The kind of device time of a kernel (or, on the CPU, an op) by its name: ``nccl`` (NCCL kernels, and
    :mod:`benchmarks.slow_wire`'s, which stand for a slower wire's transfer; the ``c10d`` / ``gloo`` ops on the
    CPU), ``moe_quant`` (our CuTe-DSL kernels: their names carry moe_quant's module path and class; the
    ``moe_quant::`` ops on the CPU), ``gemm`` (cuBLAS / CUTLASS / grouped and scaled mm),
    ``index`` (index, scatter, gather, sort, scan / cumsum, histc, bincount), ``copy`` (memcpy, memset, fill,
    cat, copy kernels), else ``other`` (elementwise, reductions, the rest). First match in that order."""
    low = name.lower()
    words = set(re.split(r"[^a-z0-9]+", low))  # aten::_scaled_grouped_mm -> {aten, scaled, grouped, mm}
    if "nccl" in low or "c10d" in low or "gloo" in low or "slow_wire" in low:  # slow_wire: the emulated wire's time
        return "nccl"
    if "moe_quant::" in low or "moe_quantkernels" in low or any(k in name for k in MOE_QUANT_KERNELS):
        return "moe_quant"
    if any(m in low for m in GEMM_MARKS) or words & GEMM_OPS:
        return "gemm"
    if any(m in low for m in INDEX_MARKS):
        return "index"
    if any(m in low for m in COPY_MARKS) or words & COPY_OPS:
        return "copy"
    return "other"


_NAMESPACES = re.compile(r"\(anonymous namespace\)::|\b(?:at::native|at::cuda::detail|at::detail|at_cuda_detail|cub|"
                         r"cutlass::gemm::kernel|cutlass::gemm|cutlass|cute|c10|at|std)::")


def short_kernel_name(name: str, width: int = 60) -> str:
    """``name`` in at most ``width`` characters: a moe_quant CuTe-DSL kernel as its class and tensor dtypes
    (``Quantize1x32Kernel f32,bf16``), any other without ``void`` and the common C++ namespaces, cut at ``width``."""
    m = re.search(r"([A-Z][A-Za-z0-9]*Kernel)_object_at_", name)
    if m and ("moe_quant" in name or m.group(1) in MOE_QUANT_KERNELS):
        dtypes = re.findall(r"tensorptr([A-Za-z0-9]+?)gmem", name)
        out = f"{m.group(1)} {','.join(dict.fromkeys(dtypes))}".strip()
    else:
        out = _NAMESPACES.sub("", name.removeprefix("void ")).strip()
    return out if len(out) <= width else out[:width - 3] + "..."


def _union_us(spans) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _timeline_start_us(ops: list[dict], trace_start_us: float | None) -> float | None:
    """Wall-clock time (us since the epoch) of the first of ``ops``, the origin of :func:`_timeline`'s starts."""
    if trace_start_us is None or not ops:
        return None
    return trace_start_us + min(o["start_us"] for o in ops)


def _timeline(ops: list[dict]) -> list[dict]:
    """The profiled step's kernels (CPU: ops) in start order: short name, kind, start (us from the first), time
    (us), stream, and the innermost scopes that launched it (op, ranges)."""
    ops = sorted(ops, key=lambda o: o["start_us"])
    t0 = ops[0]["start_us"] if ops else 0.0
    return [{"name": short_kernel_name(o["name"]), "kind": kernel_kind(o["name"]),
             "start_us": round(o["start_us"] - t0, 1),
             "us": round(o["us"], 1), "stream": o.get("stream"), "scopes": list(o["scopes"])[:4]} for o in ops]


def _profile_steps(step, device) -> dict:
    """``PROFILED_STEPS`` steps under the profiler (:func:`benchmarks.timing.profile_trace`), each inside a
    ``STEP_RANGE`` range and followed by a device sync (as the timed steps end), so no kernel of one step runs
    in the next one's window."""
    def one():
        with torch.profiler.record_function(STEP_RANGE):
            step()
        _sync(device)

    dist.barrier()
    return profile_trace(one, device, iters=PROFILED_STEPS)


def _breakdown(trace: dict, cuda: bool) -> tuple[dict, list[dict]]:
    """Where the last profiled step's time goes, and that step's ops (for ``_legs_from_profile``).

    The step's window opens with its host range and closes at the later of the range's end and its last
    kernel's end; its kernels are those that start between the range's start and the next step's. ``busy``:
    the union of their intervals on every stream (overlap counted once); ``idle`` = window - busy (the GPU had
    nothing to run: host-bound or waiting on a host sync); ``kinds_ms``: their summed time by
    :func:`kernel_kind` (concurrent kernels each count, so the kinds add up to ``kernel_sum_ms`` >= busy);
    host side: the sync calls (``SYNC_CALLS``) inside the range and the device-to-host copies. CPU (no
    kernels): the aten ops instead, ``us`` their self time, ``busy`` the union of their spans, ``idle`` the
    Python between them."""
    ranges = sorted((h for h in trace["host"] if h["name"] == STEP_RANGE), key=lambda h: h["start_us"])
    if not ranges:
        return {"available": False, "reason": f"no {STEP_RANGE} range in the profile"}, []
    rng = ranges[-1]
    ops = [o for o in trace["ops"] if o["start_us"] >= rng["start_us"]]
    end = max([rng["end_us"]] + [o["end_us"] for o in ops])
    wall = end - rng["start_us"]
    busy = _union_us((o["start_us"], o["end_us"]) for o in ops)
    kinds = dict.fromkeys(KINDS, 0.0)
    kernels: dict = {}
    for o in ops:
        kind = kernel_kind(o["name"])
        kinds[kind] += o["us"]
        k = kernels.setdefault(o["name"], {"name": short_kernel_name(o["name"]), "kind": kind, "count": 0, "us": 0.0,
                                           "full": o["name"][:400]})
        k["count"] += 1
        k["us"] += o["us"]
    syncs = dict.fromkeys(SYNC_CALLS, 0)
    sync_us = 0.0
    for h in trace["host"]:
        if h["name"] in syncs and rng["start_us"] <= h["start_us"] < rng["end_us"]:
            syncs[h["name"]] += 1
            sync_us += h["end_us"] - h["start_us"]
    kernel_sum = sum(kinds.values())
    out = {
        "available": True,
        "source": "CUDA kernels" if cuda else "CPU aten ops (self time; no CUDA kernels)",
        "profiled_step": len(ranges), "wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "idle_ms": (wall - busy) / 1e3,
        "kernel_sum_ms": kernel_sum / 1e3, "overlap_ms": (kernel_sum - busy) / 1e3 if cuda else None,
        "kernels": len(ops), "streams": len({o["stream"] for o in ops if o.get("stream") is not None}),
        "d2h_copies": sum("dtoh" in o["name"].lower() for o in ops),
        "syncs": syncs, "host_syncs": sum(syncs.values()), "sync_wait_ms": sync_us / 1e3,
        "kinds_ms": {k: v / 1e3 for k, v in kinds.items()},
        "top": sorted(kernels.values(), key=lambda k: -k["us"])[:TOP_KERNELS],
    }
    return out, ops


def _legs_alone(device, world: int, s: dict, iters: int) -> list[dict]:
    """One leg alone, bf16 rows (one ``all_to_all_single``) and MXFP8 rows (data and scales, two), at
    ``LEG_FRACTIONS`` of a dispatch (even splits)."""
    out = []
    full = s["tokens"] * s["top_k"]
    for wire, row_bytes in (("bf16", 2 * s["dim"]), ("mxfp8", mxfp8_row_bytes(s["dim"]))):
        for frac in LEG_FRACTIONS:
            n_rows = max(world, int(full * frac) // world * world)
            splits = [n_rows // world] * world
            if wire == "bf16":
                buf = torch.zeros(n_rows, row_bytes, dtype=torch.uint8, device=device)
                fn = lambda buf=buf: all_to_all_rows(buf, splits, splits, None, "bench")  # noqa: E731
            else:  # what an MXFP8 leg sends: the data and the scales, two exchanges
                buf = (torch.zeros(n_rows, s["dim"], dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
                       torch.zeros(n_rows, s["dim"] // 32, dtype=torch.uint8, device=device))
                fn = lambda buf=buf: all_to_all_mxfp8(*buf, splits, splits, None, "bench")  # noqa: E731
            for _ in range(2):
                fn()
            times = [_timed(fn, device) for _ in range(iters)]
            ms = statistics.median(times)
            to_others = n_rows * row_bytes * (world - 1) // world
            out.append({"wire": wire, "rows": n_rows, "bytes": n_rows * row_bytes, "bytes_to_others": to_others,
                        "ms": ms, "ms_min": min(times), "ms_max": max(times),
                        "bus_gbps": to_others / ms / 1e6 if world > 1 else None})
            del buf
    return out


def run(args) -> dict:
    cuda = args.device == "cuda"
    device = _init(cuda)
    if args.wire_gbps is None:
        return _run(args, cuda, device)
    from benchmarks.slow_wire import SlowWire

    with SlowWire(args.wire_gbps):
        return _run(args, cuda, device)


def _run(args, cuda: bool, device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    s = dict(GPU if cuda else CPU)
    for k in s:
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    torch.manual_seed(0)
    base = MoE(s["dim"], s["hidden"], s["experts_per_rank"] * world, s["top_k"]).to(device, torch.bfloat16)
    x = torch.randn(s["tokens"], s["dim"], device=device, dtype=torch.bfloat16)
    balanced_routing_(base, x)
    grad = torch.randn_like(x)

    rows, notes = {}, {}
    for row in args.rows:
        try:
            module, forward = _build(row, base, device, world, rank, s["tokens"])
        except ImportError as e:  # torchtitan missing: the row is left out, said so
            notes[row] = f"not run: {e}"
            continue
        posting = ROWS[row].get("posting") if isinstance(ROWS[row], dict) else None
        rows[row] = {"step": _step_fn(module, forward, x, grad, posting), "module": module, "ms": [], "round_medians": []}
    for rec in rows.values():  # warm-up (kernel compiles, the dispatchers' handshakes)
        for _ in range(2):
            rec["step"]()
    _sync(device)
    for _ in range(args.rounds):
        for rec in rows.values():
            times = [_timed(rec["step"], device) for _ in range(args.steps)]
            rec["ms"] += times
            rec["round_medians"].append(statistics.median(times))
    for row, rec in rows.items():
        with WireLog() as log:
            rec["step"]()
        rec["wire"] = {leg: dict(zip(("rows", "bytes"), log.by_leg(leg))) for leg in LEGS}
        rec["peak_mib"] = None if (p := peak_memory_bytes(rec["step"], device)) is None else p / 2**20
        trace = _profile_steps(rec["step"], device)
        rec["breakdown"], step_ops = _breakdown(trace, cuda)
        rec["legs_ms"] = _legs_from_profile(step_ops, 1) if cuda else {}
        rec["timeline"] = _timeline(step_ops) if args.timeline else None
        rec["timeline_start_us"] = _timeline_start_us(step_ops, trace.get("trace_start_us")) if args.timeline else None
        disp = getattr(rec["module"], "dispatcher", None)
        rec["dropped"] = None
        if getattr(disp, "capacity_factor", None) is not None:  # sync-free rows: copies past capacity, if any
            try:
                rec["dropped"] = disp.check_overflow()
            except ValueError as e:
                rec["dropped"] = str(e)
    if "titan" in rows and "bf16" in rows:  # torchtitan's legs carry the bytes of the bf16 row's (same routing)
        rows["titan"]["wire"] = rows["bf16"]["wire"]
    legs_alone = _legs_alone(device, world, s, iters=max(3, args.rounds))

    records = []
    for row, rec in rows.items():
        records.append({"row": row, "label": LABELS[row], "ms": statistics.median(rec["ms"]), "samples": rec["ms"],
                        "round_min": min(rec["round_medians"]), "round_max": max(rec["round_medians"]),
                        "peak_mib": rec["peak_mib"], "wire": rec["wire"], "legs_ms": rec["legs_ms"],
                        "dropped": rec["dropped"], "breakdown": rec["breakdown"], "timeline": rec["timeline"],
                        "settings": ROWS[row] if isinstance(ROWS[row], dict) else {"dispatcher": "torchtitan"}})
    # every rank's medians: a step ends when the slowest rank's does
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {r["row"]: r["ms"] for r in records})
    if args.timeline:  # every rank's profiled step, on the host's wall clock (scripts/ep_timeline.py --peers)
        timelines = [None] * world
        dist.all_gather_object(timelines, {row: {"start_us": rec["timeline_start_us"], "kernels": rec["timeline"]}
                                           for row, rec in rows.items()})
        for r in records:
            r["timelines"] = [t[r["row"]] for t in timelines]
    ref = {k: next((r["ms"] for r in records if r["row"] == k), None) for k in ("bf16", "titan")}
    for r in records:
        r["ms_per_rank"] = [m[r["row"]] for m in per_rank]
        r["vs_bf16"] = r["ms"] / ref["bf16"] if ref["bf16"] else None
        r["vs_titan"] = r["ms"] / ref["titan"] if ref["titan"] else None
    result = {"sizes": s, "world": world, "device": device_name() if cuda else "cpu", "torch": torch.__version__,
              "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_ALGO",
                                                       "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")},
              "wire_gbps": args.wire_gbps,
              "rounds": args.rounds, "steps": args.steps, "rows": records, "notes": notes, "legs_alone": legs_alone}
    if rank == 0:
        _print(result)
        write_json(args.json, result)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _fmt(v, spec=".3f"):
    return "" if v is None else format(v, spec)


def _print(result: dict) -> None:
    s, world = result["sizes"], result["world"]
    env = ", ".join(f"{k}={v}" for k, v in result["env"].items() if v is not None) or "NCCL defaults"
    if result.get("wire_gbps"):
        env += f", every exchange held to {result['wire_gbps']:g} GB/s (benchmarks.slow_wire)"
    print(f"bench_ep: {result['device']} x {world}, torch {result['torch']}, {env}, sizes {s}, "
          f"{result['rounds']} rounds x {result['steps']} steps (interleaved)")
    rows = []
    for r in result["rows"]:
        comm = sum(v for v in r["legs_ms"].values())
        rows.append([r["label"], f"{r['ms']:.2f}", f"{r['round_min']:.2f}-{r['round_max']:.2f}", _fmt(r["vs_bf16"]),
                     _fmt(r["vs_titan"]), "" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}",
                     " ".join(f"{leg}={ms:.3f}" for leg, ms in r["legs_ms"].items()) + (f" (sum {comm:.2f})" if comm else "")])
    print_table("EP MoE block fwd + bwd per rank (median; spread = min-max of the round medians)",
                ["variant", "ms", "spread", "vs (i)", "vs (ii)", "peak MiB", "comm kernel ms per leg"], rows)
    for row, note in result["notes"].items():
        print(f"  {row}: {note}")
    rows = [[p["wire"], p["rows"], p["bytes"], f"{p['ms']:.3f}", _fmt(p["bus_gbps"], ".1f")]
            for p in result["legs_alone"]]
    print_table(f"One leg alone (all_to_all_single, even splits), {world} rank(s)",
                ["wire", "rows", "bytes", "ms", "bus GB/s"], rows)
    _print_breakdown(result)


def _print_breakdown(result: dict) -> None:
    """Where each row's profiled step goes (rank 0), then the top kernels of ``TOP_ROWS``."""
    recs = [r for r in result["rows"] if r.get("breakdown", {}).get("available")]
    for r in result["rows"]:
        if r not in recs:
            print(f"  {r['row']}: no breakdown ({r.get('breakdown', {}).get('reason', 'not profiled')})")
    if not recs:
        return
    cuda = recs[0]["breakdown"]["overlap_ms"] is not None
    rows = []
    for r in recs:
        b = r["breakdown"]
        rows.append([r["row"], f"{r['ms']:.2f}", f"{b['wall_ms']:.2f}", f"{b['busy_ms']:.2f}", f"{b['idle_ms']:.2f}",
                     _fmt(b["overlap_ms"], ".2f"), b["kernels"], b["streams"], b["d2h_copies"], b["host_syncs"],
                     f"{b['sync_wait_ms']:.2f}"] + [f"{b['kinds_ms'][k]:.2f}" for k in KINDS])
    what = "GPU kernels" if cuda else "CPU aten ops (self time; no GPU)"
    print_table(f"Where the step goes, rank 0, step {recs[0]['breakdown']['profiled_step']} of {PROFILED_STEPS} "
                f"under torch.profiler, by {what} (ms)",
                ["row", "timed", "step", "busy", "idle", "overlap", "kernels", "streams", "d2h", "syncs", "sync wait"]
                + list(KINDS), rows)
    print("  timed: the median step above; step: the profiled step's window (its host range's start to its last\n"
          "  kernel's end); busy: the union of the kernels' intervals on every stream; idle = step - busy (nothing\n"
          "  on the device: host-bound or waiting on a host sync); overlap = sum of the kinds - busy (kernels running\n"
          "  concurrently); d2h: device-to-host copies; syncs: cudaStream/Event/DeviceSynchronize calls in the step,\n"
          "  sync wait: the host's time in them; kinds: summed kernel time (nccl includes a kernel's wait for its peer)"
          if cuda else
          "  CPU: busy = the union of the aten ops' spans, idle = step - busy (Python between ops); kinds: self time")
    top = [r for r in recs if r["row"] in TOP_ROWS] or recs[:1]
    for r in top:
        b = r["breakdown"]
        print_table(f"Top kernels of {r['label']} ({r['row']}), profiled step {b['wall_ms']:.2f} ms",
                    ["kernel", "kind", "count", "total us", "% of step"],
                    [[k["name"], k["kind"], k["count"], f"{k['us']:.0f}",
                      f"{100 * k['us'] / 1e3 / b['wall_ms']:.1f}" if b["wall_ms"] else ""] for k in b["top"]])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda(argv)
    else:
        torch.set_num_threads(1)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
