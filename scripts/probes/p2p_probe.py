"""How fast NCCL moves the same bytes to the other ranks in the forms the EP legs could use, on one machine:

    torchrun --nproc_per_node N scripts/probes/p2p_probe.py [--mb 8,16,32,64] [--iters 10] [--json PATH]
    NCCL_MIN_NCHANNELS=4 NCCL_MAX_NCHANNELS=4 torchrun --nproc_per_node 2 scripts/probes/p2p_probe.py   # a slower wire

Each rank sends ``B`` bytes to every other rank (and keeps ``B`` for itself where the form includes it) as:

* ``a2a``: one ``all_to_all_single`` with uneven splits (this rank's own block 256 bytes longer), as the
  all-to-all transport's legs;
* ``a2a_list``: ``all_to_all`` over a list of per-rank tensors;
* ``p2p_1``: one ``batch_isend_irecv`` of one send and one receive per peer;
* ``p2p_k``: the same bytes as ``k`` sends and ``k`` receives per peer (contiguous slices of one buffer; what
  the point-to-point transport posts for ``k`` (expert, tensor) blocks of one range);
* ``p2p_2+s``: two data slices and two small "scale" slices (1/32 of the bytes) per peer, the MXFP8 form of a
  range of two experts.

Times are CUDA events around ``--iters`` back-to-back calls, after a barrier and two warm-up calls, per rank;
the table shows rank 0's ms per call and GB/s (bytes sent to the other ranks / time, the leg-alone figure of
``benchmarks.bench_ep``). Forms are interleaved over ``--rounds`` rounds; the median round is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.timing import call_ms  # noqa: E402
from moe_quant import cli  # noqa: E402

FORMS = ("a2a", "a2a_list", "p2p_1", "p2p_2", "p2p_4", "p2p_2+s")


def _mb_list(text: str) -> list[float]:
    """``type=`` for ``--mb``: a comma list of sizes in MB, each at least 1."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(1 <= v < 1e6 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of sizes in MB, each at least 1, got {text!r}")
    return values


def _split(n: int, k: int) -> list[int]:
    return [n * (i + 1) // k - n * i // k for i in range(k)]


def _p2p(send: torch.Tensor, recv: torch.Tensor, peers: list[int], nbytes: int, pieces: list[int]) -> list:
    """Ops moving ``nbytes`` to each peer as the given pieces (byte counts summing to nbytes), slices of the
    peer's block of ``send`` / ``recv``."""
    ops = []
    for p in peers:
        at = p * nbytes
        for n in pieces:
            ops.append(dist.P2POp(dist.isend, send[at:at + n], p))
            ops.append(dist.P2POp(dist.irecv, recv[at:at + n], p))
            at += n
    return ops


def make(form: str, nbytes: int, world: int, rank: int, dev) -> callable:
    send = torch.empty(world * nbytes + 256, dtype=torch.uint8, device=dev).random_(0, 255)
    recv = torch.empty_like(send)
    peers = [p for p in range(world) if p != rank]
    if form == "a2a":
        splits = [nbytes + 256 * (p == rank) for p in range(world)]
        s, r = send[:sum(splits)], recv[:sum(splits)]
        return lambda: dist.all_to_all_single(r, s, splits, splits)
    if form == "a2a_list":
        ins = [send[p * nbytes:(p + 1) * nbytes] for p in range(world)]
        outs = [recv[p * nbytes:(p + 1) * nbytes] for p in range(world)]
        return lambda: dist.all_to_all(outs, ins)
    if form.startswith("p2p_"):
        k = form[4:]
        if k == "2+s":
            small = nbytes // 33  # scales: 1/32 of the data
            pieces = _split(nbytes - 2 * small, 2) + [small, small]
        else:
            pieces = _split(nbytes, int(k))

        def run():
            for w in dist.batch_isend_irecv(_p2p(send, recv, peers, nbytes, pieces)):
                w.wait()
        return run
    raise ValueError(form)


def timed(fn, iters: int, dev) -> float:
    """ms per call of ``iters`` back-to-back calls of ``fn``, after a barrier."""
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return call_ms(lambda: [fn() for _ in range(iters)], dev) / iters


def main() -> None:
    p = argparse.ArgumentParser(prog="p2p_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=_mb_list, default=[8, 16, 32, 64], help="MB sent to each peer, comma list")
    p.add_argument("--iters", type=cli.positive_int, default=10)
    p.add_argument("--rounds", type=cli.positive_int, default=3)
    p.add_argument("--forms", type=cli.comma_choices(*FORMS), default=list(FORMS))
    p.add_argument("--json", type=cli.writable_file, default=None)
    args = p.parse_args()
    if "RANK" not in os.environ:
        print("p2p_probe.py: run it under torchrun, one process per GPU: torchrun --nproc_per_node N "
              "scripts/probes/p2p_probe.py", file=sys.stderr)
        sys.exit(2)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    forms = args.forms
    sizes = [int(m * 2**20) for m in args.mb]
    fns = {(f, n): make(f, n, world, rank, dev) for f in forms for n in sizes}
    for fn in fns.values():
        fn(), fn()
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(timed(fn, args.iters, dev))
    if rank == 0:
        env = {k: os.environ[k] for k in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_P2P_DISABLE") if k in os.environ}
        name = f"{torch.cuda.get_device_name()}, nccl {'.'.join(map(str, torch.cuda.nccl.version()))}" if cuda else "cpu, gloo"
        print(f"p2p_probe: {name} x {world}, torch {torch.__version__}, {env or 'NCCL defaults'}; rank 0, median of "
              f"{args.rounds} rounds of {args.iters} calls")
        rows = []
        print(f"{'form':>9} " + " ".join(f"{n / 2**20:>7.0f}MB ms  GB/s" for n in sizes))
        for f in forms:
            cells = []
            for n in sizes:
                ms = statistics.median(times[(f, n)])
                gbs = n * (world - 1) / ms / 1e6
                cells.append(f"{ms:>12.3f} {gbs:5.1f}")
                rows.append({"form": f, "bytes_per_peer": n, "ms": ms, "gbps": gbs, "rounds": times[(f, n)]})
            print(f"{f:>9} " + " ".join(cells))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world": world, "env": env, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
