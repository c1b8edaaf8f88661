"""Train a Hugging Face transformers MoE model in bf16 and with MXFP8 experts, side by side.

Builds a model of the chosen family from a config (random weights, no download), makes two copies
from the same initialization, converts the routed experts of one with::

    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: fqn.endswith(".experts"))

and trains both for a few steps on the same batches (a learnable next-token pattern), printing the
loss of both every few steps, the step time, their ratio and (on CUDA) the peak memory.

    python -m examples.hf_train --family qwen3_moe --layers 2 --experts 128 --top-k 8 \\
        --hidden 2048 --intermediate 768 --tokens 8192 --steps 20 --device cuda

Needs ``transformers`` 5.x (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python examples/hf_train.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4")
EXPERTS_FILTER = lambda mod, fqn: fqn.endswith(".experts")  # noqa: E731  (the filter docs/transformers.md documents)


def build_config(family: str, *, hidden: int, intermediate: int, experts: int, top_k: int, layers: int,
                 vocab: int = 1024, max_positions: int = 4096):
    """A ``transformers`` config of ``family`` with every decoder layer an MoE layer.

    ``intermediate`` is the size of one routed expert (``moe_intermediate_size`` / ``intermediate_size``
    by family); shared experts and dense MLPs get the same size. Attention heads of 128 (hidden < 256:
    one head of ``hidden``).
    """
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    heads = max(1, hidden // 128)
    head_dim = hidden // heads
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), max_position_embeddings=max_positions, num_experts_per_tok=top_k,
    )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=experts)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                 shared_expert_intermediate_size=intermediate, num_experts=experts,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=head_dim, intermediate_size=intermediate,
                                 moe_intermediate_size=intermediate, num_experts=experts, decoder_sparse_step=1,
                                 mlp_only_layers=[])
    if family == "deepseek_v3":
        rope = min(64, head_dim // 2)
        return tf.DeepseekV3Config(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                   n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=0,
                                   n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=max(32, hidden // 4),
                                   qk_rope_head_dim=rope, qk_nope_head_dim=head_dim - rope, v_head_dim=head_dim,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, head_dim=head_dim, intermediate_size=intermediate, num_local_experts=experts)
    return tf.Llama4TextConfig(**common, head_dim=head_dim, intermediate_size=intermediate,
                               intermediate_size_mlp=intermediate, num_local_experts=experts,
                               interleave_moe_layer_step=1)


def build_model(config, seed: int = 0, device="cpu", dtype=None):
    """The model of ``config`` with random weights: the same for the same ``seed``, ``device`` and ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def batches(vocab: int, batch: int, seq: int, steps: int, device, seed: int = 0):
    """``steps`` batches of token ids where each next token is a fixed function of the current one."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab, generator=g)
    for _ in range(steps):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(1, seq):
            ids[:, i] = table[ids[:, i - 1]]
        yield ids.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, data, *, lr: float, device: torch.device):
    """Train on ``data``; returns (losses, step times in s, peak CUDA memory in bytes or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids in data:
        _sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, times, peak


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 32)")
    p.add_argument("--intermediate", type=int, default=128, help="routed expert size (a multiple of 32)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch x seq)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (divides --tokens)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    p.add_argument("--every", type=int, default=0, help="print the loss every N steps (default: about 5 rows)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--per-gemm", action="store_true",
                   help="MXFP8MoEConfig(fused_block=False): the experts' GEMMs one by one, not the fused SwiGLU block")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0 = PyTorch's default)")
    args = p.parse_args(argv)
    for name in ("layers", "experts", "top_k", "hidden", "intermediate", "vocab", "tokens", "seq", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.hidden % 32 or args.intermediate % 32:
        p.error("--hidden and --intermediate must be multiples of 32 (the MX block size)")
    if args.top_k > args.experts:
        p.error("--top-k must not exceed --experts")
    if args.tokens % args.seq:
        p.error("--seq must divide --tokens")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    from moe_quant import cli

    cli.exit_unless_device_runs(p, args.device)  # one line and exit status 2 (not a device, meta, no GPU)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    from moe_quant import MXFP8MoEConfig, fallback_counts, reset_fallback_counts
    from moe_quant.conversion import is_converted
    from torchao.quantization import quantize_

    config = build_config(args.family, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                          top_k=args.top_k, layers=args.layers, vocab=args.vocab, max_positions=max(args.seq, 64))
    results, checksums = {}, {}
    for mode in ("bf16", "mxfp8"):  # one model on the device at a time, both from the same initialization
        model = build_model(config, device=device, dtype=torch.bfloat16)
        checksums[mode] = sum(p.detach().float().sum().item() for p in model.parameters())
        if mode == "mxfp8":
            quantize_(model, MXFP8MoEConfig(fused_block=not args.per_gemm), filter_fn=EXPERTS_FILTER)
            converted = sum(p.ndim == 3 for m in model.modules() if is_converted(m) for p in m.parameters())
            reset_fallback_counts()
        data = batches(args.vocab, args.tokens // args.seq, args.seq, args.steps, device)
        results[mode] = train(model, data, lr=args.lr, device=device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if checksums["bf16"] != checksums["mxfp8"]:
        raise RuntimeError("the bf16 and MXFP8 models did not start from the same weights")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{args.family}: {args.layers} layers, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"expert intermediate {args.intermediate}, {args.tokens} tokens/step; {name}; torch {torch.__version__}")
    print(f"converted expert weights: {converted}; fallbacks: {fallback_counts() or 'none'}")
    every = args.every or max(1, args.steps // 5)
    print(f"{'step':>5} {'bf16 loss':>10} {'mxfp8 loss':>11} {'rel diff':>9}")
    (lb, tb, pb), (lq, tq, pq) = results["bf16"], results["mxfp8"]
    for i in range(args.steps):
        if (i + 1) % every == 0 or i == 0 or i == args.steps - 1:
            print(f"{i + 1:>5} {lb[i]:>10.4f} {lq[i]:>11.4f} {(lq[i] - lb[i]) / lb[i]:>+9.2%}")
    mb, mq = (statistics.median(t[args.warmup:]) * 1e3 for t in (tb, tq))
    print(f"step ms (median of steps {args.warmup + 1}-{args.steps}): bf16 {mb:.2f}, mxfp8 {mq:.2f}, "
          f"ratio {mq / mb:.3f}")
    if pb is not None:
        print(f"peak memory GiB: bf16 {pb / 2**30:.3f}, mxfp8 {pq / 2**30:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
