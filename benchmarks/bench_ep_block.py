"""The EP MoE block fwd + bwd, synced vs sync-free dispatch, eager vs compiled vs CUDA graph (world size 1).

    python -m benchmarks.bench_ep_block                       # one GPU, DeepSeek-V3 expert sizes
    python -m benchmarks.bench_ep_block --json ep_block.json
    python -m benchmarks.bench_ep_block --device cpu --execs eager --iters 2   # CPU smoke (gloo, tiny)
    options: --dim 7168 --hidden 2048 --experts 8 --top-k 2 --tokens 16384 --capacity-factor 1.25

The block is ``moe_quant.moe.EPMoE`` with converted experts (MXFP8 on the wire) over a world-size-1
process group (nccl; gloo on CPU), balanced routing. Modes: ``synced`` (the split sizes read on the host
once per dispatch) and ``sync_free`` (``capacity_factor``: static sizes, no host read). Executions:
``eager``; ``compiled`` (``torch.compile(fullgraph=True)`` of the block, inductor); ``cudagraph`` (the
eager fwd + bwd captured once in a CUDA graph and replayed; sync-free only: the synced mode reads the
host inside the step, which a graph cannot hold). Per row: device ms per step (CUDA events), host ms per
step (wall time of issuing one step without waiting for the GPU; the synced mode's host read makes it
wait), peak memory above the inputs (for ``cudagraph`` over the warm-up steps and the capture, which make the
graph's memory pool; a replay allocates nothing). One line on stderr and exit 2 without a GPU (unless ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.bench_moe import balanced_routing_
from benchmarks.timing import device_name, peak_memory_bytes, print_table, require_cuda
from moe_quant.moe import EPMoE, MoE

GPU = dict(dim=7168, hidden=2048, experts=8, top_k=2, tokens=16384)
CPU = dict(dim=64, hidden=96, experts=4, top_k=2, tokens=64)
EXECS = ("eager", "compiled", "cudagraph")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for k in GPU:
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--execs", default=",".join(EXECS), help="comma list of eager, compiled, cudagraph")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.execs = [e.strip() for e in args.execs.split(",") if e.strip()]
    bad = [e for e in args.execs if e not in EXECS]
    if bad or not args.execs:
        p.error(f"--execs takes {', '.join(EXECS)}, got {bad or 'nothing'}")
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(step, device, iters: int) -> tuple[float, float]:
    """``(device ms, host ms)`` medians per step after 3 warm-up steps."""
    for _ in range(3):
        step()
    _sync(device)
    dev, host = [], []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t0))
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end))
        else:
            dev.append(host[-1])
    return statistics.median(dev), statistics.median(host)


def _make_step(model, x, grad, exec_: str):
    def zero():
        x.grad = None
        for p in model.parameters():
            p.grad = None

    if exec_ == "cudagraph":
        zero()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up (the dispatcher's one-time handshake included)
                model(x).backward(grad)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x).backward(grad)
        return graph.replay
    fwd = torch.compile(model, fullgraph=True) if exec_ == "compiled" else model

    def step():
        fwd(x).backward(grad)
        zero()

    return step


def run(args) -> dict:
    cuda = args.device == "cuda"
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch._dynamo.config.capture_scalar_outputs = True  # the synced mode's split sizes, as torchtitan sets it
    s = dict(GPU if cuda else CPU)
    for k in s:
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    torch.manual_seed(0)
    base = MoE(s["dim"], s["hidden"], s["experts"], s["top_k"]).to(device, torch.bfloat16)
    x = torch.randn(s["tokens"], s["dim"], device=device, dtype=torch.bfloat16)
    balanced_routing_(base, x)
    grad = torch.randn_like(x)
    rows, records = [], []
    from torchao.quantization import quantize_

    from moe_quant import MXFP8MoEConfig

    for mode, cf in (("synced", None), ("sync_free", args.capacity_factor)):
        for exec_ in args.execs:
            if exec_ == "cudagraph" and (mode == "synced" or not cuda):
                rows.append([mode, exec_, "n/a", "n/a", "n/a",
                             "host read inside the step" if mode == "synced" else "CUDA only"])
                continue
            torch._dynamo.reset()
            model = EPMoE.from_moe(base, capacity_factor=cf, max_tokens=None if cf is None else s["tokens"])
            quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
            model.dispatcher.handshake(device)
            xi = x.clone().requires_grad_()
            if exec_ == "cudagraph":
                # a replay allocates nothing: what the graph holds is its private pool, made while the eager
                # warm-up steps and the capture ran, so the peak is taken over those
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                step = _make_step(model, xi, grad, exec_)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - before
                ms, host_ms = _measure(step, device, args.iters)
            else:
                step = _make_step(model, xi, grad, exec_)
                ms, host_ms = _measure(step, device, args.iters)
                peak = peak_memory_bytes(step, device)
            dropped = model.dispatcher.check_overflow() if cf is not None else 0
            rec = {"mode": mode, "exec": exec_, "ms": ms, "host_ms": host_ms,
                   "peak_mib": None if peak is None else peak / 2**20, "dropped": dropped}
            records.append(rec)
            rows.append([mode, exec_, f"{ms:.2f}", f"{host_ms:.2f}",
                         "" if peak is None else f"{peak / 2**20:,.0f}", ""])
            del model, step
    title = (f"EP block fwd+bwd, world size 1, {device_name() if cuda else 'cpu'}, torch {torch.__version__}: "
             f"D {s['dim']}, expert hidden {s['hidden']}, {s['experts']} experts, top-{s['top_k']}, "
             f"{s['tokens']} tokens, capacity factor {args.capacity_factor}")
    print_table(title, ["mode", "exec", "ms/step", "host ms/step", "peak MiB", "note"], rows)
    result = {"sizes": s, "capacity_factor": args.capacity_factor, "device": device_name() if cuda else "cpu",
              "torch": torch.__version__, "runs": records}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.destroy_process_group()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda([])
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
