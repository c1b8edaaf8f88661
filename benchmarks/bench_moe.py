"""A whole MoE block, fwd + bwd: bf16 vs the same block converted for MXFP8 training with
``quantize_(model, MXFP8MoEConfig(), filter_fn=...)``, each in eager and under ``torch.compile``.

    python -m benchmarks.bench_moe [--tokens 16384,65536] [--dim 7168 --hidden 2048 --experts 8 --top-k 2]
        [--routing balanced|router] [--no-compile] [--fullgraph] [--compile-mode MODE] [--json PATH]
        [--device cpu --tiny]

The block is ``moe_quant.moe.MoE`` (torchtitan-shaped: router, top-k, token permutation, SwiGLU
experts with three grouped GEMMs, un-permutation), at DeepSeek-V3 expert sizes by default. One
step is ``out = model(x); out.backward(grad)`` with ``x`` requiring grad, then every ``.grad`` set
to None (the gradients are allocated each step, as after ``zero_grad()``); no optimizer step,
so the routing is the same every step. Prints ms per step, tokens/s, ratio to bf16 (same mode and
eager), model TFLOP/s and the peak memory above the inputs (model, x and grad already allocated).

Routing. PyTorch's bf16 grouped GEMM backward needs token groups that are multiples of 8 on the
GPU (a device-side assert otherwise, which ends the process), and the block does not pad its
groups. ``--routing balanced`` (default) therefore sets the router's gate to read the first E
features of x and writes those features so that token t picks experts t, t+1, ..., t+k-1 (mod E):
every expert gets T*k/E tokens, through the real router, top-k and permutation. ``--routing
router`` keeps the gate's random init and random x (uneven groups); the bf16 rows are skipped on
CUDA when a group is not a multiple of 8, with the reason printed. MXFP8 takes any group sizes.

``torch.compile`` failures (first call) are caught: the row shows the one-line reason and the
benchmark goes on. ``--device cpu --tiny`` is a smoke run of every path (timings meaningless).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import traceback

import torch

from benchmarks.timing import bench_ms, device_name, peak_memory_bytes, print_table, prog_name
from moe_quant import cli
from moe_quant.conversion import MXFP8MoEConfig, fallback_counts, is_converted, reset_fallback_counts
from moe_quant.moe import MoE

FULL = dict(dim=7168, hidden=2048, experts=8, top_k=2, tokens="16384,65536")
TINY = dict(dim=256, hidden=128, experts=8, top_k=2, tokens="256,512")
BF16_GROUP_ALIGN = 8
GIB = 1 << 30


def one_line(e: BaseException, limit: int = 110) -> str:
    msg = str(e).strip()
    text = f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def balanced_routing_(moe: MoE, x: torch.Tensor) -> None:
    """In place: gate row e = one-hot(e) on the first E features; x[t, (t + j) % E] = 2 (k - j) for
    j < k, the other first E features 0. Token t's logits are then those features, so its top-k
    experts are t, ..., t+k-1 (mod E), distinct scores, no ties."""
    e, k = moe.router.num_experts, moe.top_k
    if x.shape[1] < e:
        raise SystemExit(f"--routing balanced needs dim >= experts, got dim={x.shape[1]}, experts={e}")
    with torch.no_grad():
        w = moe.router.gate.weight
        w.zero_()
        w[:, :e] = torch.eye(e, dtype=w.dtype, device=w.device)
        x[:, :e] = 0
        t = torch.arange(x.shape[0], device=x.device)
        for j in range(k):
            x[t, (t + j) % e] = 2.0 * (k - j)


def model_flops(tokens: int, dim: int, hidden: int, experts: int, top_k: int) -> float:
    """fwd+bwd FLOPs: 3 expert GEMMs x (fwd, dgrad, wgrad) over tokens*top_k rows, plus the gate."""
    return 18.0 * tokens * top_k * dim * hidden + 6.0 * tokens * dim * experts


def main():
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=cli.positive_int_list, default=None,
                   help=f"comma list of token counts (default {FULL['tokens']})")
    p.add_argument("--dim", type=cli.positive_int, default=None)
    p.add_argument("--hidden", type=cli.positive_int, default=None, help="expert hidden size")
    p.add_argument("--experts", type=cli.positive_int, default=None)
    p.add_argument("--top-k", type=cli.positive_int, default=None)
    p.add_argument("--routing", choices=("balanced", "router"), default="balanced")
    p.add_argument("--variants", type=cli.comma_choices("bf16", "mxfp8"), default=["bf16", "mxfp8"],
                   help="comma list of bf16, mxfp8")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--json", type=cli.writable_file, default=None, help="write every measured number to this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"small sizes {TINY} for smoke runs")
    args = p.parse_args()
    cli.exit_unless_device_runs(p, args.device)  # one line and exit status 2 (no GPU: CPU smoke runs pass --device cpu)
    sizes = TINY if args.tiny else FULL
    experts, top_k = args.experts or sizes["experts"], args.top_k or sizes["top_k"]
    if top_k > experts:
        p.error(f"--top-k ({top_k}) must not exceed --experts ({experts})")
    dim = args.dim or sizes["dim"]
    if args.routing == "balanced" and dim < experts:
        p.error(f"--routing balanced needs dim >= experts, got dim={dim}, experts={experts}")
    run(args)


def run(args):
    sizes = TINY if args.tiny else FULL
    dim = args.dim or sizes["dim"]
    hidden = args.hidden or sizes["hidden"]
    experts = args.experts or sizes["experts"]
    top_k = args.top_k or sizes["top_k"]
    token_counts = args.tokens or [int(v) for v in sizes["tokens"].split(",")]
    variants = args.variants
    modes = ["eager"] + ([] if args.no_compile else ["compile"])
    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    record = {
        "benchmark": "bench_moe",
        "device": device_name() if is_cuda else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": dict(dim=dim, hidden=hidden, experts=experts, top_k=top_k, routing=args.routing,
                       fullgraph=args.fullgraph, compile_mode=args.compile_mode),
        "rows": [],
    }
    print(f"MoE block: dim {dim}, expert hidden {hidden}, {experts} experts, top-{top_k}, bf16, "
          f"routing {args.routing}, device {record['device']}")
    if not is_cuda:
        print(f"NOTE: device {device}: wall-clock timings of a smoke run, no memory measured")

    table = []
    for tokens in token_counts:
        torch.manual_seed(0)
        base = MoE(dim, hidden, experts, top_k).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
        if args.routing == "balanced":
            balanced_routing_(base, x)
        x.requires_grad_()
        grad = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            counts = base.router(x)[2].tolist()  # setup only: the timed steps never read it
        print(f"tokens {tokens}: tokens per expert {counts}")
        models = {}
        if "bf16" in variants:
            models["bf16"] = base
        if "mxfp8" in variants:
            from torchao.quantization import quantize_

            mx = copy.deepcopy(base)
            quantize_(mx, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
            converted = is_converted(mx.experts)
            if not converted:
                print("WARNING: quantize_ did not convert the expert weights; the mxfp8 rows are bf16")
            models["mxfp8"] = mx
        skip_bf16 = None
        if is_cuda and any(c % BF16_GROUP_ALIGN for c in counts):
            skip_bf16 = (f"skipped: a token group is not a multiple of {BF16_GROUP_ALIGN} "
                         "(bf16 grouped-mm backward would device-assert)")
        flops = model_flops(tokens, dim, hidden, experts, top_k)

        results = {}
        for name, model in models.items():
            params = list(model.parameters())
            reset_fallback_counts()
            for mode in modes:
                res = {"ms": None, "peak_bytes": None, "error": None}
                results[(name, mode)] = res
                if name == "bf16" and skip_bf16:
                    res["error"] = skip_bf16
                    continue
                try:
                    if mode == "compile":
                        torch._dynamo.reset()
                        fn = torch.compile(model, dynamic=False, fullgraph=args.fullgraph, mode=args.compile_mode)
                    else:
                        fn = model

                    def step(fn=fn, params=params):
                        out = fn(x)
                        out.backward(grad)
                        for prm in params:
                            prm.grad = None
                        x.grad = None

                    step()  # first call: torch.compile, kernel compilation
                    step()
                    res["ms"] = bench_ms(step, device, warmup_ms=100, rep_ms=500)
                    res["peak_bytes"] = peak_memory_bytes(step, device)
                except Exception as e:  # noqa: BLE001 -- a failing compile: report it and go on
                    res["error"] = ("compile failed: " if mode == "compile" else "failed: ") + one_line(e)
                    print(f"tokens {tokens} {name} {mode}: {res['error']}")
                    traceback.print_exc()
                    for prm in params:
                        prm.grad = None
                    x.grad = None
                    if is_cuda:
                        torch.cuda.empty_cache()
            if name == "mxfp8" and fallback_counts():
                for mode in modes:  # the rows did not all run in MXFP8
                    r = results[(name, mode)]
                    r["error"] = ((r["error"] + "; ") if r["error"] else "") + f"fallbacks {fallback_counts()}"

        for (name, mode), res in results.items():
            ms = res["ms"]
            same = results.get(("bf16", mode), {}).get("ms")
            eager = results.get(("bf16", "eager"), {}).get("ms")
            row = {
                "tokens": tokens, "model": name, "mode": mode, "ms": ms,
                "tokens_per_s": tokens / (ms / 1e3) if ms else None,
                "x_bf16_same_mode": ms / same if ms and same else None,
                "x_bf16_eager": ms / eager if ms and eager else None,
                "tflops": flops / (ms / 1e3) / 1e12 if ms else None,
                "peak_gib": res["peak_bytes"] / GIB if res["peak_bytes"] is not None else None,
                "tokens_per_expert": counts, "error": res["error"],
            }
            record["rows"].append(row)
            nan = float("nan")
            table.append([tokens, name, mode, ms if ms else "-", row["tokens_per_s"] or nan,
                          row["x_bf16_same_mode"] or nan, row["x_bf16_eager"] or nan, row["tflops"] or nan,
                          row["peak_gib"] if row["peak_gib"] is not None else nan, res["error"] or ""])
        del base, models, x, grad
        if is_cuda:
            torch.cuda.empty_cache()
        if len(token_counts) > 1:  # progress, in case a later token count does not finish
            print_table(f"\ntokens {tokens} done", HEADER, [r for r in table if r[0] == tokens])
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(record, fh, indent=1)

    print_table(
        f"\nMoE block fwd+bwd on {record['device']} ({'do_bench median' if is_cuda else 'wall-clock median, smoke run'}); "
        "mxfp8 = quantize_(MXFP8MoEConfig()) on the experts",
        HEADER,
        table,
    )
    if args.json:
        print(f"wrote {args.json}")


HEADER = ["tokens", "model", "mode", "ms/step", "tokens/s", "x bf16 same mode", "x bf16 eager", "TFLOP/s",
          "peak GiB over inputs", "note"]


if __name__ == "__main__":
    main()
