"""The one-GPU trainer of ``examples/titan`` trains in bf16 compute with fp32 master weights, as on several GPUs
(issue 54): torchtitan 0.3.0 builds FSDP2 over its one-rank ``fsdp`` mesh for the mixed precision, and the configs'
function for torch < 2.12 (the GPU machines' 2.11) must too.

One gloo rank per job (``tests/titan_precision_ranks.py``): the debug flavour built on the meta device, parallelized
as the trainer does with torchtitan's default ``TrainingConfig`` (fp32 parameters, bf16 compute), then one forward
and backward; forward pre-hooks record what the attention, the dense feed-forward and the routed experts receive.
"""

from __future__ import annotations

import pytest
from ep_ranks import run_session
from titan_checks import NEEDS_GLOO  # its import: the placeholder torch 2.11 needs, skips without torchtitan

from examples.titan.parallelize import torch_has_per_param_fsdp_mesh

FNS = ["fallback"] + (["torchtitan"] if torch_has_per_param_fsdp_mesh() else [])
JOBS = [(variant, fn) for fn in FNS for variant in ("bf16", "converted")]


@pytest.fixture(scope="module")
def one_rank():
    results = run_session(1, [("titan_precision", {"variant": v, "fn": fn}) for v, fn in JOBS], timeout_s=300.0)
    return dict(zip(JOBS, results[0]))


@NEEDS_GLOO
@pytest.mark.parametrize("variant,fn", JOBS)
def test_one_rank_job_computes_in_bf16_with_fp32_master_weights(one_rank, variant, fn):
    res = one_rank[(variant, fn)]
    assert set(res["seen"]) == {"attention", "feed_forward", "experts"}, res  # precondition: every hook ran
    for name, dtypes in res["seen"].items():
        assert dtypes == ["torch.bfloat16"], (name, res)  # inputs (and the experts' weights) in bf16
    assert res["master_dtypes"] == ["torch.float32"] and res["grad_dtypes"] == ["torch.float32"], res


@NEEDS_GLOO
@pytest.mark.parametrize("variant,fn", JOBS)
def test_one_rank_gradients_are_not_divided(one_rank, variant, fn):
    """FSDP over one rank copies its flat fp32 gradients to the output unchanged: no division pass (by torchtitan's
    factor 1.0) over them, which costs a 4-layer DeepSeek-V3 16B step on one H200 4.3 ms."""
    ops = one_rank[(variant, fn)]["flat_ops"]
    assert ops.get("aten.copy_", 0) > 0, ops  # precondition: the recorder saw FSDP's one-rank reduction
    assert not any("div" in name for name in ops), ops
