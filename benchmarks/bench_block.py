"""The SwiGLU expert block fwd+bwd: bf16 vs unfused MXFP8 (three ``mxfp8_grouped_mm`` calls) vs fused MXFP8
(``mxfp8_swiglu_experts``), each MXFP8 path also with its weights quantized once per optimizer step
(``+reuse``), eager and compiled, ratios to bf16 taken in interleaved rounds, and memory: the peak of a step and
what the forward keeps for the backward.

    python -m benchmarks.bench_block [--shapes dsv3,llama4,ds16b] [--m 16384,131072] [--experts 8] [--rounds 5]
        [--variants bf16,unfused,fused,unfused+reuse,fused+reuse,bf16-w13,unfused-w13,fused-w13,fused-w13+reuse]
        [--modes eager,compiled] [--x routed|held] [--micro-batches 4] [--json PATH]
        [--device cpu --tiny]

``bf16-w13``, ``unfused-w13`` (``swiglu_experts_w13_unfused``: transformers' experts converted per GEMM),
``fused-w13`` (``mxfp8_swiglu_experts_w13``) and ``fused-w13+reuse`` are the same block with the gate and up
weights one ``(E, 2H, D)`` weight (transformers' experts); their ratio is to ``bf16-w13``. ``fused+reuse-fp8`` and
``fused+reuse-bf16`` (not in the default list): the reuse scope with ``hold="fp8"`` (both weight operands of the
emulated GEMM in fp8, dequantized per GEMM) or ``hold="bf16"`` (both as bf16 values) instead of its default
(``"bf16-fwd"``: the forward operand as bf16 values, the dgrad operand made at each backward). ``fused-fp8cols``
and ``fused-w13-fp8cols`` (not in the default list): the fused block with ``dswiglu_cols_fp8=True`` (grad_a's and
grad_b's colwise forms made in fp8 and scales, each dequantized just before its weight gradient's GEMM; the default
keeps them in bf16 from dSwiGLU on).

Shapes: ``dsv3`` D = 7168, H = 2048 (w1/w3 ``(E, 2048, 7168)``, i.e. w13 ``(E, 4096, 7168)``; w2
``(E, 7168, 2048)``); ``llama4`` D = 5120, H = 8192; ``qwen3`` D = 2048, H = 768 (Qwen3-30B-A3B's experts, with
``--experts 128``); ``ds16b`` D = 2048, H = 1408 (DeepSeek-V3 16B's, torchtitan's trainer; ``--experts 64``).
Tokens split evenly over the experts (bf16's grouped GEMM backward wants groups that are multiples of 8). One
step: ``y = block(x, w1, w3, w2, offs)``, ``y.backward(grad)``, gradients dropped. ``--x routed`` (default): the
block gets a fresh copy of x each step, which only the block holds (as every MoE's experts get the gather of its
tokens), so what a variant keeps of x is counted; ``--x held``: x itself, which the caller holds anyway.
``--modes compiled``: the block function under ``torch.compile(fullgraph=True)`` (not the ``+reuse`` variants:
a scope never serves a compiled graph). Each round times every variant once (``do_bench`` median), so
clock and thermal drift hit all variants alike; the table shows the median over rounds, the ratio to
bf16 in the same mode (median of the per-round ratios), the peak memory one step allocates above its inputs
and what stays allocated from its forward to its backward besides the output (``kept``).
A ``+reuse`` step is ``--micro-batches`` such fwd+bwd passes inside one
:func:`moe_quant.reuse_quantized_weights` scope (the weights quantized on the first, reused by the others;
gradients dropped after each pass as in the other variants): its ms is per micro-batch, the step's time
divided by their number, so it compares with the others' one pass.
``--device cpu --tiny`` is a smoke run of every path (timings meaningless).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.timing import bench_ms, device_name, peak_memory_bytes, print_table, prog_name, write_json
from moe_quant import (cli, mxfp8_swiglu_experts, mxfp8_swiglu_experts_w13, reuse_quantized_weights, swiglu_experts_unfused,
                       swiglu_experts_w13_unfused)

SHAPES = {"dsv3": (7168, 2048), "llama4": (5120, 8192), "qwen3": (2048, 768), "ds16b": (2048, 1408)}  # (D, H)
TINY_SHAPES = {"dsv3": (256, 64), "llama4": (128, 256), "qwen3": (64, 96), "ds16b": (64, 64)}
GIB = 1 << 30


def bf16_block(x, w1, w3, w2, offs):
    """The plain block (moe_quant.moe.GroupedExperts' computation)."""
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def bf16_block_w13(x, w13, w2, offs):
    """The plain block over concatenated gate and up weights (transformers' experts' computation)."""
    gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


VARIANTS = {"bf16": bf16_block, "unfused": swiglu_experts_unfused, "fused": mxfp8_swiglu_experts,
            "unfused+reuse": swiglu_experts_unfused, "fused+reuse": mxfp8_swiglu_experts,
            # the same block with w13 = [w1; w3] one (E, 2H, D) weight; compared with bf16-w13
            "bf16-w13": bf16_block_w13, "unfused-w13": swiglu_experts_w13_unfused, "fused-w13": mxfp8_swiglu_experts_w13,
            "fused-w13+reuse": mxfp8_swiglu_experts_w13, "fused+reuse-fp8": mxfp8_swiglu_experts,
            "fused+reuse-bf16": mxfp8_swiglu_experts,
            "fused-fp8cols": functools.partial(mxfp8_swiglu_experts, dswiglu_cols_fp8=True),
            "fused-w13-fp8cols": functools.partial(mxfp8_swiglu_experts_w13, dswiglu_cols_fp8=True)}
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in ("fused+reuse-fp8", "fused+reuse-bf16", "fused-fp8cols",
                                                     "fused-w13-fp8cols")]
MODES = ("eager", "compiled")


class Routed(torch.autograd.Function):
    """A fresh copy of x that only the block holds (a MoE's gather of its tokens); its backward hands the gradient
    on without a pass."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def hold_of(variant: str) -> str | None:
    """The reuse scope's ``hold`` a ``+reuse`` variant names (None: the scope's default)."""
    return next((h for h in ("fp8", "bf16") if variant.endswith("+reuse-" + h)), None)


def baseline_of(variant: str) -> str:
    return "bf16-w13" if "w13" in variant else "bf16"


def make_inputs(m, d, h, e, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, d, device=device, generator=g).bfloat16().requires_grad_()
    w1, w3 = ((torch.randn(e, h, d, device=device, generator=g) * d**-0.5).bfloat16().requires_grad_()
              for _ in range(2))
    w2 = (torch.randn(e, d, h, device=device, generator=g) * h**-0.5).bfloat16().requires_grad_()
    offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * (m // e)
    gy = torch.randn(m, d, device=device, generator=g).bfloat16()
    w13 = torch.cat([w1, w3], dim=1).detach().requires_grad_()
    return x, w1, w3, w2, offs, gy, w13


def step_fn(fn, x, w1, w3, w2, offs, gy, w13, micro_batches: int = 1, concatenated: bool = False,
            routed: bool = False, hold: str | None = None):
    """One fwd+bwd; with ``micro_batches`` > 1 that many inside one reuse scope (weights quantized once, held as
    ``hold``; None: the scope's default). ``concatenated``: ``fn(x, w13, w2, offs)``; ``routed``: the block gets :class:`Routed` x."""
    weights = (w13, w2) if concatenated else (w1, w3, w2)

    def one():
        y = fn(Routed.apply(x) if routed else x, *weights, offs)
        y.backward(gy)
        for t in (x, *weights):
            t.grad = None

    if micro_batches == 1:
        return one

    def step():
        with (reuse_quantized_weights(weights) if hold is None else reuse_quantized_weights(weights, hold=hold)):
            for _ in range(micro_batches):
                one()

    return step


def kept_bytes(fn, x, w1, w3, w2, offs, gy, w13, concatenated: bool = False, routed: bool = False, device="cuda"):
    """CUDA bytes a forward leaves allocated for its backward besides its output (None on other devices)."""
    if torch.device(device).type != "cuda":
        return None
    weights = (w13, w2) if concatenated else (w1, w3, w2)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    y = fn(Routed.apply(x) if routed else x, *weights, offs)
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - y.untyped_storage().nbytes()
    del y
    return kept


def micro_batches_of(variant: str, micro_batches: int) -> int:
    return micro_batches if "+reuse" in variant else 1


def compiled(fn):
    """The block function as ``torch.compile(fullgraph=True)`` traces it (inductor on CUDA, aot_eager elsewhere)."""
    return torch.compile(fn, fullgraph=True, backend="inductor" if torch.cuda.is_available() else "aot_eager")


def add_common_arguments(p: argparse.ArgumentParser, shapes: list[str], m: str) -> None:
    """The options this benchmark shares with ``benchmarks.bench_per_expert``: ``--shapes`` (default ``shapes``),
    ``--m`` (its default, ``m``, for the help), ``--experts``, ``--rounds``, ``--json``, ``--device``, ``--tiny``."""
    p.add_argument("--shapes", type=cli.comma_choices(*SHAPES), default=shapes)
    p.add_argument("--m", type=cli.positive_int_list, default=None, help=f"tokens per step (default {m})")
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument("--rounds", type=cli.positive_int, default=5, help="interleaved rounds")
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (smoke runs)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    add_common_arguments(p, ["dsv3", "llama4"], "16384,131072")
    p.add_argument("--variants", type=cli.comma_choices(*VARIANTS), default=DEFAULT_VARIANTS)
    p.add_argument("--modes", type=cli.comma_choices(*MODES), default=["eager"],
                   help="eager and/or compiled (torch.compile(fullgraph=True) of the block; not the +reuse variants)")
    p.add_argument("--x", choices=["routed", "held"], default="routed",
                   help="routed: a fresh copy of x each step that only the block holds (as in a MoE); held: x itself")
    p.add_argument("--micro-batches", type=cli.positive_int, default=4,
                   help="fwd+bwd passes per step of the +reuse variants (weights quantized once per step)")
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms_list = args.m or ([256, 512] if args.tiny else [16384, 131072])
    e, routed = args.experts, args.x == "routed"
    runs = [(v, mode) for mode in args.modes for v in args.variants if mode == "eager" or "+reuse" not in v]
    results, rows = [], []
    for shape in args.shapes:
        d, h = shapes[shape]
        for m in ms_list:
            m = m // (8 * e) * (8 * e)  # even groups, each a multiple of 8
            inputs = make_inputs(m, d, h, e, device)
            mbs = {v: micro_batches_of(v, args.micro_batches) for v, _ in runs}
            fns = {(v, mode): VARIANTS[v] if mode == "eager" else compiled(VARIANTS[v]) for v, mode in runs}
            steps = {(v, mode): step_fn(fns[v, mode], *inputs, micro_batches=mbs[v], concatenated="w13" in v,
                                        routed=routed, hold=hold_of(v))
                     for v, mode in runs}
            times = {r: [] for r in steps}
            for _ in range(args.rounds):
                for r, fn in steps.items():
                    times[r].append(bench_ms(fn, device) / mbs[r[0]])  # per micro-batch
            peaks = {r: peak_memory_bytes(fn, device) for r, fn in steps.items()}
            kept = {(v, mode): None if mbs[v] > 1 else kept_bytes(fns[v, mode], *inputs, concatenated="w13" in v,
                                                                  routed=routed, device=device)
                    for v, mode in runs}
            for v, mode in steps:
                base = times.get((baseline_of(v), mode))
                ratios = [t / b for t, b in zip(times[v, mode], base)] if base else []
                rec = dict(shape=shape, m=m, d=d, h=h, experts=e, variant=v, mode=mode, x=args.x,
                           micro_batches=mbs[v], ms=statistics.median(times[v, mode]), ms_rounds=times[v, mode],
                           ratio_to_bf16=statistics.median(ratios) if ratios else None, peak_bytes=peaks[v, mode],
                           kept_bytes=kept[v, mode])
                results.append(rec)
                gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
                rows.append([shape, m, v, mode, rec["ms"],
                             "-" if rec["ratio_to_bf16"] is None else f"{rec['ratio_to_bf16']:.3f}x",
                             gib(peaks[v, mode]), gib(kept[v, mode])])
            del inputs, steps, fns
    print_table(f"SwiGLU expert block fwd+bwd on {device_name() if device.type == 'cuda' else 'cpu'} "
                f"({args.rounds} interleaved rounds, E={e}, x {args.x}; peak: above the inputs, kept: from forward "
                f"to backward besides the output)",
                ["shape", "M", "variant", "mode", "ms", "vs bf16", "peak GiB", "kept GiB"], rows)
    write_json(args.json, dict(device=device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                               results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
