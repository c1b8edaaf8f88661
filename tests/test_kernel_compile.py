"""CI without a GPU: every kernel variant (every family: 1x32, 32x1, permute, block, fingerprint) compiles for sm_90a and sm_100a (CuTe DSL cross-compile).

Runs moe_quant.kernels.compile_check (one subprocess per arch, in parallel) and checks that
ptxas reports no register spills and no local-memory stack frame for any variant. The subprocesses start
when the session's tests are collected (``start_in_background``, called by ``tests/conftest.py``), niced,
so that the ~6 CPU-minutes of compiling (about 3 an arch) fill the core the (mostly single-threaded) other tests
leave idle; this module's tests run last (conftest) and its fixture waits for what is left. The
per-variant report (registers, spills, compile time) goes to the log, not to the terminal:
``pytest tests/test_kernel_compile.py --log-cli-level=INFO`` shows it, and a failure
includes it in the assertion message.
"""

import logging

import pytest

pytest.importorskip("cutlass")

from moe_quant.kernels import compile_check  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
BACKGROUND_NICE = 10
_STARTED: list = []


def start_in_background(selected=frozenset()) -> None:
    """Start the compile subprocesses now (at the end of collection), behind the other tests (niced)."""
    if not _STARTED:
        _STARTED.append(compile_check.start(list(ARCHS), nice=BACKGROUND_NICE))


def stop_background() -> None:
    """Kill the subprocesses where the session ends before the fixture collected them."""
    while _STARTED:
        compile_check.stop(_STARTED.pop())


@pytest.fixture(scope="module")
def results():
    if _STARTED:
        return compile_check.collect(_STARTED.pop())
    return compile_check.run(list(ARCHS))


def test_every_variant_compiles_for_each_arch(results):
    keys = {compile_check.variant_name(v) for v in compile_check.all_variants()}
    for arch in ARCHS:
        got = {r["variant"] for r in results if r["arch"] == arch}
        assert got == keys, f"{arch}: missing {sorted(keys - got)}"


def test_no_spills_no_stack(results):
    report = compile_check.format_results(results)
    logging.getLogger(__name__).info("ptxas resources per kernel variant:\n%s", report)
    for r in results:
        assert r["registers"] is not None, f"no ptxas report for {r}\n{report}"
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, f"{r}\n{report}"
        assert r["registers"] <= 128, f"{r}\n{report}"
