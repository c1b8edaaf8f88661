"""``tests/background.py``: commands run one after another behind the tests, their results read later."""

from __future__ import annotations

import sys
import time

import pytest
from background import BackgroundCommands
from process_checks import gone, wait_until

PY = sys.executable


def _script(code: str, timeout: float = 60.0):
    return lambda out: ([PY, "-c", code, str(out)], timeout)


def test_commands_run_in_order_each_in_its_folder_with_the_environment():
    jobs = BackgroundCommands("test_bg_")
    try:
        stamp = "import os, sys, time; open(os.path.join(sys.argv[1], 't'), 'w').write(repr(time.monotonic()))"
        jobs.submit("first", _script("import time; time.sleep(1)"))  # a and b queue behind it
        jobs.submit("a", _script(stamp + "; time.sleep(0.5); print('a out', os.environ['BG_X'])"), env={"BG_X": "1"})
        jobs.submit("b", _script(stamp + "; import sys; sys.exit(3)"))
        jobs.submit("a", _script("raise SystemExit(9)"))  # a key already queued: ignored
        a, b = jobs.result("a", 60), jobs.result("b", 60)
        assert (a.rc, b.rc) == (0, 3), (a.tail(), b.tail())
        assert "a out 1" in a.tail() and a.stderr == ""
        ta, tb = (float((jobs.folder(k) / "t").read_text()) for k in ("a", "b"))
        assert tb - ta >= 0.5  # b started after a ended: one at a time, in order
    finally:
        jobs.stop()


def test_a_command_past_its_time_limit_is_killed_and_the_next_runs():
    jobs = BackgroundCommands("test_bg_")
    try:
        jobs.submit("slow", _script("import os, sys, time; open(os.path.join(sys.argv[1], 'pid'), 'w').write(str("
                                    "os.getpid())); time.sleep(60)", timeout=2.0))
        jobs.submit("next", _script("pass"))
        slow = jobs.result("slow", 30)
        assert slow.rc is None and slow.seconds < 20
        assert gone(int((jobs.folder("slow") / "pid").read_text()))
        assert jobs.result("next", 30).rc == 0
    finally:
        jobs.stop()


def test_stop_ends_the_running_group_and_drops_the_rest():
    jobs = BackgroundCommands("test_bg_")
    code = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            " open(os.path.join(sys.argv[1], 'pids'), 'w').write(f'{os.getpid()} {p.pid}'); time.sleep(120)")
    jobs.submit("running", _script(code, timeout=300))
    jobs.submit("queued", _script("pass"))
    pids_file = jobs.folder("running") / "pids"
    assert wait_until(pids_file.exists, timeout=30)
    time.sleep(0.2)
    pids = [int(p) for p in pids_file.read_text().split()]
    started = time.monotonic()
    jobs.stop()
    assert time.monotonic() - started < 20
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=10), pids  # the command and its child
    assert not pids_file.parent.exists()  # the files removed


def test_a_result_not_done_in_time_raises_naming_the_command():
    jobs = BackgroundCommands("test_bg_")
    try:
        jobs.submit("slow", _script("import time; time.sleep(30)"))
        with pytest.raises(TimeoutError, match="'slow' not done after 0 s"):
            jobs.result("slow", 0.2)
    finally:
        jobs.stop()


def test_standard_error_apart_where_asked():
    jobs = BackgroundCommands("test_bg_")
    try:
        code = "import sys; print('to out'); print('to err', file=sys.stderr)"
        jobs.submit("apart", _script(code), stderr_apart=True)
        jobs.submit("merged", _script(code))
        apart, merged = jobs.result("apart", 60), jobs.result("merged", 60)
        assert (apart.stdout, apart.stderr) == ("to out\n", "to err\n")
        assert sorted(merged.stdout.splitlines()) == ["to err", "to out"] and merged.stderr == ""
    finally:
        jobs.stop()
