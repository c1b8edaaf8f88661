"""Experts as a list of per-expert modules, fwd+bwd: the loop converted (each expert's nn.Linear layers an MXFP8 GEMM
of one group) against the same loop in bf16 and against the same experts stacked (bf16, and converted: the fused
block); ratios to the stacked bf16 block taken in interleaved rounds, and peak memory.

    python -m benchmarks.bench_per_expert [--shapes dsv3,qwen3] [--m 16384] [--experts 8] [--rounds 5]
        [--variants bf16,fused,loop-bf16,loop] [--json PATH] [--device cpu --tiny]

The experts are SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up ``(H, D)``, down ``(D, H)``, no bias. The loop
is what a ``nn.ModuleList`` of such experts runs: the tokens, sorted by expert, split into the experts' groups (equal
sizes here, known on the host), each expert on its group, the outputs concatenated. ``loop`` is that ModuleList
converted with ``moe_quant.convert`` (3 E single-group MXFP8 GEMMs forward, 6 E backward, each with its own
quantization passes); ``fused`` is the stacked experts' converted path (``mxfp8_swiglu_experts``). Shapes as in
``benchmarks.bench_block`` (``dsv3`` D = 7168, H = 2048; ``llama4`` D = 5120, H = 8192; ``qwen3`` D = 2048, H = 768,
Qwen3-30B-A3B's experts, meant with ``--experts 128``). Each round times every variant once (``do_bench`` median);
the table shows the median over rounds, the ratio to ``bf16`` (median of the per-round ratios) and, for ``loop``,
its ratio to ``loop-bf16``. ``--device cpu --tiny`` is a smoke run of every path (timings meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_block import SHAPES, TINY_SHAPES, add_common_arguments, bf16_block, make_inputs
from benchmarks.timing import bench_ms, device_name, peak_memory_bytes, print_table, prog_name, write_json
from moe_quant import cli, convert, mxfp8_swiglu_experts

GIB = 1 << 30
VARIANTS = ("bf16", "fused", "loop-bf16", "loop")


class Expert(nn.Module):
    """One SwiGLU expert of three nn.Linear layers holding copies of ``w1``, ``w3``, ``w2`` (``(out, in)`` each)."""

    def __init__(self, w1, w3, w2):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta") for w in (w1, w3, w2))
        for lin, w in ((self.gate, w1), (self.up, w3), (self.down, w2)):
            lin.weight = nn.Parameter(w.detach().clone())

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def loop_experts(w1, w3, w2, converted: bool) -> nn.ModuleList:
    """The stacked weights as a ModuleList of experts (copies), converted to MXFP8 or not."""
    experts = nn.ModuleList(Expert(w1[e], w3[e], w2[e]) for e in range(w1.shape[0]))
    if converted:
        convert(experts, filter_fn=lambda mod, fqn: fqn == "")
    return experts


def forward_fn(variant, x, w1, w3, w2, offs):
    """``(forward, params)``: the forward of ``variant`` on these inputs (equal groups) and the parameters it trains."""
    if variant in ("loop-bf16", "loop"):
        experts = loop_experts(w1, w3, w2, converted=variant == "loop")
        group = x.shape[0] // w1.shape[0]

        def forward():
            return torch.cat([expert(chunk) for expert, chunk in zip(experts, x.split(group))])

        return forward, list(experts.parameters())
    fn = bf16_block if variant == "bf16" else mxfp8_swiglu_experts
    return (lambda: fn(x, w1, w3, w2, offs)), [w1, w3, w2]


def step_fn(variant, x, w1, w3, w2, offs, gy):
    """One fwd+bwd of ``variant``, gradients dropped after it."""
    forward, params = forward_fn(variant, x, w1, w3, w2, offs)

    def step():
        forward().backward(gy)
        for t in (x, *params):
            t.grad = None

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    add_common_arguments(p, ["dsv3", "qwen3"], "16384")
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=list(VARIANTS))
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms_list = args.m or ([256] if args.tiny else [16384])
    e = args.experts
    results, rows = [], []
    for shape in args.shapes:
        d, h = shapes[shape]
        for m in ms_list:
            m = m // (8 * e) * (8 * e)  # even groups, each a multiple of 8
            x, w1, w3, w2, offs, gy, _ = make_inputs(m, d, h, e, device)
            steps = {v: step_fn(v, x, w1, w3, w2, offs, gy) for v in args.variants}
            times = {v: [] for v in steps}
            for _ in range(args.rounds):
                for v, fn in steps.items():
                    times[v].append(bench_ms(fn, device))
            peaks = {v: peak_memory_bytes(fn, device) for v, fn in steps.items()}

            def ratio(v, base):
                return statistics.median(t / b for t, b in zip(times[v], times[base])) if base in times else None

            for v in steps:
                rec = dict(shape=shape, m=m, d=d, h=h, experts=e, variant=v, ms=statistics.median(times[v]),
                           ms_rounds=times[v], ratio_to_bf16=ratio(v, "bf16"),
                           ratio_to_loop_bf16=ratio(v, "loop-bf16") if v == "loop" else None, peak_bytes=peaks[v])
                results.append(rec)
                rows.append([shape, m, v, rec["ms"]] + ["-" if r is None else f"{r:.3f}x" for r in
                                                        (rec["ratio_to_bf16"], rec["ratio_to_loop_bf16"])]
                            + ["-" if peaks[v] is None else f"{peaks[v] / GIB:.2f}"])
            del x, w1, w3, w2, offs, gy, steps
    print_table(f"SwiGLU experts fwd+bwd, stacked and as a per-expert loop, on "
                f"{device_name() if device.type == 'cuda' else 'cpu'} ({args.rounds} interleaved rounds, E={e})",
                ["shape", "M", "variant", "ms", "vs bf16", "vs loop-bf16", "peak GiB"], rows)
    write_json(args.json, dict(device=device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                               results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
