"""The ``parallelize_fn`` the configs give torchtitan: its own ``parallelize_deepseekv3`` where this torch can run it.

* torch with per-parameter FSDP meshes (``ShardPlacementResult``, torch >= 2.12): torchtitan 0.3.0's FSDP of an
  MoE block under expert parallelism gives the routed experts' parameters their own mesh (``efsdp``) inside the
  block's ``fully_shard``; nothing is changed.
* torch 2.11 lacks that, and torchtitan 0.3.0 has no other path for EP > 1 (it fails importing
  ``ShardPlacementResult``): :func:`parallelize_without_per_param_mesh` runs torchtitan's own steps
  (``Module.parallelize``: EP sharding of the experts and ``wire_meshes`` of the dispatchers; activation
  checkpointing; ``apply_compile``: each block ``torch.compile(fullgraph=True)``) and FSDP2 over the same units
  (embeddings, each block, norm + output, the root; mixed precision, reshard policy and gradient divide factor
  1.0 as torchtitan's; on one rank too, over torchtitan's one-rank ``fsdp`` mesh, as its own function does),
  leaving the routed experts' parameters out of FSDP (``ignored_params``) under expert parallelism. That is exact
  only where the experts' FSDP degree ``efsdp = dp_shard * cp * tp / ep`` is 1 (expert parallelism over every
  rank, as the configs here set): each expert then lives on one rank, its gradient needs no reduction, and the
  experts cast their fp32 weights to bf16 themselves (torchtitan's GroupedExperts; moe_quant's converted experts
  quantize the fp32 weights to MXFP8 directly instead of FSDP's bf16 copy). ``efsdp > 1`` raises.
* One rank (one GPU): both apply FSDP2 over torchtitan's one-rank ``fsdp`` mesh (``ParallelDims`` keeps it at degree
  1), so its ``MixedPrecisionPolicy`` (bf16 parameters in compute, fp32 gradient reduction) makes the job train in
  bf16 compute with fp32 master weights, as on several GPUs. That is torchtitan's own mechanism for one device:
  0.3.0's config text names ``torch.autocast`` for single-device training, but its trainer never enters autocast.
* On gloo (the CPU process groups of the tests), after either, every FSDP module is set to
  ``set_force_sum_reduction_for_comms(True)``: FSDP's reduce-scatter otherwise uses ``ReduceOp.PREMUL_SUM`` for
  torchtitan's gradient divide factor 1.0, which gloo lacks; plain SUM then a division by 1.0 gives the same
  values (torchtitan's ``enable_fsdp_symm_mem`` option sets the same, on CUDA only).
* On one rank, after either, every FSDP module's gradient divide factor goes back from torchtitan's 1.0 to FSDP's
  default (None, :func:`no_division_on_one_rank`): FSDP (torch 2.11 to 2.13) skips the reduce-scatter on a one-rank
  mesh and copies its fp32 input to the output, as ``input / factor`` where a factor is set, one more pass over
  every gradient (4.3 ms of a 4-layer DeepSeek-V3 16B step on one H200), and unchanged where none is. Over one rank
  nothing is divided either way, so the gradients are the same bits.

:func:`for_this_torch` picks; every variant of a run gets the same. Whatever it picks, it then writes what was
built to ``<dump_folder>/setup/rank<r>.json`` (:func:`describe`): the torch version, the function, the launcher's
shims, the attention, experts and token dispatcher classes, the EP sizes, FSDP modules, compiled blocks, the
allocator's cap, the emulated wire (``wire_gbps``).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist


def torch_has_per_param_fsdp_mesh() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        return False
    return True


def force_sum_on_gloo(model) -> int:
    """``set_force_sum_reduction_for_comms(True)`` on every FSDP module of ``model`` if the default process
    group is gloo; returns how many modules were set."""
    from torch.distributed.fsdp import FSDPModule

    if not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_force_sum_reduction_for_comms(True)
    return len(modules)


def parallelize_without_per_param_mesh(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
                                       dump_folder):
    """torchtitan's ``parallelize_deepseekv3`` (``partial_dtensor``, no PP, no CP) for a torch without
    per-parameter FSDP meshes; the routed experts stay out of FSDP (see the module doc)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy

    if parallelism.spmd_backend != "partial_dtensor" or parallel_dims.pp_enabled or parallel_dims.cp_enabled:
        raise ValueError("this torch lacks per-parameter FSDP meshes: only spmd_backend='partial_dtensor' without "
                         "pipeline or context parallelism is supported here (or use torch >= 2.12)")
    if parallel_dims.ep_enabled:
        efsdp = parallel_dims.get_mesh("efsdp").size()
        if efsdp != 1:
            raise ValueError(f"this torch lacks per-parameter FSDP meshes, so the routed experts cannot be sharded "
                             f"by FSDP (efsdp = {efsdp}): set expert_parallel_degree = data_parallel_shard_degree * "
                             f"tensor_parallel_degree (efsdp = 1), or use torch >= 2.12")
    if model.enable_weight_tying:
        raise ValueError("weight tying is not supported by this fallback (torch < 2.12)")
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    # the "fsdp" mesh exists at degree 1 too (torchtitan keeps it "so fully_shard() can apply MixedPrecisionPolicy
    # even at degree 1"): one GPU trains in bf16 compute with fp32 master weights, as several do
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                              reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], cast_forward_inputs=False)
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, pp_enabled=False)
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp)
    if model.tok_embeddings is not None:
        shard(model.tok_embeddings, reshard_after_forward=reshard)
    if model.norm is not None and model.lm_head is not None:
        shard([model.norm, model.lm_head], reshard_after_forward=parallelism.fsdp_reshard_after_forward == "always")
    for block in model.layers.values():
        experts = block.moe.routed_experts.inner_experts if getattr(block, "moe_enabled", False) else None
        ignored = set(experts.parameters()) if experts is not None and parallel_dims.ep_enabled else None
        shard(block, reshard_after_forward=reshard, ignored_params=ignored)
    shard(model)
    disable_fsdp_gradient_division(model)
    return model


def _ep_size(dispatcher) -> int:
    """Ranks a token dispatcher exchanges tokens over (moe_quant's: its group; torchtitan's: its EP mesh; 1: local)."""
    if hasattr(dispatcher, "ep_size"):
        return dispatcher.ep_size
    mesh = getattr(dispatcher, "ep_mesh", None)
    return 1 if mesh is None else mesh.size()


def no_division_on_one_rank(model) -> int:
    """Every FSDP module of ``model`` back to FSDP's default gradient divide factor (None) if the job has one rank
    (see the module doc); returns how many modules were set."""
    from torch.distributed.fsdp import FSDPModule

    if dist.is_initialized() and dist.get_world_size() > 1:
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_gradient_divide_factor(None)
    return len(modules)


def finish_fsdp(model) -> int:
    """What :func:`for_this_torch` does to the FSDP modules after either function: :func:`force_sum_on_gloo`, then
    :func:`no_division_on_one_rank`; returns how many modules the first set."""
    forced = force_sum_on_gloo(model)
    no_division_on_one_rank(model)
    return forced


def describe(model, fn, *, force_sum: int, compile_config) -> dict:
    """What :func:`for_this_torch`'s function built (JSON-ready)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

    from moe_quant.conversion import is_converted

    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    dispatchers = [r.token_dispatcher for r in routed]
    settings = ("wire", "scale_mode", "capacity_factor", "overflow", "max_tokens")
    return {
        "torch": torch.__version__, "parallelize_fn": f"{fn.__module__}.{fn.__qualname__}",
        "launcher_shims": [n for n in os.environ.get("MOE_QUANT_TITAN_SHIMS", "").split(",") if n],
        "attention": sorted({type(m).__name__ for m in model.modules()
                             if isinstance(m, (FlexAttention, ScaledDotProductAttention))}),
        "experts": [type(m).__mro__[1 if is_converted(m) else 0].__name__ for m in model.modules()
                    if isinstance(m, GroupedExperts)],
        "experts_converted": [is_converted(m) for m in model.modules() if isinstance(m, GroupedExperts)],
        "experts_scale_mode": [str(m._mxfp8_config.scale_mode.value) for m in model.modules()
                               if isinstance(m, GroupedExperts) and is_converted(m)],
        "experts_dswiglu_cols_fp8": [m._mxfp8_config.dswiglu_cols_fp8 for m in model.modules()
                                     if isinstance(m, GroupedExperts) and is_converted(m)],
        "dispatchers": [type(d).__name__ for d in dispatchers],
        "ep_sizes": [_ep_size(d) for d in dispatchers],
        "dispatcher_settings": [{k: (str(getattr(d, k).value) if hasattr(getattr(d, k), "value") else getattr(d, k))
                                 for k in settings if hasattr(d, k)} for d in dispatchers],
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "force_sum_modules": force_sum,
        "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in model.layers.values()),
        "compile_backend": compile_config.backend if compile_config.enable else None,
        "allocator_cap_gib": allocator_cap_gib(),
        "wire_gbps": wire_gbps(),
    }


def wire_gbps() -> float | None:
    """The emulated wire every EP exchange is held to (``moe_quant.wire_gbps``), None: the real one."""
    slow_wire = sys.modules.get("benchmarks.slow_wire")
    held = None if slow_wire is None else slow_wire.HeldExchanges.active
    return None if held is None else held.gbps


def allocator_cap_gib() -> float | None:
    """The CUDA caching allocator's cap on this device in GiB (``moe_quant.memory_gib``); None: no cap, or no CUDA."""
    if not torch.cuda.is_available():
        return None
    fraction = torch.cuda.get_per_process_memory_fraction()
    return None if fraction >= 1 else fraction * torch.cuda.get_device_properties().total_memory / 2**30


def for_this_torch(torchtitan_fn):
    """``torchtitan_fn`` where this torch runs it, else :func:`parallelize_without_per_param_mesh`; then
    :func:`finish_fsdp` (gloo's sum reduction, no division on one rank) and the setup file (see the module doc)."""
    fn = torchtitan_fn if torch_has_per_param_fsdp_mesh() else parallelize_without_per_param_mesh

    @functools.wraps(fn)
    def parallelize(model, **kwargs):
        model = fn(model, **kwargs)
        forced = finish_fsdp(model)
        setup = describe(model, fn, force_sum=forced, compile_config=kwargs["compile_config"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        folder = os.path.join(kwargs["dump_folder"], "setup")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(setup, f, indent=1)
        return model

    return parallelize
