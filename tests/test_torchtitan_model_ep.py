"""torchtitan 0.3.0's own training stack with moe_quant's model converter, EP=2 over 2 gloo ranks, compiled.

What a torchtitan user does: ``model_registry("debugmodel", converters=[converter_config()])`` (DeepSeek-V3,
cut to its first 2 blocks: one dense, one MoE with 8 experts, top-3), then the trainer's set-up:
``update_from_config`` with a ``ParallelismConfig`` (FSDP over both ranks, ``expert_parallel_degree=2``),
the model built on the meta device, torchtitan's ``parallelize_deepseekv3`` (``Module.parallelize``:
expert weights sharded over the EP mesh and ``wire_meshes`` of moe_quant's dispatcher; ``apply_compile``:
``torch.compile(fullgraph=True)`` of each block, here with ``backend="aot_eager"``; FSDP2), the weights
loaded from one full state dict, and two steps of the trainer's ``train_step`` (forward and backward in
its SPMD context, its cross-entropy loss over the global valid tokens, gradient clipping, its AdamW
optimizer container with the MoE load-balancing hook). Jobs: ``tests/titan_model_ranks.py``.

Substituted on this CPU machine, and why:

* torchtitan chooses its device type at import (``"cuda"`` when no accelerator is present) and builds
  its meshes with it: ``torchtitan.distributed.parallel_dims.device_type`` is set to ``"cpu"`` (gloo).
* ``spmd_backend="partial_dtensor"`` instead of the default ``"spmd_types"``: with the default, FSDP2 of
  this torch (2.13) rejects torchtitan's own (unconverted) model (``When dp_mesh_dims is provided, all
  parameters must be DTensors``). ``partial_dtensor`` is one of torchtitan's three backends and runs the
  same ``Module.parallelize`` / EP / compile / FSDP code.
* Attention: ``ScaledDotProductAttention`` (causal) instead of flex attention, whose backward is not
  implemented on the CPU (``FlexAttention does not support backward on CPU``); varlen needs CUDA.
* FSDP's reduce-scatter uses ``ReduceOp.PREMUL_SUM`` for torchtitan's gradient divide factor 1.0, which
  gloo lacks: every FSDP module is set to ``set_force_sum_reduction_for_comms(True)`` (plain SUM, then a
  division by 1.0: the same values), as torchtitan's own symmetric-memory option does.
* The trainer itself (``Trainer``) is not instantiated: it needs a tokenizer, a dataset and a CUDA device.
  Its steps are reproduced from its source; the loss is its ``CrossEntropyLoss`` without the
  ``ChunkedLossWrapper`` of the debug config (which only chunks the output projection and the loss), the
  optimizer its ``default_adamw(lr=8e-4)`` with the ``foreach`` implementation (``fused`` is CUDA only),
  no learning-rate schedule, no activation checkpointing.
"""

from __future__ import annotations

import math
import os

import pytest
import torch.distributed as dist

pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan not importable")
from ep_ranks import BackgroundSession  # noqa: E402


def _torch_has_fsdp_mesh_dims() -> bool:
    """torchtitan's FSDP path uses ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.11 lacks it;
    ``tests/test_torchtitan.py`` puts a placeholder there for its single-process runs, not torch's own)."""
    import torch.distributed.fsdp as fsdp

    return getattr(getattr(fsdp, "DataParallelMeshDims", None), "__module__", "").startswith("torch.")


pytestmark = [pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="needs torch.distributed with gloo"),
              pytest.mark.skipif(not _torch_has_fsdp_mesh_dims(),
                                 reason="torch lacks torch.distributed.fsdp.DataParallelMeshDims (torchtitan's FSDP)")]

STEPS = 2
# compiled jobs first: as in torchtitan, the blocks are compiled before any eager call in the process
JOBS = {
    "ep2_compiled": {"ep": 2, "compiled": True},
    # sync-free dispatcher through the converter, compiled before any eager step: the bound is max_tokens
    "ep2_sync_free_compiled": {"ep": 2, "compiled": True, "capacity_factor": 2.0, "max_tokens": 64},
    "ep2_eager": {"ep": 2, "compiled": False},
    "ep_off_eager": {"ep": 1, "compiled": False},
    "bf16_ep2_eager": {"ep": 2, "compiled": False, "convert": False},  # torchtitan's own dispatcher, bf16
}


def _jobs(folder: str) -> list:
    state = os.path.join(folder, "state.pt")
    return [("titan_model_state", {"path": state})] + [("titan_model", {**JOBS[n], "state_path": state}) for n in JOBS]


_SESSION = BackgroundSession(2, _jobs)
start_in_background, stop_background = _SESSION.start, _SESSION.stop  # the session starts at collection


@pytest.fixture(scope="module")
def titan_model():
    results = _SESSION.results(timeout_s=900.0)
    return {name: [results[r][i + 1] for r in range(2)] for i, name in enumerate(JOBS)}


def test_converted_experts_run_mxfp8_behind_our_dispatcher(titan_model):
    """The converter gave the MoE layer moe_quant's dispatcher (EP over both ranks, or local with EP off)
    and converted experts; eagerly each step ran the 3 MXFP8 GEMMs of the layer's forward (EP: the
    per-GEMM path, which reuses the MXFP8 the dispatch received; EP off: the fused block), none fell back."""
    for job, ep_size in (("ep2_eager", 2), ("ep2_compiled", 2), ("ep_off_eager", 1), ("ep2_sync_free_compiled", 2)):
        for r in titan_model[job]:
            assert r["ours"] == [True] and r["ep_sizes"] == [ep_size] and r["converted"] == [True], (job, r)
            assert r["fallbacks"] == 0, (job, r)
            if "compiled" not in job:
                assert r["gemm_calls"] == [3] * STEPS, (job, r["gemm_calls"])
    for r in titan_model["bf16_ep2_eager"]:  # the reference: torchtitan's own dispatcher and bf16 experts
        assert r["ours"] == [False] and r["converted"] == [False] and r["gemm_calls"] == [0] * STEPS, r


def test_losses_finite(titan_model):
    for job, ranks in titan_model.items():
        for r in ranks:
            assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"]), (job, r["losses"])


def test_compiled_equals_eager_bit_for_bit_without_a_retrace(titan_model):
    """torchtitan's per-block compile (aot_eager, fullgraph) gives the eager losses bit for bit on both
    steps (the second step's loss depends on the first step's gradients and optimizer step); the second
    step compiles nothing new (no retrace of a block)."""
    for job in ("ep2_compiled", "ep2_sync_free_compiled"):
        for comp, eager in zip(titan_model[job], titan_model["ep2_eager"]):
            assert comp["loss_bits"] == eager["loss_bits"], (job, comp["losses"], eager["losses"])
            assert comp["graphs"][0] > 0 and comp["graphs"][-1] == comp["graphs"][0], (job, comp["graphs"])


def test_sync_free_dispatcher_in_torchtitan_nothing_overflowing(titan_model):
    for r in titan_model["ep2_sync_free_compiled"]:
        assert r["overflow"] == [0], r


def test_ep_equals_ep_off(titan_model):
    """Same global batch, EP=2 vs EP off (each rank runs its tokens through all 8 experts). The first
    step's loss is bit-identical (forward: the same rows quantized the same way reach the same experts).
    The second differs by quantization noise of the expert weight gradients: under EP an expert's 32x1
    blocks along tokens mix both ranks' tokens in one GEMM, with EP off each rank quantizes its own and
    FSDP sums the two. Measured: relative difference 8e-7 and 4e-6 on the two ranks; bound 1e-4."""
    for ep, off in zip(titan_model["ep2_eager"], titan_model["ep_off_eager"]):
        assert ep["loss_bits"][0] == off["loss_bits"][0], (ep["losses"], off["losses"])
        for a, b in zip(ep["losses"][1:], off["losses"][1:]):
            assert abs(a - b) <= 1e-4 * abs(b), (ep["losses"], off["losses"])


def test_mxfp8_close_to_bf16(titan_model):
    """Against torchtitan's own bf16 stack (its all-to-all dispatcher, unconverted experts): different
    (MXFP8 numerics ran), within 1%."""
    for mx, bf16 in zip(titan_model["ep2_eager"], titan_model["bf16_ep2_eager"]):
        assert mx["losses"][0] != bf16["losses"][0]
        for a, b in zip(mx["losses"], bf16["losses"]):
            assert abs(a - b) <= 0.01 * abs(b), (mx["losses"], bf16["losses"])
