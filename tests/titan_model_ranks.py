"""Gloo CPU ranks for ``tests/test_torchtitan_model_ep.py``: torchtitan 0.3.0's DeepSeek-V3 built and trained
the way its trainer does it, with moe_quant's model converter in the model's converters.

Per rank: ``model_registry("debugmodel", converters=[converter_config(...)])`` cut to its first 2 blocks,
``update_from_config`` with a ``ParallelismConfig`` (FSDP over the world, ``expert_parallel_degree`` 2 or
1), the model built on the meta device, torchtitan's own ``parallelize_deepseekv3`` (its
``Module.parallelize``: EP sharding of the experts and ``wire_meshes`` of the dispatcher;
``apply_compile``: ``torch.compile(fullgraph=True)`` of each block; FSDP2), ``to_empty`` + the weights of
one reference state dict (as a checkpoint load), then steps of the trainer's ``train_step``: forward and
backward under its SPMD context with its cross-entropy loss over the global valid tokens, its gradient
clipping, its optimizer container's step (AdamW). See the test module for what is substituted on the CPU.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

LAYERS, SEQ, LOCAL_BATCH, STEPS, DATA_SEED = 2, 32, 2, 2, 7
# torchtitan's default "spmd_types" backend fails in FSDP on torch 2.13 for torchtitan's own model (see the test)
SPMD_BACKEND = "partial_dtensor"


def stub_cpu_device() -> None:
    """torchtitan picks its device type once, at import: ``"cuda"`` wherever no accelerator is present.
    Its meshes (``ParallelDims``) are built with it; on this CPU machine they must be ``"cpu"`` (gloo)."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def _model_config(converter):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry

    spec = model_registry("debugmodel", converters=[converter] if converter else None)
    cfg = dataclasses.replace(spec.model, layers=spec.model.layers[:LAYERS], mtp_layers=[])
    for layer in cfg.layers:  # torchtitan's flex attention: its backward needs CUDA (see the test module)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec, cfg


def _batches(vocab: int):
    """``STEPS`` global batches of ``world * LOCAL_BATCH`` sequences; rank r takes its ``LOCAL_BATCH``."""
    g = torch.Generator().manual_seed(DATA_SEED)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (world * LOCAL_BATCH, SEQ + 1), generator=g)
        mine = tokens[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


def run(ep: int, compiled: bool, state_path: str, convert: bool = True, capacity_factor=None,
        max_tokens=None) -> dict:
    """Builds, parallelizes and trains the model on this rank (see the module doc); returns per step the
    local loss (sum over this rank's tokens / the global valid tokens, as the trainer's), the MXFP8 GEMMs
    that ran eagerly and the graphs compiled so far; the dispatchers, fallbacks and conversion."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

    import moe_quant.autograd
    from moe_quant.conversion import fallback_counts, is_converted, reset_fallback_counts
    from moe_quant.ep.titan import converter_config, dispatcher_class

    warnings.filterwarnings("ignore", message=".*(autocast|DTensor random operators).*", category=UserWarning)
    stub_cpu_device()
    world = dist.get_world_size()
    t0 = time.monotonic()
    torch._dynamo.reset()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=ep,
                                    spmd_backend=SPMD_BACKEND)
    training = TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ, steps=STEPS)
    compile_config = CompileConfig(enable=compiled, backend="aot_eager")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    converter = converter_config(capacity_factor=capacity_factor, max_tokens=max_tokens) if convert else None
    spec, cfg = _model_config(converter)
    cfg.update_from_config(config=type("JobConfig", (), {"parallelism": parallelism})())
    with torch.device("meta"):
        model = cfg.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                compile_config=compile_config, ac_config=None, dump_folder=tempfile.mkdtemp())
    # gloo has no PREMUL_SUM, which FSDP's reduce-scatter uses for torchtitan's gradient divide factor 1.0:
    # plain SUM (then a division by 1.0, exact), as torchtitan's symmetric-memory option also sets it
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    set_model_state_dict(model, torch.load(state_path, weights_only=True),
                         options=StateDictOptions(full_state_dict=True))  # as a checkpoint load
    model.train()
    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_config)
    opt_config = default_adamw(lr=8e-4)  # the debug model's (its "fused" implementation is CUDA only)
    opt_config.implementation = "foreach"
    optimizers = opt_config.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)  # the MoE load-balancing hook
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    dispatchers = [m.token_dispatcher for m in model.modules() if isinstance(m, RoutedExperts)]

    # MXFP8 GEMMs of the converted experts that ran eagerly: the fused SwiGLU block (3 GEMMs) or one
    # per-GEMM call each (EP-received tokens take that path). Not counted while torch.compile traces: a
    # traced side effect would become a guard (a retrace each step), and on the CPU none of them runs as
    # a Python call in the compiled graph (compiled == eager bit for bit shows the same numerics ran)
    gemm_calls = [0]
    real = {name: getattr(moe_quant.autograd, name) for name in ("mxfp8_swiglu_experts", "mxfp8_grouped_mm")}

    def counting(name, n):
        def call(*args, **kwargs):
            if not torch.compiler.is_compiling():
                gemm_calls[0] += n
            return real[name](*args, **kwargs)
        return call

    moe_quant.autograd.mxfp8_swiglu_experts = counting("mxfp8_swiglu_experts", 3)
    moe_quant.autograd.mxfp8_grouped_mm = counting("mxfp8_grouped_mm", 1)
    reset_fallback_counts()
    torch._dynamo.utils.counters.clear()
    res = {"losses": [], "loss_bits": [], "gemm_calls": [], "graphs": [], "step_seconds": []}
    try:
        for inputs, labels in _batches(cfg.vocab_size):  # the trainer's train_step, one microbatch
            t_step, calls_before = time.monotonic(), gemm_calls[0]
            optimizers.zero_grad()
            global_valid = dist_utils.dist_sum_tensor((labels != -100).sum(), parallel_dims.get_mesh("batch"))
            with context():
                pred = model(inputs)
                loss, _ = loss_fn(pred, labels, global_valid)
                del pred
                loss.backward()
            dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True,
                                       ep_enabled=parallel_dims.ep_enabled)
            optimizers.step()
            res["losses"].append(float(loss))
            res["loss_bits"].append(int(loss.detach().view(torch.int32)))
            res["gemm_calls"].append(gemm_calls[0] - calls_before)
            res["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            res["step_seconds"].append(time.monotonic() - t_step)
    finally:
        for name, fn in real.items():
            setattr(moe_quant.autograd, name, fn)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    res.update({
        "fallbacks": sum(fallback_counts().values()),
        "converted": [is_converted(m) for m in experts],
        "ours": [isinstance(d, dispatcher_class()) for d in dispatchers],
        "ep_sizes": [getattr(d, "ep_size", None) for d in dispatchers],
        "overflow": [d.check_overflow() for d in dispatchers if getattr(d, "capacity_factor", None)],
        "seconds": time.monotonic() - t0,
    })
    return res


def write_state(path: str) -> None:
    """The reference weights (seed 0, torchtitan's own init of the unsharded converted model)."""
    from moe_quant.ep.titan import converter_config

    stub_cpu_device()
    _, cfg = _model_config(converter_config())
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    torch.save(model.state_dict(), path)


__all__ = ["run", "write_state"]
