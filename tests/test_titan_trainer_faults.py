"""Faults and cross-loading with torchtitan's own trainer and the configs of ``examples/titan``, 2 gloo CPU ranks.

``python -m examples.titan.checks --checks fault,crossload`` at debug size (see ``tests/test_titan_trainer.py`` for
the launch and what is substituted on the CPU): the last rank kills itself (SIGKILL) after step 3 and a second
job in the same dump folder resumes from the step-2 checkpoint: every step's loss equals the uninterrupted
job's bit for bit; the bf16 job's step-2 checkpoint loads into the converted model (moe_quant's experts and
dispatcher) and the converted one's into bf16, each continuing at step 3 (DCP raises on a key the checkpoint
lacks: the state dict keys are the same). The run is the one ``tests/test_titan_trainer.py`` reads too
(``titan_checks.all_checks``, run behind the other tests of the session: ``titan_checks.JOBS``).
"""

from __future__ import annotations

import pytest
from titan_checks import JOBS, KILL_AT, NEEDS_GLOO, SAVE_AT, all_checks, assert_all_passed, submit_all_checks

pytestmark = [NEEDS_GLOO, pytest.mark.usefixtures("warm_torchrun")]  # torchrun's ranks warm: conftest


def start_in_background(selected) -> None:
    """The checks' run starts now, behind the other tests (``tests/conftest.py``), where no other module started it."""
    submit_all_checks()


def stop_background() -> None:
    JOBS.stop()


@pytest.fixture(scope="module")
def checks():
    return all_checks()


def test_every_check_passes(checks):
    assert_all_passed(checks, [("crossload", "bf16->mxfp8"), ("crossload", "mxfp8->bf16"), ("fault", "mxfp8")])


def test_a_killed_rank_then_a_restarted_job_ends_with_the_uninterrupted_losses(checks):
    c = checks["by"][("fault", "mxfp8")]
    assert c["restart"] == "manual" and c["exit_codes"][0] not in (0, None) and c["exit_codes"][1] == 0, c
    assert c["logged_twice"] == list(range(SAVE_AT + 1, KILL_AT + 1)) and c["differences"] == [], c


def test_checkpoints_load_across_bf16_and_converted_experts(checks):
    for name in ("bf16->mxfp8", "mxfp8->bf16"):
        c = checks["by"][("crossload", name)]
        assert set(c["first_step"].values()) == {SAVE_AT + 1}, c
        loaded, written = c["losses"]["0"]
        assert loaded != written and abs(loaded - written) <= 0.02 * written, c  # the other numerics, same weights
