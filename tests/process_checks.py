"""Polling helpers for the tests that spawn processes and check that they end (Linux ``/proc``)."""

import os
import signal
import time


def gone(pid: int) -> bool:
    """No process ``pid`` runs: none exists, or only its zombie is left (its parent ended and nobody reaped it
    yet; a container's init may never do so)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll ``condition()`` until it holds (True) or ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not condition():
        if time.monotonic() > deadline:
            return condition()
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    return True


def kill_quietly(*pids) -> None:
    """SIGKILL each of ``pids`` that still runs (a test's cleanup after it failed)."""
    for pid in pids:
        if pid and not gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
