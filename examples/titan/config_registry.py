"""torchtitan trainer configs: DeepSeek-V3 with FSDP2 over every rank and expert parallelism over every rank,
bf16 experts (torchtitan's own) or moe_quant's MXFP8 experts. ``--module examples.titan.config_registry``::

    torchrun --nproc_per_node 2 -m torchtitan.train --module examples.titan.config_registry \\
        --config deepseek_v3_16b_mxfp8 [--compile.enable] [--moe_quant.layers 4] [--training.steps 100]

(with a released torch, up to 2.13 at least: ``-m examples.titan.launch`` in place of ``-m torchtitan.train``;
that module says what it puts in place.)

moe_quant goes in with one line, the converter in the model registry's ``converters`` (what
:func:`model_spec` does)::

    model_registry("16B", converters=[converter_config()])

Config functions, one per variant, of DeepSeek-V3 16B (``deepseek_v3_16b_*``) and of torchtitan's debug
flavour (``deepseek_v3_debug_*``, for CPU tests):

* ``*_bf16``: torchtitan's model as it is: bf16 experts, its all-to-all token dispatcher (the baseline);
* ``*_converted``: moe_quant's MXFP8 experts (``converter_config(dispatcher=False)``), torchtitan's dispatcher;
* ``*_mxfp8``: MXFP8 experts and moe_quant's dispatcher, MXFP8 on the wire (``converter_config()``);
* ``*_mxfp8_sync_free``: the same dispatcher in its sync-free mode (``capacity_factor``; the token bound
  ``max_tokens`` = ``local_batch_size * seq_len``, this rank's tokens per step).

The rest is the same for every variant: the first ``--moe_quant.layers`` blocks of the flavour (block 0 dense,
the others MoE), no MTP; FSDP over every rank (``data_parallel_shard_degree=-1``), expert parallelism over
every rank (``expert_parallel_degree`` = ``WORLD_SIZE``, or ``--parallelism.expert_parallel_degree``);
torchtitan's default mixed precision (fp32 parameters, bf16 compute, fp32 gradient reduction);
``local_batch_size`` x ``seq_len`` = 16384 tokens per GPU per step (16B), 100 steps; AdamW; torchtitan's
``CrossEntropyLoss`` (not its ``ChunkedLossWrapper``, which failed in backward under torch 2.11's FSDP2); no
activation checkpointing; seed 0; the synthetic stream of :mod:`examples.titan.data`; metrics of every step also in
``<dump_folder>/metrics/rank<r>.jsonl`` (:mod:`examples.titan.metrics`); DCP checkpoints when
``--checkpoint.enable`` (every ``--checkpoint.interval`` steps, full state, the last one too).

``--moe_quant.*`` (``layers``, ``variant``, ``scale_mode``, ``dswiglu_cols_fp8``, ``wire``, ``capacity_factor``,
``attention``, ``memory_gib``: a cap on the allocator, to test that a run fits a smaller GPU; ``wire_gbps``: every
EP all-to-all held to a slower wire, the same for every variant) rebuild the model spec after the command line is
read (:class:`MoEQuantTrainerConfig`). ``--moe_quant.attention sdpa`` swaps torchtitan's flex attention for causal
SDPA, the same attention for these one-document sequences; ``auto`` (default) picks sdpa where flex cannot run (no
CUDA: its backward; torch 2.11: torchtitan calls ``create_block_mask(separate_full_blocks=...)``, which 2.11 lacks).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import model_registry
from torchtitan.trainer import Trainer

from examples.titan import parallelize
from examples.titan.data import AffineDataLoader, AffineTokenizer
from examples.titan.metrics import JsonlMetricsProcessor
from moe_quant.ep.titan import converter_config

VARIANTS = ("bf16", "converted", "mxfp8", "mxfp8_sync_free")


@dataclass(kw_only=True, slots=True)
class MoEQuantOptions:
    flavor: Literal["16B", "debugmodel"] = "16B"
    layers: int = 4
    """Keep the first N transformer blocks (block 0 is dense, the others MoE)."""
    variant: Literal["bf16", "converted", "mxfp8", "mxfp8_sync_free"] = "mxfp8"
    scale_mode: Literal["rceil", "floor"] = "rceil"
    dswiglu_cols_fp8: bool = False
    """MXFP8 variants: the experts' ``MXFP8MoEConfig(dswiglu_cols_fp8=...)`` (Hopper: w1's and w3's weight-gradient
    operands kept in fp8 until their GEMMs)."""
    wire: Literal["mxfp8", "bf16"] = "mxfp8"
    """moe_quant's dispatcher: what the dispatch forward and combine backward legs send."""
    capacity_factor: float | None = None
    """Sync-free variant: the receive capacity factor; None: the EP degree (never overflows)."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    wire_gbps: float | None = None
    """Hold every all-to-all of the EP token dispatchers (moe_quant's and torchtitan's alike, eager and compiled)
    to at least its bytes to the other ranks over this many GB/s per GPU (:class:`benchmarks.slow_wire.HeldExchanges`:
    NCCL at full speed, then the rest of the time on an emulated wire); None: the real wire."""
    memory_gib: float | None = None
    """Cap torch's CUDA caching allocator at this many GiB per rank (``torch.cuda.set_per_process_memory_fraction``),
    so a larger GPU runs out of memory where a smaller one would: 76 stands for an 80 GB GPU, leaving room for what
    the allocator does not hold (CUDA context, NCCL's buffers: the metrics' ``moe_quant/outside_allocator(GiB)``,
    2.7 GiB per GPU in the 4-GPU DeepSeek-V3 jobs of docs/torchtitan_trainer.md). None: no cap."""


def memory_fraction(gib: float, total_bytes: int) -> float:
    """The allocator fraction of a device of ``total_bytes`` that ``gib`` GiB is (``moe_quant.memory_gib``)."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib * 2**30 <= total_bytes:
        raise ValueError(f"moe_quant.memory_gib must be a number of GiB in (0, {total_bytes / 2**30:.1f}] (this "
                         f"GPU's memory), got {gib!r}")
    return gib * 2**30 / total_bytes


def cap_allocator(gib: float | None) -> float | None:
    """Cap this rank's CUDA caching allocator at ``gib`` GiB (its device: ``LOCAL_RANK``, made current, as
    torchtitan makes it); returns the fraction set, None where ``gib`` is None."""
    if gib is None:
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"moe_quant.memory_gib caps the CUDA allocator, but this machine has no CUDA device "
                         f"(got {gib!r}; leave it unset)")
    device = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)  # first: no CUDA context on another rank's device
    fraction = memory_fraction(gib, torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def hold_exchanges(gbps: float | None):
    """From now on in this process, every EP all-to-all takes at least its bytes over ``gbps`` GB/s
    (``moe_quant.wire_gbps``; :class:`benchmarks.slow_wire.HeldExchanges`), or the real wire where None; returns
    the installed :class:`~benchmarks.slow_wire.HeldExchanges` or None. A later call replaces an earlier one
    (torchtitan builds the config again once the command line is read)."""
    if gbps is None:  # nothing to hold: release what an earlier call held (if any), import nothing
        slow_wire = sys.modules.get("benchmarks.slow_wire")
        return None if slow_wire is None else slow_wire.HeldExchanges.hold(None)
    if isinstance(gbps, bool) or not (isinstance(gbps, (int, float)) and 0 < gbps < float("inf")):
        raise ValueError(f"moe_quant.wire_gbps must be a positive number of GB/s or None, got {gbps!r}")
    from benchmarks import slow_wire

    return slow_wire.HeldExchanges.hold(gbps)


def flex_usable() -> bool:
    """torchtitan 0.3.0's flex attention runs here: CUDA (its backward) and a torch whose ``create_block_mask``
    takes ``separate_full_blocks`` (torch 2.11's does not)."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    return torch.cuda.is_available() and "separate_full_blocks" in inspect.signature(create_block_mask).parameters


def _attention(options: MoEQuantOptions) -> str:
    if options.attention == "auto":
        return "flex" if flex_usable() else "sdpa"
    return options.attention


def model_spec(options: MoEQuantOptions, *, ep_degree: int, tokens_per_rank: int):
    """torchtitan's DeepSeek-V3 model spec of ``options`` (the flavour cut to ``options.layers`` blocks)."""
    if options.variant not in VARIANTS:
        raise ValueError(f"moe_quant.variant must be one of {list(VARIANTS)}, got {options.variant!r}")
    experts = {"scale_mode": options.scale_mode, "dswiglu_cols_fp8": options.dswiglu_cols_fp8}
    converters = {
        "bf16": None,
        "converted": [converter_config(**experts, dispatcher=False)],
        "mxfp8": [converter_config(**experts, wire=options.wire)],
        "mxfp8_sync_free": [converter_config(
            **experts, wire=options.wire, max_tokens=tokens_per_rank,
            capacity_factor=float(ep_degree) if options.capacity_factor is None else options.capacity_factor)],
    }[options.variant]
    spec = model_registry(options.flavor, converters=converters)
    layers = spec.model.layers
    if not 1 <= options.layers <= len(layers):
        raise ValueError(f"moe_quant.layers must be in [1, {len(layers)}] for {options.flavor}, got {options.layers}")
    spec.model = dataclasses.replace(spec.model, layers=layers[:options.layers], mtp_layers=[])
    if _attention(options) == "sdpa":
        for _fqn, _cfg, parent, attr in spec.model.traverse(FlexAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.parallelize_fn = parallelize.for_this_torch(spec.parallelize_fn)
    return spec


@dataclass(kw_only=True, slots=True)
class MoEQuantTrainerConfig(Trainer.Config):
    """torchtitan's ``Trainer.Config`` with a ``moe_quant`` section; the model spec follows it (rebuilt once
    the command line is read)."""

    moe_quant: MoEQuantOptions = field(default_factory=MoEQuantOptions)

    def _validate_cuda_graphs(self) -> None:
        """torchtitan's check that its CUDA-graphed step (``--training.no-disable_cuda_graphs``: it captures each
        step's forward and backward) has token dispatchers without host synchronization, which names its own
        only; moe_quant's sync-free dispatcher has none either (no host read after its handshake, which
        ``wire_meshes`` runs before the first step): allowed too. Any other dispatcher goes to torchtitan's check."""
        from moe_quant.ep.titan import dispatcher_config_class
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        dispatchers = [] if self.model_spec is None else [
            c for _, c, _, _ in self.model_spec.model.traverse(LocalTokenDispatcher.Config)]
        if dispatchers and all(isinstance(c, dispatcher_config_class()) and c.capacity_factor is not None
                               for c in dispatchers):
            if self.parallelism.pipeline_parallel_degree > 1:  # torchtitan's own limit, whatever the dispatcher
                raise ValueError("CUDA graphs do not support pipeline parallelism yet. "
                                 "Set --training.disable_cuda_graphs.")
            return
        Trainer.Config._validate_cuda_graphs(self)

    def __post_init__(self):
        cap_allocator(self.moe_quant.memory_gib)
        hold_exchanges(self.moe_quant.wire_gbps)
        tokens = self.training.local_batch_size * self.training.seq_len
        self.model_spec = model_spec(self.moe_quant, ep_degree=self.parallelism.expert_parallel_degree,
                                     tokens_per_rank=tokens)
        self.tokenizer = AffineTokenizer.Config(vocab_size=self.model_spec.model.vocab_size)
        self.loss = CrossEntropyLoss.Config(global_vocab_size=self.model_spec.model.vocab_size)
        Trainer.Config.__post_init__(self)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _config(flavor: str, variant: str) -> MoEQuantTrainerConfig:
    debug = flavor == "debugmodel"
    return MoEQuantTrainerConfig(
        moe_quant=MoEQuantOptions(flavor=flavor, variant=variant, layers=2 if debug else 4),
        hf_assets_path="",  # nothing to read: the tokenizer and data are synthetic
        metrics=JsonlMetricsProcessor.Config(log_freq=1),
        dataloader=AffineDataLoader.Config(),
        optimizer=default_adamw(lr=8e-4 if debug else 3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2 if debug else 10, decay_ratio=0.8,
                                                  decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=2 if debug else 4, seq_len=32 if debug else 4096,
                                steps=4 if debug else 100, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=_world(),
                                      spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=50, last_save_model_only=False),
        activation_checkpoint=None,
        debug=DebugConfig(seed=0),
    )


def deepseek_v3_16b_bf16() -> MoEQuantTrainerConfig:
    return _config("16B", "bf16")


def deepseek_v3_16b_converted() -> MoEQuantTrainerConfig:
    return _config("16B", "converted")


def deepseek_v3_16b_mxfp8() -> MoEQuantTrainerConfig:
    return _config("16B", "mxfp8")


def deepseek_v3_16b_mxfp8_sync_free() -> MoEQuantTrainerConfig:
    return _config("16B", "mxfp8_sync_free")


def deepseek_v3_debug_bf16() -> MoEQuantTrainerConfig:
    return _config("debugmodel", "bf16")


def deepseek_v3_debug_converted() -> MoEQuantTrainerConfig:
    return _config("debugmodel", "converted")


def deepseek_v3_debug_mxfp8() -> MoEQuantTrainerConfig:
    return _config("debugmodel", "mxfp8")


def deepseek_v3_debug_mxfp8_sync_free() -> MoEQuantTrainerConfig:
    return _config("debugmodel", "mxfp8_sync_free")
