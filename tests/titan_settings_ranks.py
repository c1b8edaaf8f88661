"""Gloo CPU ranks for ``tests/test_titan_settings.py``: torchtitan 0.3.0's DeepSeek-V3 config converted by
moe_quant's model converter with this rank's settings, built on the meta device and parallelized as its
trainer does (``update_from_config``, ``Module.parallelize``), the converted experts' settings compared there."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist


def run(settings: list, ep: int = 2, pipeline: str | None = None) -> dict:
    """Rank r converts with ``settings[r]`` (``converter_config`` arguments), builds and parallelizes the model
    (EP ``ep``, FSDP over the world); returns the error it raised (type, message, seconds) or None, and how many
    ``all_gather_object`` calls it made. ``pipeline`` ``"ep"`` / ``"no_ep"``: the parallel dims report pipeline
    parallelism, with EP (the EP group compares) or without (nothing to compare over)."""
    from examples.titan.launch import stub_missing_fsdp_names

    stub_missing_fsdp_names()  # torch < 2.12 (the GPU machines' 2.11): the name torchtitan imports, never used here
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.deepseek_v3 import model_registry

    from moe_quant.ep.titan import converter_config
    from titan_model_ranks import stub_cpu_device

    stub_cpu_device()  # gloo meshes (titan_model_ranks)
    world, rank = dist.get_world_size(), dist.get_rank()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    spec = model_registry("debugmodel", converters=[converter_config(**settings[rank])])
    cfg = dataclasses.replace(spec.model, layers=spec.model.layers[:3], mtp_layers=[])  # 2 MoE blocks
    cfg.update_from_config(config=type("JobConfig", (), {"parallelism": parallelism})())
    with torch.device("meta"):
        model = cfg.build()
    if pipeline is not None:
        parallel_dims = _Pipeline(parallel_dims, ep_enabled=pipeline == "ep")
    calls = [0]
    real = dist.all_gather_object

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    t0 = time.monotonic()
    try:
        model.parallelize(parallel_dims)  # what parallelize_deepseekv3 runs under EP
        error = None
    except Exception as e:  # the test asserts type and message
        error = {"type": type(e).__name__, "message": str(e)}
    finally:
        dist.all_gather_object = real
    return {"error": error, "seconds": time.monotonic() - t0, "all_gather_object_calls": calls[0]}


class _Pipeline:
    """``parallel_dims`` reporting pipeline parallelism (the check asks ``pp_enabled`` and ``ep_enabled``)."""

    pp_enabled = True

    def __init__(self, inner, ep_enabled: bool):
        self._inner, self.ep_enabled = inner, ep_enabled

    def __getattr__(self, name):
        return getattr(self._inner, name)


__all__ = ["run"]
