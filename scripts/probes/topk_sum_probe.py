"""The combine's top-k sum on one GPU: ``moe_quant.routing.sum_topk_rows`` (a gather and K elementwise fp32 adds:
the CPU's bits, every run) against ``Tensor.scatter_add`` (atomics: order-dependent bits for top-k > 2) and
torchtitan's deterministic ``scatter_add`` (where torchtitan is installed), inside ``unsort_tokens`` forward and
backward.

    python scripts/probes/topk_sum_probe.py [--tokens 16384] [--dims 2048,7168] [--top-k 2,6,8]

GPU only (one line and exit status 2 elsewhere). Prints µs per forward + backward (``do_bench``, median), whether
five runs gave the same bits, and whether the output equals the CPU's (its first 1024 tokens). About a minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.timing import bench_us, device_name, print_table, require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402


def _sums():
    out = {"sum_topk_rows": None, "Tensor.scatter_add": lambda o, i, s: o.scatter_add(0, i, s)}
    try:
        from torchtitan.ops.scatter_add import deterministic_scatter_add

        out["torchtitan deterministic"] = deterministic_scatter_add
    except ImportError:
        pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/probes/topk_sum_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=cli.positive_int, default=16384)
    p.add_argument("--dims", type=cli.positive_int_list, default=[2048, 7168])
    p.add_argument("--top-k", type=cli.positive_int_list, default=[2, 6, 8])
    args = p.parse_args(argv)
    require_cuda(argv)
    from moe_quant.routing import sort_tokens_by_expert, unsort_tokens

    rows = []
    for d in args.dims:
        for k in args.top_k:
            g = torch.Generator(device="cuda").manual_seed(k)
            t, e = args.tokens, 64
            x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
            scores, ids = torch.topk(torch.randn(t, e, device="cuda", generator=g).softmax(-1), k, dim=-1)
            grad = torch.randn(t, d, device="cuda", generator=g).bfloat16()
            x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores, ids)
            routed = x_sorted.detach().requires_grad_()

            def step(scatter_add, routed=routed, scores_sorted=scores_sorted, token_idx=token_idx, x=x, grad=grad):
                out = unsort_tokens(routed, scores_sorted, token_idx, x, scatter_add=scatter_add)
                return out.detach(), torch.autograd.grad(out, routed, grad)[0]

            n = min(t, 1024)  # the CPU's bits for the first n tokens (a token's sum reads its own rows only)
            keep = token_idx < n
            with torch.no_grad():
                ref_cpu = unsort_tokens(routed.detach()[keep].cpu(), scores_sorted[keep].cpu(), token_idx[keep].cpu(),
                                        x[:n].cpu())
            for name, fn in _sums().items():
                first = step(fn)
                same = all(torch.equal(a, b) for _ in range(4) for a, b in zip(step(fn), first))
                us = bench_us(lambda fn=fn: step(fn))
                rows.append([d, k, name, f"{us:.0f}", same, torch.equal(first[0][:n].cpu(), ref_cpu)])
    print_table(f"top-k sum in the combine, {args.tokens} tokens, bf16, forward + backward, {device_name()}",
                ["D", "top-k", "sum", "us", "same bits 5 runs", "output == CPU"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
