"""A plain bf16 training loop of the trainer's model on one GPU: the speed the bf16 variant of
:mod:`examples.titan.bench` should come near (a benchmark row, ``--variants plain_bf16``)::

    python -m examples.titan.plain_loop --dump-folder out/plain [--compile] [--profile]   # (or under torchrun)

The same model as the configs' ``bf16`` variant (:func:`examples.titan.config_registry.model_spec`: DeepSeek-V3
``--flavor`` cut to ``--layers`` blocks, the same attention choice, torchtitan's ``init_weights``, seed 0), the same
batch (``--local-batch-size`` x ``--seq-len`` tokens of :class:`examples.titan.data.AffineDataLoader`), the same
loss (torchtitan's cross-entropy over the valid tokens), torchtitan's AdamW (``default_adamw``: fused on CUDA),
gradient clipping at 1.0 and the MoE load-balancing hook; ``--compile``: torchtitan's ``apply_compile`` (each block
``torch.compile(fullgraph=True)``). What differs from the trainer is all that a plain loop leaves out: no FSDP, no
mixed precision (the parameters, their gradients and the optimizer states are bf16; the router's buffers stay
fp32), no checkpointing, metrics or profiler machinery.

Every step is written to ``<dump-folder>/metrics/rank0.jsonl`` with the keys the bench reads from torchtitan's
own rows (:mod:`examples.titan.metrics`): ``throughput(tps)`` (tokens / step wall time, the step ending at the
loss's host read), ``time_metrics/end_to_end(s)``, ``memory/max_reserved(GiB)`` and ``memory/max_active(GiB)``
(the step's peaks), ``loss_metrics/global_avg_loss``; what was built goes to ``<dump-folder>/setup/rank0.json``.
``--profile``: ``torch.profiler`` records the last step (the one before it warms it up), as the bench has torchtitan's
profiler do, and writes its trace where torchtitan writes its own,
``<dump-folder>/profiling/traces/iteration_<steps>/rank0_trace.json`` (``scripts/ep_timeline.py --traces`` compares
it with the trainer's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump-folder", required=True, help="where metrics/rank0.jsonl and setup/rank0.json go")
    p.add_argument("--flavor", default="16B", choices=["16B", "debugmodel"])
    p.add_argument("--layers", type=int, default=4, help="transformer blocks kept (block 0 dense, the others MoE)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--local-batch-size", type=int, default=None, help="default: the configs' (4 for 16B)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the configs' (4096 for 16B)")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--compile", action="store_true", help="torchtitan's apply_compile: each block compiled")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the last step; its trace in profiling/traces/iteration_<steps>/")
    args = p.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        p.error("--steps and --layers must be positive")
    return args


def _memory() -> dict:
    """This step's peak reserved and active GiB (torchtitan's keys), then a reset; -1 where the device has none."""
    if not torch.cuda.is_available():
        return {"memory/max_reserved(GiB)": -1, "memory/max_active(GiB)": -1}
    stats = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    return {"memory/max_reserved(GiB)": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "memory/max_active(GiB)": stats.get("active_bytes.all.peak", 0) / 2**30}


def _profiler(args):
    """``--profile``: a ``torch.profiler.profile`` that records step ``args.steps`` (the step before it its warm-up) and
    writes its trace as torchtitan's profiler does; else a do-nothing stand-in with the same ``step()``."""
    import contextlib
    import types

    if not args.profile:
        return contextlib.nullcontext(types.SimpleNamespace(step=lambda: None))
    from torch.profiler import ProfilerActivity, profile, schedule

    folder = os.path.join(args.dump_folder, "profiling", "traces", f"iteration_{args.steps}")

    def write(prof):
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, "rank0_trace.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    warm = 1 if args.steps >= 2 else 0
    return profile(activities=activities, on_trace_ready=write,
                   schedule=schedule(wait=args.steps - 1 - warm, warmup=warm, active=1, repeat=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    from examples.titan.launch import has_accelerator, provide_missing_torch_names, use_cpu_device

    provide_missing_torch_names()
    if not has_accelerator():
        use_cpu_device()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.attention import FlexAttention

    from examples.titan import config_registry as reg
    from examples.titan.data import AffineDataLoader, AffineTokenizer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # one rank (the load-balancing hook's mesh needs a group): torchrun's, or its own
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("plain_loop is a one-GPU loop: run it with --nproc_per_node 1")
    defaults = reg._config(args.flavor, "bf16")
    batch = args.local_batch_size or defaults.training.local_batch_size
    seq = args.seq_len or defaults.training.seq_len
    options = reg.MoEQuantOptions(flavor=args.flavor, variant="bf16", layers=args.layers, attention=args.attention)
    spec = reg.model_spec(options, ep_degree=1, tokens_per_rank=batch * seq)
    parallelism = ParallelismConfig(data_parallel_shard_degree=1, expert_parallel_degree=1,
                                    spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    cfg = spec.model
    cfg.update_from_config(config=type("JobConfig", (), {"parallelism": parallelism})())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for p in model.parameters():  # bf16 parameters (their gradients and AdamW states follow); buffers as they are
        p.data = p.data.to(torch.bfloat16)
    model.train()
    if args.compile:
        apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=parallel_dims)
    opt = default_adamw(lr=args.lr)
    if not cuda:
        opt.implementation = "foreach"  # torchtitan's "fused" AdamW is CUDA only
    optimizers = opt.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)  # the MoE load-balancing hook
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size).build(compile_config=CompileConfig())
    tok = AffineTokenizer.Config(vocab_size=cfg.vocab_size).build(tokenizer_path="")
    data = iter(AffineDataLoader.Config().build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=seq,
                                                local_batch_size=batch))
    flex = any(isinstance(m, FlexAttention) for m in model.modules())
    os.makedirs(os.path.join(args.dump_folder, "metrics"), exist_ok=True)
    os.makedirs(os.path.join(args.dump_folder, "setup"), exist_ok=True)
    with open(os.path.join(args.dump_folder, "setup", "rank0.json"), "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "parallelize_fn": "examples.titan.plain_loop (none)",
                   "attention": sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__
                                        and type(m).__module__.endswith("attention")}),
                   "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                   "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None
                                          for b in model.layers.values()), "fsdp_modules": 0}, f, indent=1)
    metrics = open(os.path.join(args.dump_folder, "metrics", "rank0.jsonl"), "w", encoding="utf-8")
    _memory()
    with _profiler(args) as prof:
        _train(args, model, optimizers, loss_fn, data, device, flex, metrics, prof)
    metrics.close()
    dist.destroy_process_group()
    return 0


def _train(args, model, optimizers, loss_fn, data, device, flex, metrics, prof) -> None:
    """The steps, each logged (``main``'s loop); ``prof.step()`` after each."""
    from examples.titan.metrics import outside_allocator_gib

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        input_dict, labels = next(data)
        inputs, labels = input_dict["input"].to(device), labels.to(device)
        kwargs = {"positions": input_dict["positions"].to(device)} if "positions" in input_dict else {}
        if flex:
            kwargs["attention_masks"] = model.get_attention_masks(positions=kwargs.get("positions"))
        optimizers.zero_grad()
        valid = (labels != -100).sum()
        pred = model(inputs, **kwargs)
        loss, _ = loss_fn(pred, labels, valid)
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        value = float(loss.detach())  # the step ends at this host read, as torchtitan's logging step does
        seconds = time.perf_counter() - t0
        row = {"step": step, "loss_metrics/global_avg_loss": value, "throughput(tps)": labels.numel() / seconds,
               "time_metrics/end_to_end(s)": seconds, **_memory()}
        outside = outside_allocator_gib()
        if outside is not None:
            row["moe_quant/outside_allocator(GiB)"] = outside
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        prof.step()


if __name__ == "__main__":
    sys.exit(main())
