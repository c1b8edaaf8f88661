"""Commands a test module runs behind the other tests: started when the session's tests are collected (the module's
``start_in_background``, called by ``tests/conftest.py``, which runs the module's tests last), one after another in
a thread, so that their processes fill the core the mostly single-threaded tests leave idle; the tests read their
results (:meth:`BackgroundCommands.result`) when their turn comes.

A command runs from the repository root in a process group of its own, its output into ``<its folder>.log`` (its
standard error there too, or into ``<its folder>.err`` with ``submit(..., stderr_apart=True)``); at
the session's end (:meth:`BackgroundCommands.stop`) the commands not started are dropped and a running one's group
is sent SIGTERM, then SIGKILL. A test whose command was not submitted at collection (the module imported without
``tests/conftest.py``) submits it and waits all the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    """A finished command: ``rc`` None where it was killed at its time limit or at the session's end."""

    rc: int | None
    seconds: float
    log: Path
    err: Path | None = None  # standard error, where kept apart

    @property
    def stdout(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""

    @property
    def stderr(self) -> str:
        return self.err.read_text(encoding="utf-8", errors="replace") if self.err and self.err.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        if not self.log.exists():
            return f"(no log: {self.log} was never started)"
        return (self.stdout[-chars:] + ("\n-- stderr --\n" + self.stderr[-chars:] if self.err else ""))


class BackgroundCommands:
    """Named commands run in order by one thread. ``submit(key, make)``: ``make(folder)`` returns ``(argv,
    timeout_s)`` given the command's own empty folder (it writes its files there); the environment is this
    process's at the submit with ``PYTHONPATH`` the repository root and ``env`` (``submit``'s) over it."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._root: str | None = None
        self._queue: list = []  # keys, in submission order
        self._jobs: dict = {}  # key -> {"argv", "env", "timeout", "folder", "done": Event, "result"}
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._stopped = False

    def folder(self, key: str) -> Path:
        return Path(self._jobs[key]["folder"])

    def submit(self, key: str, make, env: dict | None = None, stderr_apart: bool = False) -> None:
        with self._lock:
            if key in self._jobs:
                return
            if self._root is None:
                self._root = tempfile.mkdtemp(prefix=self.prefix)
            folder = os.path.join(self._root, key)
            os.makedirs(folder)
            argv, timeout = make(Path(folder))
            full = dict(os.environ)
            full["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT)] + [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p])
            full.update(env or {})
            self._jobs[key] = {"argv": [str(a) for a in argv], "env": full, "timeout": timeout, "folder": folder,
                               "err": Path(folder + ".err") if stderr_apart else None, "done": threading.Event(),
                               "result": None}
            self._queue.append(key)
            self._stopped = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=f"background {self.prefix}", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def result(self, key: str, timeout_s: float) -> Done:
        """The command's result, waiting up to ``timeout_s`` (past its own time limit: it queues behind others)."""
        job = self._jobs[key]
        if not job["done"].wait(timeout_s):
            raise TimeoutError(f"background command {key!r} not done after {timeout_s:.0f} s: {job['argv']}")
        return job["result"]

    def _next(self):
        with self._lock:
            while not self._queue:
                if self._stopped or not self._lock.wait(5.0):
                    return None  # stopped, or idle: the thread ends; a later submit starts another
            return self._queue.pop(0)

    def _work(self) -> None:
        while (key := self._next()) is not None:
            job = self._jobs[key]
            started = time.monotonic()
            rc = None
            log = Path(job["folder"] + ".log")
            try:
                with self._lock:
                    if self._stopped:
                        continue
                with open(log, "w", encoding="utf-8") as out, \
                        (open(job["err"], "w", encoding="utf-8") if job["err"] else contextlib.nullcontext()) as err:
                    self._proc = subprocess.Popen(job["argv"], cwd=ROOT, env=job["env"], stdout=out,
                                                  stderr=err or subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True)
                    try:
                        rc = self._proc.wait(job["timeout"])
                    except subprocess.TimeoutExpired:
                        _end_group(self._proc)
            finally:
                self._proc = None
                job["result"] = Done(rc, time.monotonic() - started, log, job["err"])
                job["done"].set()

    def stop(self) -> None:
        """Drop what has not started, end what runs (SIGTERM to its group, SIGKILL 10 s later), remove the files."""
        with self._lock:
            self._stopped = True
            dropped, self._queue = self._queue, []
            self._lock.notify_all()
        for key in dropped:
            self._jobs[key]["result"] = Done(None, 0.0, Path(self._jobs[key]["folder"] + ".log"), self._jobs[key]["err"])
            self._jobs[key]["done"].set()
        proc = self._proc
        if proc is not None:
            _end_group(proc)
        if self._thread is not None:
            self._thread.join(30)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self._jobs.clear()


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
