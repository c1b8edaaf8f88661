"""torchtitan's own trainer with the configs of ``examples/titan`` on 2 gloo CPU ranks, launched as users launch it.

``python -m examples.titan.checks`` (the GPU check script, here at debug size: DeepSeek-V3 debugmodel cut to 2
blocks, 5 steps of 2 x 32 tokens per rank) runs ``torchrun --nproc_per_node 2 -m examples.titan.launch --module
examples.titan.config_registry --config deepseek_v3_debug_<variant>`` (``examples.titan.launch`` is
``torchtitan.train.main()`` after the shims a released torch lacks) with FSDP and expert parallelism over both
ranks, torchtitan's DCP checkpoints, and checks: a job resumed from the step-2 checkpoint equals the uninterrupted
one bit for bit; ranks launched with another ``scale_mode`` all exit with the same error (moe_quant's dispatcher,
and torchtitan's: ``converted``).
``tests/test_titan_trainer_faults.py`` reads the fault and cross-loading checks of the same run (one run of every
check, ``titan_checks.all_checks``: 7 jobs and two mismatch launches, about 160 s). The torchrun jobs of both
modules run behind the other tests of the session (``titan_checks.JOBS``: started at collection, read by these
tests, which run last). The other tests here cover the pieces in-process.

Substituted on this CPU machine (each through a torchtitan option or the smallest hook; none on CUDA):

* device: torchtitan picks ``"cuda"`` where no accelerator exists; ``examples.titan.launch`` sets its device type
  to ``"cpu"`` (gloo process groups) with a CPU device module (no memory statistics);
* attention: causal SDPA for flex (no flex backward on the CPU): the configs' ``--moe_quant.attention auto``;
* gradient reduce-scatter: ``set_force_sum_reduction_for_comms(True)`` on gloo (no ``PREMUL_SUM``), in the
  configs' ``parallelize_fn`` (``examples/titan/parallelize.py``), exact for torchtitan's divide factor 1.0;
* compute dtype: fp32 (``--training.mixed_precision_param float32``; torchtitan's default bf16 matmuls take the
  CPU's scalar fallback GEMM where it lacks AVX512-BF16, see ``tests/titan_checks.py``);
* the optimizer: torchtitan's default ``fused`` AdamW runs on the CPU as it is (nothing substituted).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.distributed as dist
from process_checks import gone, wait_until
from repo_subprocess import run_python
from titan_checks import (CPU_COMPUTE, JOB_TIMEOUT, JOBS, NEEDS_GLOO, SAVE_AT, STEPS, WAIT, all_checks, assert_all_passed,
                          checks_argv, checks_result, submit, submit_all_checks)

from examples.titan import runs

pytestmark = [NEEDS_GLOO, pytest.mark.usefixtures("warm_torchrun")]  # torchrun's ranks warm: conftest

SHORT_JOB = (*CPU_COMPUTE, "--training.steps", "3", "--metrics.log_freq", "1")  # a 3-step job of the debug model
WIRE_VARIANTS = {"mxfp8": 7, "converted": 5}  # the slow wire test's variants: EP exchanges per MoE layer and step


def _trainer_job(variant: str, *args):
    """``make(folder)`` of a 2-rank torchtitan job of the debug model (``SHORT_JOB`` and ``args``), dump ``folder``."""
    return lambda out: (runs.torchrun(2, runs.trainer_args("debugmodel", variant, str(out), (*SHORT_JOB, *args))),
                        JOB_TIMEOUT)


_MAKE = {  # the torchrun jobs of this module's tests (titan_checks.JOBS' keys)
    "resume_compiled": lambda out: (checks_argv(out, "--variants", "mxfp8", "--checks", "resume", "--modes", "compiled",
                                                job_args=("--compile.backend", "aot_eager")), 1200.0),
    **{f"plain_{v}": _trainer_job(v) for v in WIRE_VARIANTS},
    **{f"held_{v}": _trainer_job(v, "--moe_quant.wire_gbps", "50") for v in WIRE_VARIANTS},
    **{f"ac_{ac}": _trainer_job("mxfp8", f"activation-checkpoint:{ac}") for ac in ("selective", "full")},
    "plain_loop": lambda out: ([sys.executable, "-m", "examples.titan.plain_loop", "--dump-folder", out, "--flavor",
                                "debugmodel", "--layers", "2", "--steps", "2", "--local-batch-size", "1", "--seq-len",
                                "16", "--profile"], 600.0),
}
_READS = {  # test -> the jobs it reads, in the order of the tests in this file ("all": titan_checks.all_checks)
    "test_every_check_passes": ["all"],
    "test_resumed_job_equals_the_uninterrupted_one_bit_for_bit": ["all"],
    "test_the_trainer_built_moe_quant_behind_fsdp_and_ep": ["all"],
    "test_ranks_with_another_scale_mode_all_raise_the_same_error": ["all"],
    "test_resume_under_torchtitans_compile_equals_the_uninterrupted_job": ["resume_compiled"],
    "test_the_slow_wire_holds_every_ep_exchange_of_the_trainer": [f"{k}_{v}" for v in WIRE_VARIANTS
                                                                  for k in ("held", "plain")],
    "test_plain_loop_trains_the_bf16_model_in_bf16": ["plain_loop"],
    "test_activation_checkpointing_trains_the_same_steps": ["plain_mxfp8", "ac_selective", "ac_full"],
}


def _submit(test: str) -> None:
    for key in _READS[test]:
        if key == "all":
            submit_all_checks()
        else:
            submit(key, _MAKE[key])


def start_in_background(selected) -> None:
    """The torchrun jobs of the selected tests start now, behind the other tests (``tests/conftest.py``)."""
    for test in _READS:
        if test in selected:
            _submit(test)


def stop_background() -> None:
    JOBS.stop()


def _job(key: str, test: str):
    """The dump folder and result of ``JOBS``' ``key`` (queued now where ``test``'s jobs were not), which passed."""
    _submit(test)
    job = JOBS.result(key, WAIT)
    assert job.rc == 0, job.tail()
    return JOBS.folder(key), job


def _plain_job(variant: str, test: str):
    """The dump folder of the variant's 3-step job (``SHORT_JOB``: EP and FSDP over 2 gloo ranks, the real wire, no
    activation checkpointing): the reference of the slow wire test and of the activation checkpointing test alike
    (one torchrun job for both)."""
    dump, job = _job(f"plain_{variant}", test)
    assert "activation checkpointing" not in job.log.read_text(encoding="utf-8")  # none: the default
    return dump


@pytest.fixture(scope="module")
def checks():
    return all_checks()


def test_every_check_passes(checks):
    assert_all_passed(checks, [("mismatch", "mxfp8"), ("mismatch", "converted"), ("resume", "mxfp8")])


def test_resumed_job_equals_the_uninterrupted_one_bit_for_bit(checks):
    c = checks["by"][("resume", "mxfp8")]
    ref, resumed = c["reference"], c["resumed"]
    for rank in ("0", "1"):
        want = {int(s): v for s, v in ref[rank].items()}
        got = {int(s): v for s, v in resumed[rank].items()}
        assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
        assert all(got[s] == want[s] for s in got), (got, want)
        assert len(set(want.values())) == STEPS  # the steps trained (every loss differs)
    assert ref["0"] == ref["1"]  # torchtitan logs the global average loss on every rank


def test_the_trainer_built_moe_quant_behind_fsdp_and_ep(checks):
    """What the reference job built (``setup/rank<r>.json``) and logged (``metrics/rank<r>.jsonl``)."""
    out = checks["out"]
    for rank in (0, 1):
        setup = json.loads((out / "ref_mxfp8_eager" / "setup" / f"rank{rank}.json").read_text())
        assert setup["experts_converted"] == [True] and setup["dispatchers"] == ["TitanMXFP8TokenDispatcher"]
        assert setup["experts_dswiglu_cols_fp8"] == [False]
        assert setup["ep_sizes"] == [2] and setup["dispatcher_settings"][0]["wire"] == "mxfp8"
        assert setup["fsdp_modules"] >= 4 and setup["force_sum_modules"] == setup["fsdp_modules"]
        assert setup["attention"] == ["ScaledDotProductAttention"] and "cpu device" in setup["launcher_shims"]
        rows = [json.loads(line) for line in (out / "ref_mxfp8_eager" / "metrics" / f"rank{rank}.jsonl").open()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert all(r["moe_quant/fallbacks"] == 0 and math.isfinite(r["loss_metrics/global_avg_loss"]) for r in rows)


@pytest.mark.parametrize("variant", ["mxfp8", "converted"])
def test_ranks_with_another_scale_mode_all_raise_the_same_error(checks, variant):
    """moe_quant's settings check when the trainer parallelizes the model, with moe_quant's dispatcher and with
    torchtitan's (``converted``: nothing else would compare the ranks' settings)."""
    c = checks["by"][("mismatch", variant)]
    assert all(rc not in (0, None) for rc in c["exit_codes"]), c
    (message,) = {m[0] for m in c["messages"]}
    assert message.startswith("moe_quant: ranks disagree on the converted experts' settings (rank 0: "
                              "scale_mode='rceil'; rank 1: scale_mode='floor')"), message
    assert max(c["seconds"]) < 240 and not any(c["hang_words"]), c


def test_resume_under_torchtitans_compile_equals_the_uninterrupted_job():
    """The resume check with torchtitan's compile option (``--compile.enable``: its per-block ``torch.compile``,
    here with the ``aot_eager`` backend, which needs no C++ compiler): the steps after resuming from the
    checkpoint equal the uninterrupted compiled job's bit for bit, on both ranks."""
    _submit("test_resume_under_torchtitans_compile_equals_the_uninterrupted_job")
    c = checks_result("resume_compiled")
    (check,) = c["report"]["checks"]
    assert (check["check"], check["variant"], check["mode"]) == ("resume", "mxfp8", "compiled"), check
    assert check["passed"] and c["job"].rc == 0, json.dumps(check, indent=1)[-6000:]
    for rank in (0, 1):  # the precondition: the blocks were compiled, with moe_quant's experts and dispatcher
        setup = json.loads((c["out"] / "ref_mxfp8_compiled" / "setup" / f"rank{rank}.json").read_text())
        assert setup["compiled_blocks"] >= 2 and setup["compile_backend"] == "aot_eager", setup
        assert setup["experts_converted"] == [True] and setup["dispatchers"] == ["TitanMXFP8TokenDispatcher"]
    got = {int(s): v for s, v in check["resumed"]["0"].items()}
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))


@pytest.mark.parametrize("variant, per_layer", list(WIRE_VARIANTS.items()))
def test_the_slow_wire_holds_every_ep_exchange_of_the_trainer(variant, per_layer):
    """``--moe_quant.wire_gbps 50``: every EP all-to-all of the trainer goes through the emulated wire
    (``benchmarks.slow_wire.HeldExchanges``), moe_quant's dispatcher (``mxfp8``: counts, dispatch data and scales,
    combine; backward: the combine's gradient data and scales, the dispatch's: 7 per MoE layer and step) and
    torchtitan's (``converted``: counts, dispatch, combine and the two backward legs: 5) alike; the setup records
    the wire, and the losses equal the job on the real wire bit for bit (on gloo the held exchange is the same
    exchange: only the GPU's emulated transfer time differs)."""
    steps = 3  # SHORT_JOB's
    test = "test_the_slow_wire_holds_every_ep_exchange_of_the_trainer"
    dumps = {"held": _job(f"held_{variant}", test)[0], "plain": _plain_job(variant, test)}
    setup = runs.setup(str(dumps["held"]))
    moe_layers = len(setup[0]["dispatchers"])
    assert moe_layers >= 1 and all(s["wire_gbps"] == 50.0 for s in setup.values()), setup
    assert all(s["wire_gbps"] is None for s in runs.setup(str(dumps["plain"])).values())
    for rank, rows in runs.metrics(str(dumps["held"])).items():
        counts = [row["moe_quant/wire_exchanges"] for row in rows]  # so far (step 1: and moe_quant's handshakes)
        assert len(counts) == steps and counts[0] >= per_layer * moe_layers, (rank, counts)
        assert [b - a for a, b in zip(counts, counts[1:])] == [per_layer * moe_layers] * (steps - 1), (rank, counts)
        assert rows[-1]["moe_quant/wire_bytes"] > 0
    assert runs.losses(str(dumps["held"])) == runs.losses(str(dumps["plain"]))


# -- the pieces, in-process ------------------------------------------------------------------------------------


def test_affine_stream_is_the_same_for_any_rank_count():
    """Rank r of W at batch k holds sequences (k W + r) B ..: the global batch of step k is the stream's next W B
    sequences for any W, every sequence follows its recurrence, and the state a checkpoint keeps is k."""
    from examples.titan.data import AffineDataLoader, AffineTokenizer, affine_sequences

    tok = AffineTokenizer.Config(vocab_size=97).build(tokenizer_path="")
    assert tok.decode(tok.encode("3 5 96")) == "3 5 96" and tok.get_vocab_size() == 97

    def loader(world, rank, batch):
        return AffineDataLoader.Config(seed=3).build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=16,
                                                     local_batch_size=batch)

    one = iter(loader(1, 0, 4))
    two = [iter(loader(2, r, 2)) for r in range(2)]
    for _ in range(3):
        (x1, y1), parts = next(one), [next(it) for it in two]
        assert torch.equal(x1["input"], torch.cat([p[0]["input"] for p in parts]))
        assert torch.equal(y1, torch.cat([p[1] for p in parts]))
        assert torch.equal(x1["input"][:, 1:], y1[:, :-1])
        assert torch.equal(x1["positions"][0], torch.arange(16))
    seqs = affine_sequences(0, 8, 20, 97, 3)
    for s in seqs.tolist():  # every sequence: x[t+1] = (a x[t] + b) mod vocab for one (a, b)
        assert any(all((a * s[t] + b) % 97 == s[t + 1] for t in range(19)) for a in range(1, 8) for b in range(8)), s
    assert len({tuple(s) for s in seqs.tolist()}) == 8

    dl = loader(2, 1, 2)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    assert state == {"dp_rank_1": 2, "world_size": 2}
    fresh = loader(2, 1, 2)
    fresh.load_state_dict(state)
    assert torch.equal(next(iter(fresh))[1], next(it)[1])
    with pytest.raises(ValueError, match="written by 2 data-parallel ranks, this job has 4"):
        loader(4, 1, 2).load_state_dict({"dp_rank_1": 2, "world_size": 2})
    with pytest.raises(ValueError, match="dp_rank must be in"):
        loader(2, 2, 2)


def test_config_functions_and_the_moe_quant_section(monkeypatch, capsys):
    """torchtitan's ConfigManager (what ``--module/--config`` and the command line go through)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from moe_quant.ep.titan import dispatcher_config_class

    monkeypatch.setenv("WORLD_SIZE", "2")

    def parse(name, *args):
        return ConfigManager().parse_args(["--module", "examples.titan.config_registry", "--config", name, *args])

    def routed(cfg):
        return [c for _, c, _, _ in cfg.model_spec.model.traverse(RoutedExperts.Config)]

    bf16 = parse("deepseek_v3_16b_bf16")
    assert bf16.parallelism.expert_parallel_degree == 2 and bf16.parallelism.data_parallel_shard_degree == -1
    assert bf16.training.local_batch_size * bf16.training.seq_len == 16384 and bf16.training.steps == 100
    assert (bf16.training.mixed_precision_param, bf16.training.mixed_precision_reduce) == ("bfloat16", "float32")
    assert len(bf16.model_spec.model.layers) == 4 and bf16.model_spec.model.mtp_layers == []
    assert all(type(r.inner_experts) is GroupedExperts.Config and type(r.token_dispatcher) is
               AllToAllTokenDispatcher.Config for r in routed(bf16))
    conv = parse("deepseek_v3_16b_converted", "--moe_quant.layers", "3", "--parallelism.expert_parallel_degree", "4")
    assert len(conv.model_spec.model.layers) == 3 and len(routed(conv)) == 2
    assert all(type(r)._mxfp8_parent is RoutedExperts.Config and type(r.inner_experts) is GroupedExperts.Config and
               type(r.token_dispatcher) is AllToAllTokenDispatcher.Config for r in routed(conv))
    free = parse("deepseek_v3_debug_mxfp8_sync_free", "--training.seq_len", "64")
    (d,) = [r.token_dispatcher for r in routed(free)]
    assert type(d) is dispatcher_config_class() and (d.capacity_factor, d.max_tokens) == (2.0, 2 * 64)
    assert parse("deepseek_v3_debug_mxfp8", "--moe_quant.variant", "bf16").moe_quant.variant == "bf16"
    assert not any(r.dswiglu_cols_fp8 for r in routed(conv))  # the experts' MXFP8MoEConfig switch: off unless asked
    for variant in ("converted", "mxfp8", "mxfp8_sync_free"):
        on = parse(f"deepseek_v3_debug_{variant}", "--moe_quant.dswiglu_cols_fp8")
        assert on.moe_quant.dswiglu_cols_fp8 and routed(on) and all(r.dswiglu_cols_fp8 for r in routed(on))
    with pytest.raises(SystemExit):  # tyro reports the config's ValueError and exits
        parse("deepseek_v3_16b_mxfp8", "--moe_quant.layers", "28")
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro's box, wrapped
    assert "moe_quant.layers must be in [1, 27] for 16B, got 28" in err


def test_cuda_graphs_are_allowed_for_the_sync_free_dispatcher_only(monkeypatch):
    """torchtitan captures a step in a CUDA graph (``disable_cuda_graphs=False``) only where no token dispatcher
    reads the host: its own check names its own dispatchers; the configs' add moe_quant's sync-free one, and leave
    every other (moe_quant's synced one, torchtitan's all-to-all) to torchtitan's ``ValueError``."""
    from torchtitan.config import ConfigManager

    monkeypatch.setenv("WORLD_SIZE", "2")

    def parse(name, *args):
        return ConfigManager().parse_args(["--module", "examples.titan.config_registry", "--config", name, *args])

    free = parse("deepseek_v3_debug_mxfp8_sync_free", "--training.no-disable_cuda_graphs")
    assert free.training.disable_cuda_graphs is False
    free._validate_cuda_graphs()  # what the trainer calls again when it starts
    for name in ("deepseek_v3_debug_mxfp8", "deepseek_v3_debug_converted"):
        cfg = parse(name)
        cfg.training.disable_cuda_graphs = False
        with pytest.raises(ValueError, match="without CPU synchronization"):
            cfg._validate_cuda_graphs()


def test_memory_cap_option(monkeypatch, capsys):
    """``--moe_quant.memory_gib``: the allocator fraction it stands for, refused with the option's name where it
    cannot hold (no CUDA here; a cap above the GPU's memory; not a positive number), and applied to the rank's own
    device (``LOCAL_RANK``) where CUDA is."""
    from torchtitan.config import ConfigManager

    from examples.titan import config_registry as reg

    assert reg.memory_fraction(76, 152 * 2**30) == 0.5 and reg.memory_fraction(1.5, 3 * 2**30) == 0.5
    for bad in (0, -1.0, 153, True, "76"):
        with pytest.raises(ValueError, match=r"moe_quant.memory_gib must be a number of GiB in \(0, 152.0\]"):
            reg.memory_fraction(bad, 152 * 2**30)
    assert reg.cap_allocator(None) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="moe_quant.memory_gib caps the CUDA allocator, but this machine has no CUDA"):
        reg.cap_allocator(76.0)
    with pytest.raises(SystemExit):  # through the command line: tyro reports the ValueError
        ConfigManager().parse_args(["--module", "examples.titan.config_registry", "--config", "deepseek_v3_16b_mxfp8",
                                    "--moe_quant.memory_gib", "76"])
    assert "moe_quant.memory_gib caps the CUDA allocator" in " ".join(capsys.readouterr().err.replace("│", " ").split())
    # with CUDA (a stand-in): the fraction goes to LOCAL_RANK's device, made current first
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 160 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(("fraction", f, d)))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert reg.cap_allocator(80) == 0.5 and calls == [("device", 3), ("fraction", 0.5, 3)]


def test_bench_peak_device_memory_adds_what_the_allocator_does_not_hold(tmp_path):
    """The bench's peak device memory: the largest ``max_reserved`` + ``outside_allocator`` of a step over steps
    and ranks (the two peak at different steps here: the sum of the maxima would be wrong), absent where the
    metrics lack the outside figure (the CPU, older runs); the allocator's retries: torchtitan's cumulative count
    of the last step, the most of the ranks."""
    from types import SimpleNamespace

    from examples.titan import bench

    out = bench.OUTSIDE
    rows = {0: [(10.0, 2.0), (12.0, 0.5), (11.0, 1.0)], 1: [(9.0, 3.5), (11.5, 1.0)]}
    (tmp_path / "metrics").mkdir()
    for r, steps in rows.items():
        lines = [{"step": i + 1, "throughput(tps)": 1.0, "time_metrics/end_to_end(s)": 1.0, "loss_metrics/global_avg_loss":
                  5.0, "memory/max_reserved(GiB)": res, "memory/max_active(GiB)": res - 1.0, out: o,
                  bench.RETRIES: 3 * i + r}
                 for i, (res, o) in enumerate(steps)]
        (tmp_path / "metrics" / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = SimpleNamespace(warmup=0, steps=3, profile=False, tail=1, layers=2)
    res = bench.summarize(args, "bf16", "eager", str(tmp_path), SimpleNamespace(rc=0, seconds=1.0, log="x"))
    assert res["peak_reserved_gib"] == {0: 12.0, 1: 11.5} and res["peak_device_gib"] == {0: 12.5, 1: 12.5}
    record = {"torch": "2.99", "nproc": 2, "flavor": "16B", "layers": 2, "steps": 3, "warmup": 0, "tail": 1,
              "device": "Some GPU", "results": [res | {"variant": "bf16"}]}
    assert res["alloc_retries"] == 6  # cumulative: the last step's, the most of the ranks
    assert "| 11.00 | 12.0, 11.5 | 12.5 | 6 | 5.0000 |" in bench.table(record)  # allocated: the most of the ranks
    for r in rows:  # no outside figure: no device peak
        path = tmp_path / "metrics" / f"rank{r}.jsonl"
        path.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != out}) + "\n"
                                for x in path.read_text().splitlines()))
    res = bench.summarize(args, "bf16", "eager", str(tmp_path), SimpleNamespace(rc=0, seconds=1.0, log="x"))
    assert res["peak_device_gib"] == {0: None, 1: None}
    assert "| 11.00 | 12.0, 11.5 | n/a | 6 | 5.0000 |" in bench.table(record | {"results": [res]})
    assert "| 11.00 | 12.0, 11.5 | n/a | n/a | 5.0000 |" in bench.table(record | {"results": [res | {"alloc_retries": None}]})


def test_jobs_run_with_torchtitans_allocator_setting(monkeypatch):
    """Every job starts with ``PYTORCH_ALLOC_CONF=expandable_segments:True`` (what torchtitan's ``run_train.sh`` sets),
    unless the caller chose an allocator setting (either variable's name), which is kept; the bench records it."""
    from examples.titan import runs

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    env = runs._env({"X": "1"})
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True" and runs.alloc_conf(env) == runs.ALLOC_CONF
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "max_split_size_mb:64")
        env = runs._env(None)
        assert env[name] == "max_split_size_mb:64" and runs.alloc_conf(env) == "max_split_size_mb:64"
        assert env.get("PYTORCH_ALLOC_CONF", "max_split_size_mb:64") == "max_split_size_mb:64"
        monkeypatch.delenv(name)


def test_bench_table_gives_time_per_step_against_bf16():
    """The bench's ratio is the docs' convention: time per step against bf16 (bf16's tokens/s over the variant's),
    so a variant at 80% of bf16's throughput reads 1.250, not 0.800."""
    from examples.titan import bench

    def result(variant, tps):
        return {"variant": variant, "mode": "compiled", "tokens_per_s_per_gpu": {"median": tps, "min": tps, "max": tps},
                "peak_reserved_gib": {0: 1.0}, "peak_device_gib": {0: None}, "alloc_retries": 0, "final_loss": 5.0,
                "a2a_ms": None, "wall_s": 1.0, "rc": 0}

    record = {"torch": "2.99", "nproc": 1, "flavor": "16B", "layers": 2, "steps": 3, "warmup": 0, "tail": 1,
              "device": "Some GPU", "results": [result("bf16", 100.0), result("mxfp8", 80.0)]}
    text = bench.table(record)
    assert "| time vs bf16 |" in text
    assert "| mxfp8 | compiled | 80 (80-80) | 1.250 |" in text and "| bf16 | compiled | 100 (100-100) | 1.000 |" in text


def test_bench_plain_loop_row(tmp_path):
    """``--variants plain_bf16`` runs :mod:`examples.titan.plain_loop` (one GPU, the bench's flavour, layers, steps and
    mode), not a trainer job; the table gives the bf16 variant's time per step as a multiple of its, per mode; the
    loss check leaves it out."""
    from examples.titan import bench

    args = bench.parse_args(["--out", str(tmp_path), "--nproc", "1", "--variants", "bf16,plain_bf16", "--layers", "3",
                             "--steps", "20", "--flavor", "debugmodel"])
    cmd = bench.plain_command(args, "compiled", "d")
    assert cmd[cmd.index("-m", 3) + 1] == "examples.titan.plain_loop" and cmd[-1] == "--compile", cmd
    # the bench profiles its last step by default (torchtitan's profiler), the plain loop's too
    assert " ".join(cmd).endswith("--dump-folder d --flavor debugmodel --layers 3 --steps 20 --profile --compile")
    assert "--compile" not in bench.plain_command(args, "eager", "d")
    args.profile = False
    assert "--profile" not in bench.plain_command(args, "eager", "d")

    def result(variant, tps, loss):
        return {"variant": variant, "mode": "eager", "rc": 0, "wall_s": 1.0, "final_loss": loss, "losses": [loss],
                "tokens_per_s_per_gpu": {"median": tps, "min": tps, "max": tps}, "peak_reserved_gib": {"0": 1.0}}

    record = {"torch": "2.99", "nproc": 1, "flavor": "16B", "layers": 4, "steps": 1, "warmup": 0, "tail": 1,
              "device": "Some GPU", "results": [result("bf16", 85.0, 5.0), result("plain_bf16", 100.0, 9.0),
                                                result("converted", 84.0, 5.01)]}
    assert "bf16 eager: 1.176x the time per step of the plain bf16 loop" in bench.table(record)
    assert [c["variant"] for c in bench.loss_check(record, 0.005)] == ["converted"]


def test_launcher_shims_only_where_torch_lacks_them(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from examples.titan import launch

    monkeypatch.delattr(dist, "set_timeout", raising=False)
    assert launch.provide_set_timeout() == ["torch.distributed.set_timeout"]
    assert dist.set_timeout is c10d._set_pg_timeout and launch.provide_set_timeout() == []
    monkeypatch.delattr(torch.compiler, "_is_non_strict_tracing", raising=False)
    assert launch.provide_is_non_strict_tracing() == ["torch.compiler._is_non_strict_tracing"]
    assert torch.compiler._is_non_strict_tracing() is False and launch.provide_is_non_strict_tracing() == []


def test_cpu_device_reaches_every_torchtitan_module():
    """In a fresh process: after ``use_cpu_device`` every torchtitan module that copied the device type or
    module at import (before or after the call) holds the CPU ones."""
    script = (
        "import os; os.environ['LOCAL_RANK'] = '0'\n"
        "import torchtitan.distributed.parallel_dims as before\n"
        "from examples.titan import launch\n"
        "launch.stub_missing_fsdp_names(); launch.use_cpu_device()\n"
        "import torchtitan.components.metrics as m, torchtitan.tools.profiler as p, torchtitan.tools.utils as u\n"
        "import torchtitan.distributed.utils as d\n"
        "print(before.device_type, m.device_type, d.device_type, u.device_type, m.device_module is u.device_module,"
        " p.device_module is u.device_module, u.get_local_device())\n"
    )
    proc = run_python("-c", script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "cpu cpu cpu cpu True True cpu:0", proc.stdout


def test_a2a_legs_follow_the_kernel_order(tmp_path):
    """The bench attributes a step's all-to-all kernels to legs by their order: per MoE layer forward counts,
    dispatch, combine; backward combine, dispatch; anything else is reported unattributed."""
    import gzip

    from examples.titan.bench import a2a_legs

    names = ["counts", "dispatch", "combine"] * 2 + ["combine backward", "dispatch backward"] * 2
    events = [{"cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ts": i,
               "dur": 1000.0 * (i + 1)} for i in range(len(names))]
    events += [{"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 3.5, "dur": 5.0},
               {"cat": "cpu_op", "name": "SendRecv", "ts": 0, "dur": 9.0}]
    path = tmp_path / "rank0_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    res = a2a_legs(str(path), moe_layers=2)
    assert res["attributed"] and res["legs_ms"] == {"counts": [1.0, 4.0], "dispatch": [2.0, 5.0], "combine": [3.0, 6.0],
                                                    "combine backward": [7.0, 9.0], "dispatch backward": [8.0, 10.0]}
    assert a2a_legs(str(path), moe_layers=3)["attributed"] is False
    # moe_quant's MXFP8 wire: two kernels (data, scales) per MXFP8 leg, summed; the same kernels do not fit it
    assert a2a_legs(str(path), moe_layers=2, kernel_legs="mxfp8 wire")["attributed"] is False


def test_step_syncs_count_the_hosts_waits_in_the_profiled_step(tmp_path):
    """The bench's sync column: device-to-host memcpys and the synchronizing runtime calls of a rank's profiled
    step (a kernel or a host-to-device copy is neither); the table shows the most of the ranks."""
    from examples.titan import bench

    events = [{"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)"},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)"},
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)"},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize"}, {"cat": "cuda_runtime", "name": "cudaMemcpyAsync"},
              {"cat": "cuda_runtime", "name": "cudaEventSynchronize"}, {"cat": "kernel", "name": "cudaStreamSynchronize"}]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert bench.step_syncs(str(path)) == {"d2h_copies": 2, "host_syncs": 2}
    res = {"syncs_per_rank": {"rank0": {"d2h_copies": 2, "host_syncs": 2}, "rank1": {"d2h_copies": 3, "host_syncs": 1}}}
    assert bench._syncs(res) == "3 / 2" and bench._syncs({}) == "n/a"


def test_a2a_legs_of_the_mxfp8_wire_and_report_only(tmp_path, capsys):
    """moe_quant's dispatcher on the MXFP8 wire sends dispatch and combine backward as two exchanges each (data,
    scales): 4 kernels per layer forward, 3 backward, each MXFP8 leg the sum of its two. ``--report-only``
    attributes the stored kernel times again (the pattern from the job's setup) and keeps the record's own
    device and torch."""
    from examples.titan import bench

    # 2 layers: forward (counts, data, scales, combine) x 2, backward (data, scales, dispatch bwd) x 2
    ms = [0.1, 1.0, 0.01, 2.0, 0.2, 1.5, 0.02, 2.5, 3.0, 0.03, 4.0, 3.5, 0.04, 4.5]
    got = bench.attribute_legs(ms, 2, "mxfp8 wire")
    assert got["attributed"] and got["legs_ms"] == {
        "counts": [0.1, 0.2], "dispatch": [1.01, 1.52], "combine": [2.0, 2.5],
        "combine backward": [3.03, 3.54], "dispatch backward": [4.0, 4.5]}
    assert bench.attribute_legs(ms, 2, "one per leg")["attributed"] is False  # 14 kernels, not 10
    assert bench.kernel_legs_of({"dispatcher_settings": [{"wire": "mxfp8"}]}) == "mxfp8 wire"
    assert bench.kernel_legs_of({"dispatcher_settings": [{}]}) == "one per leg"  # torchtitan's dispatcher
    assert bench.kernel_legs_of(None) == "one per leg"

    def result(variant, settings, kernel_ms):
        return {"variant": variant, "mode": "eager", "rc": 0, "wall_s": 1.0, "final_loss": 5.0, "losses": [5.0],
                "tokens_per_s_per_gpu": {"median": 1.0, "min": 1.0, "max": 1.0}, "peak_reserved_gib": {"0": 1.0},
                "setup": {"dispatcher_settings": [settings]},
                "a2a_per_rank": {"rank0": {"attributed": False, "ms": kernel_ms}}}

    record = {"torch": "2.99", "nproc": 4, "flavor": "16B", "layers": 3, "steps": 1, "warmup": 0, "tail": 1,
              "extra": [], "device": "Some GPU", "results": [result("bf16", {}, [1.0] * 10),
                                                            result("mxfp8", {"wire": "mxfp8"}, ms)]}
    (tmp_path / "bench.json").write_text(json.dumps(record))
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    assert bench.main(["--out", str(tmp_path), "--report-only"]) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # report-only starts no job: the process's handler stays
    out = json.loads((tmp_path / "bench.json").read_text())
    assert (out["device"], out["torch"]) == ("Some GPU", "2.99")
    mx = next(r for r in out["results"] if r["variant"] == "mxfp8")
    assert mx["a2a_ms"]["dispatch"] == pytest.approx(1.265) and mx["a2a_ms"]["combine backward"] == pytest.approx(3.285)
    table = (tmp_path / "bench.md").read_text()
    assert "Some GPU, torch 2.99" in table and "| 1.27 / 2.25 / 3.29 / 4.25 (0.15) |" in table, table


def test_script_arguments_are_checked(capsys):
    from examples.titan import bench, checks, fit_layers

    fit = ["--out", "x", "--memory-gib", "76"]
    for mod, argv, message in ((fit_layers, fit + ["--start", "30"], "--min <= --start <= --max"),
                               (fit_layers, fit + ["--start", "9", "--steps", "1"], "--steps must be at least 2"),
                               (fit_layers, ["--out", "x", "--start", "9"], "--memory-gib"),
                               (checks, ["--out", "x", "--save-at", "3", "--kill-at", "3"], "--kill-at"),
                               (checks, ["--out", "x", "--variants", "fp4"], "--variants"),
                               (checks, ["--out", "x", "--mismatch", "top_k=2"], "--mismatch"),
                               (checks, ["--out", "x", "--mismatch-variants", "bf16"], "--mismatch-variants"),
                               (checks, ["--out", "x", "--mismatch", "wire=bf16", "--mismatch-variants", "converted"],
                                "--mismatch-variants"),
                               (bench, ["--out", "x", "--modes", "fast"], "--modes"),
                               (bench, ["--out", "x", "--nproc", "2", "--variants", "bf16,plain_bf16"], "--nproc 1"),
                               (bench, ["--out", "x", "--steps", "5", "--warmup", "3"], "--warmup")):
        with pytest.raises(SystemExit) as exc:
            mod.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, (argv, message)



def test_a_job_past_its_timeout_is_killed_with_its_children(tmp_path):
    """A job is killed at its timeout with everything it started (torchrun's ranks), and it stays in the
    caller's session (a time limit that ends the session ends the job too)."""
    from examples.titan import runs

    pid_file = tmp_path / "child.pid"
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print(os.getsid(0), flush=True)\n"
              "time.sleep(120)\n")
    job = runs.run([sys.executable, "-c", script], str(tmp_path / "job.log"), timeout=4)
    assert job.rc is None and job.seconds < 60
    assert int((tmp_path / "job.log").read_text().split()[0]) == os.getsid(0)
    child = int(pid_file.read_text())
    assert wait_until(lambda: gone(child), timeout=5.0), f"the job's child {child} outlived the job's timeout"


@given(limits=st.lists(st.integers(0, 30), min_size=1, max_size=4),
       bounds=st.lists(st.integers(1, 27), min_size=3, max_size=3).map(sorted),
       modes=st.sampled_from([["eager"], ["eager", "compiled"]]))
def test_fit_layers_search_finds_the_most_layers_every_variant_fits(limits, bounds, modes):
    """``fit_layers.search`` against the plain answer: with variant v fitting up to ``limits[v]`` layers, the most
    layers every variant fits, at most ``--max``; None where that is below ``--min``. Each probe runs once, the
    other variants only where the first fits."""
    from types import SimpleNamespace

    from examples.titan import fit_layers, runs

    low, start, high = bounds
    variants = list(runs.VARIANTS[:len(limits)])
    limit = dict(zip(variants, limits))
    calls = []

    def fits(variant, mode, layers):
        calls.append((variant, mode, layers))
        return layers <= limit[variant]

    args = SimpleNamespace(variants=variants, modes=modes, start=start, min=low, max=high)
    best = min(min(limits), high)
    assert fit_layers.search(args, fits) == (best if best >= low else None)
    assert len(calls) == len(set(calls))
    assert all(limit[variants[0]] >= n for v, _, n in calls if v != variants[0])


def test_fit_layers_stops_on_a_failure_that_is_not_memory(tmp_path):
    """A probe that fails without CUDA's out-of-memory error ends the search (exit status 2, the reason in
    ``fit.json``), never read as "does not fit": here the cap itself is refused, as no CUDA device is present.
    The probe's timeout is generous: the job stops at its argument check (~15 s alone), but under a loaded machine
    its start (torchrun, then torch and torchtitan imported) took over 120 s once, and a probe killed at its timeout
    is a failure of its own (no message in its log)."""
    from examples.titan import fit_layers

    assert fit_layers.main(["--out", str(tmp_path), "--flavor", "debugmodel", "--nproc", "1", "--memory-gib", "1",
                            "--start", "2", "--variants", "bf16", "--timeout", "900"]) == 2
    record = json.loads((tmp_path / "fit.json").read_text())
    assert record["layers"] is None and "without an out-of-memory error" in record["error"]
    log = " ".join((tmp_path / "bf16_eager_2.log").read_text().replace("│", " ").split())  # tyro's box, wrapped
    assert "moe_quant.memory_gib caps the CUDA allocator" in log


def test_report_only_takes_the_final_loss_again_over_another_tail(tmp_path, capsys):
    """``--report-only --tail N`` takes every final loss again from its stored curve (and the check with it);
    without ``--tail`` the record's own final losses and tail stay. Here the last 10 steps differ by 0.6% and the
    last 20 by 0.3%: the check fails over 10 and passes over 20."""
    from examples.titan import bench

    base = [5.0] * 30
    other = [5.0] * 20 + [5.0 * 1.006] * 10  # last 10: +0.6%, last 20: +0.3%

    def result(variant, curve):
        return {"variant": variant, "mode": "eager", "rc": 0, "wall_s": 1.0, "losses": curve,
                "final_loss": bench.final_loss(curve, 10), "tokens_per_s_per_gpu": {"median": 1.0, "min": 1.0,
                                                                                      "max": 1.0},
                "peak_reserved_gib": {"0": 1.0}}

    record = {"torch": "2.99", "nproc": 4, "flavor": "16B", "layers": 3, "steps": 30, "warmup": 0, "tail": 10,
              "extra": [], "device": "Some GPU", "results": [result("bf16", base), result("mxfp8", other)]}
    (tmp_path / "bench.json").write_text(json.dumps(record))
    assert bench.main(["--out", str(tmp_path), "--report-only"]) == 1
    assert "FAIL final loss mxfp8 eager" in capsys.readouterr().out
    kept = json.loads((tmp_path / "bench.json").read_text())
    assert kept["tail"] == 10 and kept["results"][1]["final_loss"] == pytest.approx(5.0 * 1.006)
    assert bench.main(["--out", str(tmp_path), "--report-only", "--tail", "20"]) == 0
    assert "PASS final loss mxfp8 eager: 5.0150 vs bf16 5.0000 (0.30%" in capsys.readouterr().out
    again = json.loads((tmp_path / "bench.json").read_text())
    assert again["tail"] == 20 and again["results"][1]["final_loss"] == pytest.approx(5.0 * 1.003)
    assert "final loss: mean of the last 20 steps" in (tmp_path / "bench.md").read_text()


def test_plain_loop_trains_the_bf16_model_in_bf16():
    """``examples.titan.plain_loop`` (the bench's ``plain_bf16`` row) at debug size: every step logged with the keys the
    bench reads, the parameters bf16, no FSDP, the loss finite; ``--profile``: the last step's trace where torchtitan
    writes its own, holding that step's ops (the optimizer's among them) and not the first step's."""
    tmp_path, _ = _job("plain_loop", "test_plain_loop_trains_the_bf16_model_in_bf16")
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss_metrics/global_avg_loss"]) and r["throughput(tps)"] > 0, r
        assert r["time_metrics/end_to_end(s)"] > 0 and "memory/max_reserved(GiB)" in r, r
    setup = json.loads((tmp_path / "setup" / "rank0.json").read_text())
    assert setup["param_dtypes"] == ["torch.bfloat16"] and setup["fsdp_modules"] == 0, setup
    (trace,) = (tmp_path / "profiling" / "traces").glob("iteration_*/rank0_trace.json")
    assert trace.parent.name == "iteration_2", trace
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert any("ProfilerStep#1" in n for n in names) and not any("ProfilerStep#0" in n for n in names), \
        sorted({n for n in names if n.startswith("ProfilerStep")})
    assert any("Optimizer.step" in n or "adam" in n.lower() for n in names)


def test_activation_checkpointing_trains_the_same_steps():
    """torchtitan's trainer with its activation checkpointing (``activation-checkpoint:selective``, its per-op
    policy, and ``:full``) around every block of the mxfp8 variant (moe_quant's experts and dispatcher, EP and FSDP
    over 2 gloo ranks): every step's loss equals the job's without checkpointing bit for bit (issue 55 items 2 and
    3: the recompute runs the same MXFP8 GEMMs and exchanges), and no GEMM fell back."""
    test = "test_activation_checkpointing_trains_the_same_steps"
    losses = {}
    for ac in ("none", "selective", "full"):
        if ac == "none":  # the plain job (the slow wire test's reference too)
            dump = _plain_job("mxfp8", test)
        else:
            dump, job = _job(f"ac_{ac}", test)
        rows = runs.metrics(str(dump))
        assert sorted(rows) == [0, 1] and all(r["moe_quant/fallbacks"] == 0 for rs in rows.values() for r in rs)
        losses[ac] = runs.losses(str(dump))
        if ac != "none":
            assert f"Applied {'SelectiveAC' if ac == 'selective' else 'FullAC'} activation checkpointing" in \
                job.log.read_text(encoding="utf-8")  # the precondition: torchtitan wrapped the blocks
    assert sorted(losses["none"][0]) == [1, 2, 3] and len(set(losses["none"][0].values())) == 3
    assert losses["selective"] == losses["none"] == losses["full"]
