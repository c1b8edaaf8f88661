"""Ranks launched with different moe_quant converter settings all raise the same error (issue 31), also with
``converter_config(dispatcher=False)``, where torchtitan's own dispatcher runs and no handshake of moe_quant's.

Where: torchtitan runs a model converter's ``convert`` when the config is made, before ``init_distributed``; the
first moe_quant code every rank runs with the process group up, for the same modules in the same order, is the
converted experts' ``parallelize`` (torchtitan's ``Module.parallelize``, which its trainer's ``parallelize_fn``
calls: always with the ``full_dtensor`` / ``spmd_types`` backends, with TP or EP under ``partial_dtensor``).
There, once per experts module, the ranks exchange their settings (``moe_quant.conversion.ranks``).

2 gloo CPU ranks (``tests/titan_settings_ranks.py``): torchtitan's DeepSeek-V3 debug config cut to 3 blocks (2
MoE), converted with each rank's settings, built on the meta device and parallelized with EP over both ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from ep_ranks import run_session
from titan_checks import NEEDS_GLOO  # its import: the placeholder torch 2.11 needs, skips without torchtitan

from moe_quant.conversion import ranks
FLOOR = {"scale_mode": "floor"}
OFF = {"dispatcher": False}
JOBS = {  # name: (rank 0's converter_config arguments, rank 1's, extra job arguments)
    "equal_experts_only": (OFF, {**OFF, "wire": "bf16", "capacity_factor": 2.0}, {}),  # unused settings differ
    "equal_ours": ({}, {}, {}),
    "scale_mode_experts_only": (OFF, {**OFF, **FLOOR}, {}),
    "scale_mode_ours": ({}, FLOOR, {}),
    "dispatcher": ({}, OFF, {}),
    "pipeline_ep": (OFF, {**OFF, **FLOOR}, {"pipeline": "ep"}),
    "pipeline_no_ep": (OFF, {**OFF, **FLOOR}, {"pipeline": "no_ep"}),
}
MESSAGE_END = ("Launch every rank with the same moe_quant settings (torchtitan: the same MXFP8MoEConverter / "
               "converter_config arguments; quantize_: the same MXFP8MoEConfig). Checked when the model is "
               "parallelized, before any token is sent")


@pytest.fixture(scope="module")
def two_ranks():
    names = list(JOBS)
    jobs = [("titan_settings", {"settings": [JOBS[n][0], JOBS[n][1]], **JOBS[n][2]}) for n in names]
    results = run_session(2, jobs, timeout_s=240.0)  # never hangs: ranks still running then are terminated
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(names)}


def _same_error(res) -> str:
    errors = [r["error"] for r in res]
    assert all(e is not None and e["type"] == "ValueError" for e in errors), res
    assert errors[0]["message"] == errors[1]["message"], res
    assert all(r["all_gather_object_calls"] == 1 and r["seconds"] < 30 for r in res), res  # the first MoE block
    return errors[0]["message"]


@NEEDS_GLOO
@pytest.mark.parametrize("name", ["equal_experts_only", "equal_ours"])
def test_equal_settings_pass_one_exchange_per_moe_block(two_ranks, name):
    res = two_ranks[name]
    assert all(r["error"] is None and r["all_gather_object_calls"] == 2 for r in res), res


@NEEDS_GLOO
@pytest.mark.parametrize("name", ["scale_mode_experts_only", "scale_mode_ours", "pipeline_ep"])
def test_another_scale_mode_all_ranks_raise_the_same_error(two_ranks, name):
    """torchtitan's dispatcher (``dispatcher=False``: no other check), moe_quant's (this check runs before its
    handshake), and under pipeline parallelism over the EP group."""
    message = _same_error(two_ranks[name])
    assert message == ("moe_quant: ranks disagree on the converted experts' settings (rank 0: scale_mode='rceil'; "
                       f"rank 1: scale_mode='floor'). {MESSAGE_END}")


@NEEDS_GLOO
def test_another_dispatcher_choice_all_ranks_raise_the_same_error(two_ranks):
    """Otherwise the rank with moe_quant's dispatcher would wait in its handshake for a peer that never comes."""
    message = _same_error(two_ranks["dispatcher"])
    assert ("(rank 0: dispatcher=True, wire='mxfp8', capacity_factor=None, overflow='error', max_tokens=None; "
            "rank 1: dispatcher=False)") in message


@NEEDS_GLOO
def test_pipeline_without_ep_has_no_group_to_compare(two_ranks):
    """Pipeline stages hold different blocks: without EP no group parallelizes the same modules; no exchange."""
    res = two_ranks["pipeline_no_ep"]
    assert all(r["error"] is None and r["all_gather_object_calls"] == 0 for r in res), res


def _converted_experts(**settings):
    import torch
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3 import model_registry

    from moe_quant.ep.titan import converter_config

    cfg = model_registry("debugmodel", converters=[converter_config(**settings)]).model
    cfg = dataclasses.replace(cfg, layers=cfg.layers[:2], mtp_layers=[])
    with torch.device("meta"):
        model = cfg.build()
    (experts,) = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    return experts


@pytest.mark.parametrize("world", [None, 1])
def test_no_exchange_without_a_process_group_or_on_one_rank(monkeypatch, world):
    """Not initialized (this process), or a world of one rank: ``parallelize`` exchanges nothing."""
    experts = _converted_experts(scale_mode="floor", dispatcher=False)
    assert ranks.settings(experts)["scale_mode"] == "floor" and ranks.settings(experts)["dispatcher"] is False

    def collective(*args, **kwargs):
        raise AssertionError("a collective ran")

    monkeypatch.setattr(dist, "all_gather_object", collective)
    if world is not None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    else:
        assert not dist.is_initialized()
    experts.parallelize(object())  # no sharding config: torchtitan's parallelize does nothing else here
    assert experts._parallelized


def test_diagnose_names_only_the_differing_settings_ranks_grouped():
    a = {"scale_mode": "rceil", "backend": "auto", "dispatcher": False}
    b = {**a, "scale_mode": "floor"}
    assert ranks.diagnose([(0, a), (1, dict(a)), (2, a)]) is None
    message = ranks.diagnose([(0, a), (1, b), (2, a), (3, {"scale_mode": "rceil", "backend": "auto"})])
    assert message.startswith("moe_quant: ranks disagree on the converted experts' settings (ranks 0, 2: "
                              "scale_mode='rceil', dispatcher=False; rank 1: scale_mode='floor', dispatcher=False; "
                              "rank 3: scale_mode='rceil'). Launch every rank"), message
