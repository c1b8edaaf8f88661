"""Expert parallelism, bf16 vs MXFP8 on the wire: wire bytes, all-to-all legs, the EP MoE block fwd + bwd.

    python -m benchmarks.bench_ep                                  # world size 1 on one GPU
    torchrun --nproc_per_node N -m benchmarks.bench_ep             # N GPUs (nccl)
    python -m benchmarks.bench_ep --device cpu                     # smoke run (gloo, tiny sizes)
    options: --dim 7168 --hidden 2048 --experts-per-rank 8 --top-k 2 --tokens 16384 --iters 10

Three tables, printed by rank 0:

1. Wire bytes per token at DeepSeek-V3 (hidden 7168) and Llama4 (hidden 5120): bf16 ``2 D``, MXFP8
   ``D + D/32`` (e4m3 data plus one e8m0 byte per 32), and the bytes per token actually handed to
   ``all_to_all_single`` by one dispatch (``moe_quant.ep.WireLog``).
2. Each leg's all-to-all alone (dispatch and combine backward in MXFP8 vs bf16): ms and bus bandwidth
   ``bytes * (N - 1) / N / time`` per rank (with N = 1 this is a local copy through the backend).
3. The EP MoE block (``moe_quant.moe.EPMoE``, balanced routing so bf16 groups are multiples of 8)
   fwd + bwd: bf16 model + bf16 comms, converted + bf16 comms, converted + MXFP8 comms; ms per step,
   tokens/s per rank, peak memory above the inputs.

Timing uses a fixed number of iterations on every rank (CUDA events between barriers), since ranks must
issue the same collectives. Without a GPU (and without ``--device cpu``) it prints one line, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.bench_moe import balanced_routing_
from benchmarks.timing import device_name, peak_memory_bytes, print_table, require_cuda
from moe_quant.ep import WireLog, mxfp8_row_bytes
from moe_quant.ep.wire import all_to_all_rows
from moe_quant.moe import EPMoE, MoE

SIZES = {"DeepSeek-V3": 7168, "Llama4": 5120}
GPU = dict(dim=7168, hidden=2048, experts_per_rank=8, top_k=2, tokens=16384)
CPU = dict(dim=64, hidden=96, experts_per_rank=2, top_k=2, tokens=64)


def _init(cuda: bool):
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    else:  # world size 1 without torchrun
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _time_ms(fn, device, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` calls after 2 warm-up calls; same count on every rank."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _convert(model, mode="rceil"):
    from torchao.quantization import quantize_

    from moe_quant.conversion import MXFP8MoEConfig

    quantize_(model, MXFP8MoEConfig(scale_mode=mode), filter_fn=lambda mod, fqn: "experts" in fqn)
    return model


def run(args) -> None:
    cuda = args.device == "cuda"
    device = _init(cuda)
    world, rank = dist.get_world_size(), dist.get_rank()
    s = dict(GPU if cuda else CPU)
    for k in s:
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    n_experts, t, k = s["experts_per_rank"] * world, s["tokens"], s["top_k"]
    torch.manual_seed(0)
    base = MoE(s["dim"], s["hidden"], n_experts, k).to(device, torch.bfloat16)
    x = torch.randn(t, s["dim"], device=device, dtype=torch.bfloat16)
    balanced_routing_(base, x)
    grad = torch.randn_like(x)
    out_rows = []

    # 1. wire bytes per token
    rows1 = []
    for name, d in SIZES.items():
        rows1.append([name, d, 2 * d, mxfp8_row_bytes(d), f"{mxfp8_row_bytes(d) / d:.4f}",
                      f"{mxfp8_row_bytes(d) / (2 * d):.4f}"])
    ep = EPMoE.from_moe(base, wire="mxfp8")
    with WireLog() as log, torch.no_grad():
        ep(x)
    rows_, nbytes = log.by_leg("dispatch")
    rows1.append(["measured (this run)", s["dim"], "", f"{nbytes / max(rows_, 1):.1f}", f"{nbytes / max(rows_, 1) / s['dim']:.4f}", ""])

    # 2. the legs alone
    rows2 = []
    n_rows = t * k
    per_rank = [n_rows // world] * world
    per_rank[-1] += n_rows - sum(per_rank)
    d = s["dim"]
    for wire, row_bytes in (("bf16", 2 * d), ("mxfp8", mxfp8_row_bytes(d))):
        buf = torch.zeros(n_rows, row_bytes, dtype=torch.uint8, device=device)
        ms = _time_ms(lambda: all_to_all_rows(buf, per_rank, per_rank, None, "bench"), device, args.iters)
        moved = n_rows * row_bytes * (world - 1) / world if world > 1 else n_rows * row_bytes
        rows2.append([wire, n_rows, row_bytes, f"{ms:.3f}", f"{moved / ms / 1e6:.1f}"])

    # 3. the EP block fwd + bwd
    rows3 = []
    variants = (("bf16 model, bf16 comms", False, "bf16"), ("converted, bf16 comms", True, "bf16"),
                ("converted, MXFP8 comms", True, "mxfp8"))
    for label, convert, wire in variants:
        model = EPMoE.from_moe(base, wire=wire)
        if convert:
            _convert(model)
        xi = x.clone().requires_grad_()

        def step():
            model(xi).backward(grad)
            xi.grad = None
            for p in model.parameters():
                p.grad = None

        ms = _time_ms(step, device, args.iters)
        peak = peak_memory_bytes(step, device)
        peak = None if peak is None else peak / 2**20  # MiB
        rows3.append([label, f"{ms:.2f}", f"{t / ms * 1e3:,.0f}", "" if peak is None else f"{peak:,.0f}"])
        out_rows.append((label, ms))
        del model

    if rank == 0:
        print(f"bench_ep: {device_name()} x {world}, torch {torch.__version__}, sizes {s}")
        print_table("Wire bytes per token", ["model", "hidden D", "bf16 B", "MXFP8 B", "MXFP8 / D", "MXFP8 / bf16"], rows1)
        print_table(f"All-to-all of one leg, {world} rank(s)", ["wire", "rows", "bytes/row", "ms", "bus GB/s"], rows2)
        print_table("EP MoE block fwd + bwd (per rank)", ["variant", "ms", "tokens/s", "peak MiB"], rows3)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for name in ("dim", "hidden", "experts_per_rank", "top_k", "tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if args.device == "cuda":
        require_cuda()
    else:
        torch.set_num_threads(1)
    run(args)


if __name__ == "__main__":
    main()
