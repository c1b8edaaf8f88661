"""A one-rank gloo job for ``tests/test_titan_precision.py``: the configs of ``examples/titan`` (DeepSeek-V3 debug
flavour, 2 blocks, SDPA) built on the meta device and parallelized as torchtitan's trainer does on one GPU (its
default ``TrainingConfig``: fp32 parameters, ``mixed_precision_param`` bf16), then one forward and backward with
forward pre-hooks recording the dtypes each attention, dense feed-forward and routed-experts module receives."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _parallelize_fn(name: str):
    """``"fallback"``: the configs' function for torch < 2.12 (:func:`parallelize_without_per_param_mesh`);
    ``"torchtitan"``: torchtitan's own ``parallelize_deepseekv3`` (torch >= 2.12)."""
    from examples.titan import parallelize

    if name == "fallback":
        return parallelize.parallelize_without_per_param_mesh
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    return parallelize_deepseekv3


class _FlatOps(TorchDispatchMode):
    """Counts the ops run on 1-D float tensors of over 10,000 elements (FSDP's flat gradient buffers; the model's
    own tensors are 2-D or more), by name."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() and t.numel() > 10_000
               for t in args):
            name = str(func.overloadpacket)
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def run(variant: str, fn: str) -> dict:
    from examples.titan.launch import stub_missing_fsdp_names

    stub_missing_fsdp_names()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts

    from examples.titan import config_registry, parallelize
    from titan_model_ranks import stub_cpu_device

    stub_cpu_device()
    assert dist.get_world_size() == 1
    torch.manual_seed(0)
    parallelism = ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=1,
                                    spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=2, seq_len=32)  # torchtitan's defaults: fp32 params, bf16 compute
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    parallel_dims.build_mesh()
    options = config_registry.MoEQuantOptions(flavor="debugmodel", variant=variant, layers=2, attention="sdpa")
    spec = config_registry.model_spec(options, ep_degree=1, tokens_per_rank=64)
    cfg = spec.model
    cfg.update_from_config(config=type("JobConfig", (), {"parallelism": parallelism})())
    with torch.device("meta"):
        model = cfg.build()
    model = _parallelize_fn(fn)(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.mkdtemp())
    parallelize.finish_fsdp(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    seen: dict = {}

    def record(name):
        def hook(module, args, kwargs):
            tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
                       and t.is_floating_point()]
            params = [p for p in module.parameters(recurse=False)]
            seen.setdefault(name, set()).update(str(t.dtype) for t in tensors[:1] + params)
        return hook

    kinds = {ScaledDotProductAttention: "attention", FeedForward: "feed_forward", GroupedExperts: "experts"}
    for module in model.modules():
        for cls, name in kinds.items():
            if isinstance(module, cls):
                module.register_forward_pre_hook(record(name), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    flat = _FlatOps()
    with dist_utils.get_spmd_context(parallel_dims=parallel_dims)():
        pred = model(tokens[:, :-1])
        loss, _ = loss_fn(pred, tokens[:, 1:], torch.tensor(64))
        with flat:
            loss.backward()
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    params = {str(p.dtype) for p in model.parameters()}
    return {"seen": {k: sorted(v) for k, v in seen.items()}, "master_dtypes": sorted(params),
            "grad_dtypes": sorted(grads), "loss": float(loss), "flat_ops": flat.counts}


__all__ = ["run"]
