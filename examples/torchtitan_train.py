"""Train torchtitan's DeepSeek-V3 with bf16 experts and with MXFP8 experts, eager and compiled.

    python examples/torchtitan_train.py                      # 16B architecture cut to 4 layers, on CUDA
    python examples/torchtitan_train.py --flavor debugmodel --layers 2 --tokens 256 --seq-len 64 \\
        --steps 3 --device cpu --modes eager                   # a CPU smoke run

Needs torchtitan 0.3.0 (``pip install -e ".[titan]"``). The model is torchtitan's own
(``deepseekv3_configs[flavor]``, first ``--layers`` transformer blocks, no MTP); its routed experts
(``torchtitan.models.common.moe.GroupedExperts``) are converted with::

    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))

Each run starts from the same initial weights (same seed) and sees the same batches: ``--tokens`` per
step as ``tokens / seq_len`` sequences of a synthetic next-token task (each sequence follows
``x[t+1] = (a * x[t] + b) mod vocab`` with its own ``a, b``, so the loss falls). fp32 parameters,
``torch.autocast`` bf16, AdamW. torchtitan's MoE load-balancing bias update (an optimizer hook in
its trainer) is not installed, so the routing bias stays zero in every run.

For each of ``--modes`` (eager, compiled: ``torch.compile`` of each transformer block, as torchtitan
does) it runs bf16 then MXFP8 and prints median step time over the steps after ``--warmup``, the
ratio to bf16, the loss (first, last) and the largest (and the median) relative loss difference to bf16 over all
steps (with both modes, also that measure between the bf16 eager and compiled runs, a noise floor, and between
the MXFP8 eager and compiled runs), peak
CUDA memory, and the grouped-mm calls that fell back to the plain op.

torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks.
For this single-process run (no FSDP) the script puts a placeholder under that name when it is
missing and says so in its output; the placeholder raises if anything tries to use it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# Runnable as `python examples/torchtitan_train.py` from the repository root without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_quant import MXFP8MoEConfig  # noqa: E402  (before torchao: keeps its import quiet)
from moe_quant.conversion import fallback_counts, is_converted, reset_fallback_counts  # noqa: E402
from examples.titan.launch import STUBBED_NAME, stub_missing_fsdp_names  # noqa: E402,F401  (one placeholder for both)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="16B", help="torchtitan DeepSeek-V3 flavor (debugmodel, 16B, ...)")
    p.add_argument("--layers", type=int, default=4, help="keep the first N transformer blocks (default 4)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (default 16384)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default 5)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--attn", default="auto", choices=["auto", "flex", "sdpa"],
                   help="flex (torchtitan's default; backward needs CUDA) or causal sdpa; auto: flex on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--via", default="quantize", choices=["quantize", "converter"],
                   help="convert with quantize_ on the built model, or build it through moe_quant's torchtitan "
                        "model converter (moe_quant.ep.titan.converter_config(): converted experts, moe_quant's "
                        "token dispatcher; EP=1 here)")
    p.add_argument("--per-gemm", action="store_true",
                   help="convert with MXFP8MoEConfig(fused_block=False): the experts as three MXFP8 grouped GEMMs "
                        "instead of the fused SwiGLU block (the same bits; to compare their speed and memory)")
    p.add_argument("--profile", action="store_true",
                   help="after each run's steps, one more step under torch.profiler: its GPU kernel time split into "
                        "moe_quant's kernels, GEMMs and the rest (where an MXFP8 run's extra time goes)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    for name in ("layers", "tokens", "seq_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tokens % args.seq_len:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({args.seq_len})")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("eager", "compiled")]
    if bad or not args.modes:
        p.error(f"--modes takes eager and/or compiled, got {bad or 'nothing'}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    if args.attn == "auto":
        args.attn = "flex" if args.device == "cuda" else "sdpa"
    return args


def model_config(flavor: str, layers: int, attn: str):
    """torchtitan's DeepSeek-V3 config of ``flavor``, cut to its first ``layers`` blocks."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    if flavor not in deepseekv3_configs:
        raise ValueError(f"flavor must be one of {sorted(deepseekv3_configs)}, got {flavor!r}")
    cfg = deepseekv3_configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    if layers > len(cfg.layers):
        raise ValueError(f"layers must be at most {len(cfg.layers)} for {flavor}, got {layers}")
    cfg = dataclasses.replace(cfg, layers=cfg.layers[:layers], mtp_layers=[])
    if attn == "sdpa":
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build_model(cfg, device: str, seed: int, convert: bool, via: str = "quantize", per_gemm: bool = False):
    """The model with its initial weights from ``seed`` (fp32), converted to MXFP8 experts if asked:
    ``via="quantize"``: ``quantize_`` on the built model; ``"converter"``: the config goes through
    moe_quant's torchtitan model converter first (as torchtitan's ``converters=[...]`` does). ``per_gemm``:
    the converted experts re-configured with ``MXFP8MoEConfig(fused_block=False)`` (``quantize_`` again)."""
    from torchao.quantization import quantize_
    from torchtitan.models.common.moe import GroupedExperts

    if convert and via == "converter":
        from moe_quant.ep.titan import converter_config

        cfg = converter_config().build().convert(copy.deepcopy(cfg))
    torch.manual_seed(seed)
    with torch.device(device):
        model = cfg.build()
        model.init_states(buffer_device=torch.device(device))
    if convert and (via == "quantize" or per_gemm):
        quantize_(model, MXFP8MoEConfig(fused_block=not per_gemm),
                  filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    return model


def batches(vocab: int, tokens: int, seq_len: int, steps: int, seed: int):
    """``steps`` (inputs, labels) pairs of the synthetic next-token task, on the CPU."""
    g = torch.Generator().manual_seed(seed + 1)
    n_seq = tokens // seq_len
    out = []
    for _ in range(steps):
        a = torch.randint(1, 8, (n_seq, 1), generator=g)
        b = torch.randint(0, 8, (n_seq, 1), generator=g)
        x = torch.empty(n_seq, seq_len + 1, dtype=torch.long)
        x[:, :1] = torch.randint(0, vocab, (n_seq, 1), generator=g)
        for t in range(seq_len):
            x[:, t + 1: t + 2] = (a * x[:, t: t + 1] + b) % vocab
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train(cfg, args, data, *, convert: bool, compiled: bool) -> dict:
    """One run: returns its losses, step times (s), peak memory and fallbacks."""
    device = args.device
    model = build_model(cfg, device, args.seed, convert, getattr(args, "via", "quantize"), getattr(args, "per_gemm", False))
    converted = sum(p.ndim == 3 for m in model.modules() if is_converted(m) for p in m.parameters())
    if convert and not converted:
        raise RuntimeError("no expert weight was converted")
    if compiled:
        for layer in model.layers.values():
            layer.compile(backend=args.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n_seq = args.tokens // args.seq_len
    positions = torch.arange(args.seq_len, device=device).expand(n_seq, args.seq_len)
    masks = model.get_attention_masks(positions=positions) if args.attn == "flex" else None
    reset_fallback_counts()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    with warnings.catch_warnings():
        # torchtitan's router asks autocast for fp32 (CPU autocast declines and warns) and its RMSNorm
        # gets bf16 input with fp32 weights: both are torchtitan's choices, the same in every run
        warnings.filterwarnings("ignore", message=".*autocast.*", category=UserWarning)
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
        def step(x, y):
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(x, positions, masks)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for x, y in data:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t0 = time.perf_counter()
            loss = step(x, y)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            del loss
        profile = kernel_time_by_kind(lambda: step(x, y)) if getattr(args, "profile", False) and cuda else None
    result = {
        "convert": convert, "compiled": compiled, "losses": losses, "step_s": times,
        "converted_weights": converted, "params": count_params(model),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "fallbacks": sum(fallback_counts().values()), "profile_ms": profile,
    }
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


KERNEL_KINDS = ("moe_quant", "gemm", "other")


def kernel_kind(name: str) -> str:
    """moe_quant's CuTe-DSL kernels (their names carry the package's module path), the GEMMs (cuBLAS' nvjet /
    xmma and CUTLASS grouped and dense GEMMs), or anything else (attention, norms, optimizer, inductor's fused kernels)."""
    if "moe_quant" in name:
        return "moe_quant"
    low = name.lower()
    return "gemm" if any(k in low for k in ("gemm", "xmma", "nvjet", "cutlass")) else "other"


def moe_quant_kernel(name: str) -> str:
    """A moe_quant kernel's class and input dtype from its compiled name (``..._Quantize1x32Kernel_object_at__
    tensorptrf32gmem...`` -> ``Quantize1x32Kernel f32``): with fp32 master weights and bf16 activations, the
    weight passes are the ``f32`` ones."""
    m = re.search(r"([A-Z][A-Za-z0-9]*Kernel)_object_at__tensorptr([a-z0-9]+?)gmem", name)
    return f"{m.group(1)} {m.group(2)}" if m else "other"


def kernel_time_by_kind(step) -> dict:
    """GPU kernel time (ms) of one ``step()`` under torch.profiler, by :func:`kernel_kind`, and the total;
    ``moe_quant_by_kernel``: moe_quant's time by :func:`moe_quant_kernel`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ms = dict.fromkeys(KERNEL_KINDS, 0.0)
    ours: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(ev.name)
            ms[kind] += ev.device_time / 1e3
            if kind == "moe_quant":
                k = moe_quant_kernel(ev.name)
                ours[k] = ours.get(k, 0.0) + ev.device_time / 1e3
    ms["total"] = sum(ms[k] for k in KERNEL_KINDS)
    ms["moe_quant_by_kernel"] = ours
    return ms


def summarize(runs: list[dict], warmup: int) -> list[str]:
    lines = []
    for mode in ("eager", "compiled"):
        pair = {r["convert"]: r for r in runs if r["compiled"] == (mode == "compiled")}
        if not pair:
            continue
        base = statistics.median(pair[False]["step_s"][warmup:])
        for convert, r in sorted(pair.items()):
            med = statistics.median(r["step_s"][warmup:])
            r["median_step_s"] = med
            r["ratio_to_bf16"] = med / base
            ref = pair[False]["losses"]
            rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref)]
            r["max_rel_loss_diff"], r["median_rel_loss_diff"] = max(rel), statistics.median(rel)
            peak = "n/a (CPU)" if r["peak_gib"] is None else f"{r['peak_gib']:.2f} GiB"
            lines.append(
                f"{mode:8s} {'mxfp8' if convert else 'bf16':5s}  step {1e3 * med:9.1f} ms  x{r['ratio_to_bf16']:.3f}  "
                f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  max |dloss|/loss vs bf16 "
                f"{100 * r['max_rel_loss_diff']:.3f}% (median {100 * r['median_rel_loss_diff']:.3f}%)  peak {peak}  "
                f"fallbacks {r['fallbacks']}"
            )
            if r.get("profile_ms"):
                p = r["profile_ms"]
                lines.append(f"{'':15s}profiled step: kernels {p['total']:.1f} ms = moe_quant {p['moe_quant']:.1f} + "
                             f"GEMMs {p['gemm']:.1f} + other {p['other']:.1f}")
                if p.get("moe_quant_by_kernel"):
                    lines.append(f"{'':15s}moe_quant: " + ", ".join(
                        f"{k} {v:.1f}" for k, v in sorted(p["moe_quant_by_kernel"].items(), key=lambda kv: -kv[1])))
    both = {r["compiled"]: r for r in runs if not r["convert"]}
    if len(both) == 2:
        # the same bf16 model, eager vs torch.compile (other fusions, other bf16 roundings): how far two runs
        # of equally valid numerics drift apart on this task, to read the MXFP8-vs-bf16 differences against
        floor = max(abs(a - b) / abs(b) for a, b in zip(both[True]["losses"], both[False]["losses"]))
        lines.append(f"noise floor: bf16 compiled vs bf16 eager, max |dloss|/loss {100 * floor:.3f}%")
    mx = {r["compiled"]: r for r in runs if r["convert"]}
    if len(mx) == 2:
        # the same comparison for the MXFP8 runs: the expert GEMMs' numerics are the same compiled and eager (bit
        # for bit, tested), so this drift should be of the bf16 floor's size; much more points at the compiled graph
        mx_floor = max(abs(a - b) / abs(b) for a, b in zip(mx[True]["losses"], mx[False]["losses"]))
        lines.append(f"mxfp8 compiled vs mxfp8 eager, max |dloss|/loss {100 * mx_floor:.3f}%")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    stubbed = stub_missing_fsdp_names()
    for name in stubbed:
        print(f"note: torch {torch.__version__} lacks {name}; a placeholder stands in for it (single process, no FSDP)")
    import torchtitan  # noqa: F401  (after the stub)

    cfg = model_config(args.flavor, args.layers, args.attn)
    data = batches(cfg.vocab_size, args.tokens, args.seq_len, args.steps, args.seed)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    moe = next(layer.moe for layer in cfg.layers if layer.moe is not None) if any(
        layer.moe is not None for layer in cfg.layers) else None
    experts = f"{moe.num_experts} experts, top-{moe.router.top_k}" if moe is not None else "no MoE layer"
    print(f"torchtitan DeepSeek-V3 {args.flavor}, {args.layers} layers ({experts}), {args.tokens} tokens/step "
          f"({args.tokens // args.seq_len} x {args.seq_len}), {args.steps} steps, attention {args.attn}, "
          f"{device_name}, torch {torch.__version__}, MXFP8 experts {'per GEMM' if args.per_gemm else 'as the fused block'}",
          flush=True)
    runs = []
    for mode in args.modes:
        for convert in (False, True):
            r = train(cfg, args, data, convert=convert, compiled=mode == "compiled")
            runs.append(r)
            print(f"  done {mode} {'mxfp8' if convert else 'bf16'}: {r['params'] / 1e9:.3f}B parameters, "
                  f"{r['converted_weights']} converted expert weights", flush=True)
    lines = summarize(runs, args.warmup)
    print("\n".join(lines))
    bad = [r for r in runs if r["convert"] and r["fallbacks"]]
    nonfinite = [r for r in runs if not all(math.isfinite(v) for v in r["losses"])]
    if args.json:
        record = {"args": {k: v for k, v in vars(args).items()}, "device": device_name, "torch": torch.__version__,
                  "stubbed": stubbed, "runs": runs}
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    if bad or nonfinite:
        print(f"FAIL: {len(bad)} converted run(s) with fallbacks, {len(nonfinite)} run(s) with non-finite loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
