"""Expert-parallel MoE block against the single-process converted block: ``torchrun --nproc_per_node N
scripts/ep_check.py [--device cuda|cpu] [--transport all_to_all|p2p --chunks C --posting per_block|merged]``.

CUDA (nccl): DeepSeek-V3 expert sizes by default (hidden 7168, expert hidden 2048, 8 experts per rank,
top-2, 16384 tokens per rank). CPU (gloo): tiny defaults. Every rank runs its shard of
``moe_quant.moe.EPMoE`` (converted, MXFP8 on the wire) forward and backward and the single-process
converted ``MoE`` on all ranks' tokens with the same routing (``moe_quant.ep.check.run_check``);
rank 0 gathers every rank's verdict and prints one line per rank and ``PASS``/``FAIL``: forward output
and input gradient bit-identical, weight-gradient SQNR (vs the single-process MXFP8 block and vs bf16),
wire bytes per token of each leg. Exit status 0 only if every rank passed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_quant.ep import blocks  # noqa: E402
from moe_quant.ep.check import CheckCase, run_check  # noqa: E402

GPU_DEFAULTS = dict(dim=7168, hidden_dim=2048, experts_per_rank=8, top_k=2, tokens=16384)
CPU_DEFAULTS = dict(dim=64, hidden_dim=96, experts_per_rank=2, top_k=2, tokens=40)
MIN_WGRAD_SQNR_DB = 40.0  # RCEIL: the EP weight gradient equals the single-process one but for tiny elements


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    for name in ("dim", "hidden_dim", "experts_per_rank", "top_k", "tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--wire", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--scale-mode", default="rceil", choices=["rceil", "floor"])
    p.add_argument("--routing", default="router", choices=["router", "one_rank"])
    p.add_argument("--transport", default="all_to_all", choices=["all_to_all", "p2p"])
    p.add_argument("--chunks", type=int, default=1, help="ranges of local experts (p2p transport)")
    p.add_argument("--sm-carveout", type=int, default=None, help="SMs the experts' GEMMs leave to the exchange")
    p.add_argument("--posting", default=blocks.POSTINGS[0], choices=blocks.POSTINGS,
                   help="how the p2p transport posts a range (moe_quant.ep.blocks.POSTINGS)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("ep_check: --device cuda needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    sizes = dict(GPU_DEFAULTS if cuda else CPU_DEFAULTS)
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    case = CheckCase(**{**sizes, "tokens": (sizes["tokens"],)}, wire=args.wire, scale_mode=args.scale_mode,
                     routing=args.routing, seed=args.seed, transport=args.transport, chunks=args.chunks,
                     sm_carveout=args.sm_carveout)
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    try:
        with blocks.posting(args.posting):
            result = run_check(case, device=device)
    except Exception as e:  # reported by rank 0 like any other failure
        result = {"rank": dist.get_rank(), "error": f"{type(e).__name__}: {e}"}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    ok_all = True
    if dist.get_rank() == 0:
        print(f"[ep_check] world={len(results)} device={'cuda' if cuda else 'cpu'} {case}")
        for r in results:
            if "error" in r:
                ok_all = False
                print(f"[ep_check] rank {r['rank']} FAIL {r['error']}")
                continue
            wg = {w: (s["vs_mxfp8"], s["vs_bf16"]) for w, s in r["wgrad_sqnr"].items()}
            floor = MIN_WGRAD_SQNR_DB if args.scale_mode == "rceil" else 25.0
            ok = r["routing_equal"] and r["out_equal"] and r["xgrad_equal"] and r["empty_expert_wgrad_zero"] and all(
                v[0] >= floor for v in wg.values())
            ok_all &= ok
            legs = " ".join(f"{leg.replace(' ', '_')}={info['bytes_per_token'] / r['hidden']:.4f}xD"
                            for leg, info in r["legs"].items() if info["rows"])
            wgs = " ".join(f"{w}:{a:.1f}/{b:.1f}dB" if math.isfinite(a) else f"{w}:inf/{b:.1f}dB"
                           for w, (a, b) in wg.items())
            print(f"[ep_check] rank {r['rank']} {'PASS' if ok else 'FAIL'} tokens={r['tokens']} "
                  f"received={r['received_rows']} out_equal={r['out_equal']} xgrad_equal={r['xgrad_equal']} "
                  f"wgrad_sqnr(vs mxfp8/vs bf16) {wgs} out_sqnr_vs_bf16={r['out_sqnr_vs_bf16']:.1f}dB wire {legs}")
        print(f"[ep_check] {'PASS' if ok_all else 'FAIL'} overall")
    flag = torch.tensor([int(ok_all)], device=device)
    dist.broadcast(flag, 0)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
