"""The background workers of ``moe_quant.kernels.compile_check`` (``start``, ``collect``, ``stop``) and how
``tests/conftest.py`` runs a test module's background work: workers end with ``stop()``, with the process that
started them, and with the session. No kernel compiles here: the workers run a cheap command instead
(``compile_check._worker_command``); ``tests/test_kernel_compile.py`` runs the real ones."""

import os
import select
import signal
import subprocess
import sys
import textwrap
import types

import pytest
from process_checks import gone, kill_quietly, wait_until

from moe_quant.kernels import compile_check

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with their parent on Linux")


def _sleeper(arch):
    return ["sleep", "60"]


def test_stop_kills_started_workers(monkeypatch):
    monkeypatch.setattr(compile_check, "_worker_command", _sleeper)
    started = compile_check.start(["sm_a", "sm_b"])
    try:
        assert [a for a, _, _ in started] == ["sm_a", "sm_b"]
        assert all(p.poll() is None for _, p, _ in started)
        compile_check.stop(started)
        assert [p.returncode for _, p, _ in started] == [-signal.SIGKILL] * 2
        assert all(err.closed for _, _, err in started)
        compile_check.stop(started)  # again, with nothing left to stop: no error
    finally:
        kill_quietly(*(p.pid for _, p, _ in started if p.returncode is None))


def test_collect_raises_for_a_failed_worker_and_kills_the_others(monkeypatch):
    monkeypatch.setattr(compile_check, "_worker_command", lambda arch: (
        [sys.executable, "-c", "import sys; print('it broke', file=sys.stderr); sys.exit(3)"] if arch == "bad"
        else ["sleep", "60"]))
    started = compile_check.start(["bad", "slow"])
    try:
        with pytest.raises(RuntimeError, match=r"(?s)compile for bad failed \(rc=3\).*it broke"):
            compile_check.collect(started, timeout=60)
        assert started[1][1].returncode == -signal.SIGKILL
    finally:
        kill_quietly(*(p.pid for _, p, _ in started if p.returncode is None))


def test_start_nices_its_workers(monkeypatch):
    monkeypatch.setattr(compile_check, "_worker_command", _sleeper)
    started = compile_check.start(["sm_a"], nice=5)
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, started[0][1].pid) == min(own + 5, 19)
    finally:
        compile_check.stop(started)


def test_the_worker_command_runs_the_worker_which_first_ties_its_life_to_its_parent(monkeypatch):
    """``start`` runs ``python -m moe_quant.kernels.compile_check --worker ARCH``: ``main`` hands it to
    ``_worker``, whose first step is ``_die_with_parent``, before any import or compile."""
    assert compile_check._worker_command("sm_90a") == [sys.executable, "-m", "moe_quant.kernels.compile_check",
                                                       "--worker", "sm_90a"]
    ran = []
    monkeypatch.setattr(compile_check, "_worker", ran.append)
    assert compile_check.main(["--worker", "sm_90a"]) == 0 and ran == ["sm_90a"]
    monkeypatch.undo()

    class Armed(Exception):
        pass

    def die_with_parent():
        raise Armed

    monkeypatch.setattr(compile_check, "_die_with_parent", die_with_parent)
    monkeypatch.setattr(compile_check, "all_variants", list)  # compiles nothing, should it get that far
    for name in ("CUTE_DSL_ARCH", "CUTE_DSL_DISABLE_FILE_CACHING"):  # _worker sets them
        monkeypatch.setenv(name, "unchanged")
    with pytest.raises(Armed):
        compile_check._worker("sm_90a")
    assert os.environ["CUTE_DSL_ARCH"] == "unchanged"


# A parent that starts one worker with compile_check's own start() and _die_with_parent(), loading
# compile_check.py by its path (no torch import: milliseconds); the worker says it is armed, then sleeps.
PARENT = textwrap.dedent("""
    import importlib.util, sys, time

    def load(path):
        spec = importlib.util.spec_from_file_location("compile_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    WORKER = '''
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("compile_check", sys.argv[1])
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    cc._die_with_parent()
    open(sys.argv[2], "w").close()
    time.sleep(60)
    '''

    cc = load(sys.argv[1])
    cc._worker_command = lambda arch: [sys.executable, "-c", WORKER, sys.argv[1], sys.argv[2]]
    (_, worker, _), = cc.start(["sm_test"])
    print(worker.pid, flush=True)
    time.sleep(60)
""")


@linux
def test_a_worker_dies_when_the_process_that_started_it_is_killed(tmp_path):
    armed = tmp_path / "armed"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, compile_check.__file__, str(armed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        line = parent.stdout.readline() if ready else ""
        assert line.strip().isdigit(), (line, parent.poll())
        pid = int(line)
        # killed before it armed, the worker would exit anyway (its parent check): wait, so that the test
        # sees PR_SET_PDEATHSIG itself at work
        assert wait_until(armed.exists), f"the worker did not start (it is {'gone' if gone(pid) else 'running'})"
        parent.kill()
        parent.wait()
        assert wait_until(lambda: gone(pid)), f"the worker ({pid}) outlived the process that started it"
    finally:
        kill_quietly(pid)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        parent.stderr.close()


def _module(name: str, calls: list, with_hooks: bool = True) -> types.ModuleType:
    m = types.ModuleType(name)
    if with_hooks:
        m.start_in_background = lambda selected: calls.append(("start", name, selected))
        m.stop_background = lambda: calls.append(("stop", name))
    return m


def _session(items, collectonly=False):
    option = types.SimpleNamespace(collectonly=collectonly)
    return types.SimpleNamespace(config=types.SimpleNamespace(option=option), items=items)


def test_conftest_starts_background_work_after_collection_and_stops_it_at_the_end():
    import conftest

    calls = []
    a, b, plain = _module("a", calls), _module("b", calls), _module("plain", calls, with_hooks=False)
    names = [("test_x[1]", "test_x"), ("test_x[2]", "test_x"), ("test_p", "test_p"), ("test_y", "test_y")]
    items = [types.SimpleNamespace(module=m, name=n, originalname=o) for m, (n, o) in zip((a, a, plain, b), names)]
    items += [types.SimpleNamespace(module=None, name="test_z", originalname="test_z")]
    session = _session(items)
    conftest.pytest_collection_finish(session)
    # once per selected module with the hook, given its selected tests' function names
    assert sorted(calls) == [("start", "a", {"test_x"}), ("start", "b", {"test_y"})]
    calls.clear()
    conftest.pytest_sessionfinish(session)
    assert sorted(calls) == [("stop", "a"), ("stop", "b")]
    calls.clear()
    conftest.pytest_collection_finish(_session(items, collectonly=True))  # --collect-only starts nothing
    assert calls == []
    conftest.pytest_collection_finish(_session(items[:1]))  # b's tests not selected
    assert calls == [("start", "a", {"test_x"})]


def test_conftest_runs_the_tests_of_modules_with_background_work_last():
    import conftest

    calls = []
    a, plain, other = _module("a", calls), _module("plain", calls, with_hooks=False), _module("other", calls, False)
    items = [types.SimpleNamespace(module=m, keywords={}, name=f"{m.__name__}{i}")
             for i, m in enumerate((a, plain, a, other, plain))]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["plain1", "other3", "plain4", "a0", "a2"]  # the rest keep their order


def test_conftest_starts_no_background_work_for_a_module_whose_tests_all_skip():
    import conftest

    calls = []
    a, b, c = _module("a", calls), _module("b", calls), _module("c", calls)
    marks = {"a": [pytest.mark.skipif(True, reason="x").mark], "b": [pytest.mark.skipif(False, reason="x").mark],
             "c": [pytest.mark.skip(reason="x").mark]}

    def item(m):
        return types.SimpleNamespace(module=m, name="test_t", originalname="test_t", iter_markers=lambda name=None: [
            k for k in marks[m.__name__] if name is None or k.name == name])

    conftest.pytest_collection_finish(_session([item(a), item(b), item(c)]))
    assert calls == [("start", "b", {"test_t"})]
