"""Run Python from the repository root as a user would, for the tests of entry points and imports."""

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(pythonpath: bool, extra_paths) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    paths = ([str(ROOT)] if pythonpath else []) + [str(p) for p in extra_paths]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_python(*args, pythonpath=True, timeout=240, extra_paths=(), warm=False):
    """Run ``python *args`` from the repository root, as a user would (``PYTHONPATH`` = the root, or unset).

    ``extra_paths`` go on ``PYTHONPATH`` after the root (where an optional package lies outside site-packages).
    ``warm``: forked from a server that imported torch, torch._dynamo, sympy, numpy and torchao once
    (``tests/warm_python.py``: the same command line, environment, ``sys.path`` and exit status, no module of
    this repository preloaded) instead of a fresh interpreter, which spends ~5 s on those imports; for tests
    of what an entry point does, not of what importing prints. Falls back to a fresh interpreter where the
    server cannot serve the call (another platform, an environment differing from the test process's).
    """
    env = _env(pythonpath, extra_paths)
    if warm:
        proc = _WARM.run(list(args), env, timeout)
        if proc is not None:
            return proc
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _end(proc):
    """End a server of ours: EOF on its stdin, then SIGKILL if it is still there 10 s later. Returns None."""
    if proc is not None:
        try:
            proc.stdin.close()
            proc.wait(10)
        except Exception:  # noqa: BLE001 - on the way out
            proc.kill()
    return None


class _WarmServer:
    """The fork server of ``tests/warm_python.py``, started on first use, ended with this process."""

    def __init__(self):
        self.proc = None
        self.failed = not (sys.platform.startswith("linux") and hasattr(os, "fork"))
        self.lock = threading.Lock()

    def _start(self) -> bool:
        env = _env(False, ())
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_python.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        atexit.register(self._stop)
        reply = self._reply(300)
        if not reply or "ready" not in reply:
            self._stop()
            self.failed = True
        return not self.failed

    def _stop(self):
        self.proc = _end(self.proc)

    def _reply(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def run(self, argv, env, timeout):
        with self.lock:
            if self.failed or (self.proc is None and not self._start()):
                return None
            with tempfile.TemporaryDirectory() as tmp:
                out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
                request = {"argv": argv, "env": env, "cwd": str(ROOT), "stdout": out, "stderr": err,
                           "timeout": timeout}
                try:
                    self.proc.stdin.write(json.dumps(request) + "\n")
                    self.proc.stdin.flush()
                    reply = self._reply(None if timeout is None else timeout + 60)
                except (OSError, ValueError):
                    reply = None
                if reply is None:  # the server died or hung: no more warm runs
                    self._stop()
                    self.failed = True
                    return None
                if "refused" in reply:
                    return None
                stdout, stderr = (Path(p).read_text() if os.path.exists(p) else "" for p in (out, err))
            cmd = [sys.executable, *argv]
            if reply.get("timeout"):
                raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(cmd, reply["rc"], stdout, stderr)


_WARM = _WarmServer()


def rank_client(folder: Path) -> str:
    """``folder/python``: ``tests/warm_rank.py`` under a ``#!`` line that runs this interpreter isolated and without
    site (``-IS``: it starts in milliseconds), for torchrun's ``PYTHON_EXEC`` (one executable, no shell between:
    a shell would change the environment, e.g. ``PWD``)."""
    exe = folder / "python"
    exe.write_text(f"#!{sys.executable} -IS\n" + (ROOT / "tests" / "warm_rank.py").read_text())
    exe.chmod(0o755)
    return str(exe)


class _WarmRanks:
    """The fork server of ``tests/warm_ranks.py`` for torchrun's ranks (see :func:`warm_ranks`)."""

    def __init__(self):
        self.proc = None
        self.env = None  # once started: what warm_ranks() returns

    def start(self) -> dict:
        if self.env is not None:
            return self.env
        if not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")) or len(sys.executable) > 120 or any(
                c.isspace() for c in sys.executable):  # a "#!" line holds no blank and, on older kernels, 127 bytes
            self.env = {}
            return self.env
        folder = tempfile.mkdtemp(prefix="warm_ranks_")
        sock = os.path.join(folder, "socket")
        exe = rank_client(Path(folder))
        with open(os.path.join(folder, "server.log"), "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_ranks.py"), sock,
                                          ",".join(rank_preload())], cwd=ROOT, env=_env(False, ()),
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log)
        atexit.register(self.stop)
        self.env = {"PYTHON_EXEC": exe, "MOE_QUANT_WARM_RANKS": sock}
        return self.env

    def stop(self):
        self.proc = _end(self.proc)


_RANKS = _WarmRanks()


def warm_ranks_ready(timeout: float) -> bool:
    """Wait until the server of :func:`warm_ranks` listens (its preload done); False if it did not."""
    sock = (_RANKS.env or {}).get("MOE_QUANT_WARM_RANKS")
    deadline = time.monotonic() + timeout
    while sock and not os.path.exists(sock):
        if time.monotonic() > deadline or _RANKS.proc is None or _RANKS.proc.poll() is not None:
            return False
        time.sleep(0.1)
    return bool(sock)


def warm_ranks() -> dict:
    """The environment under which torchrun (``python -m torch.distributed.run``) starts each rank as a fork of a
    server that imported torch, torch._dynamo, torchao and torchtitan's trainer once (``tests/warm_ranks.py``),
    instead of a fresh interpreter (about 12 s of a core a rank): ``PYTHON_EXEC``, torchrun's own override of
    the interpreter, and the server's socket. The server starts on the first call (in the background: ranks
    started before its preload is done run cold) and ends with this process; ``{}`` where it cannot run."""
    return _RANKS.start()


def rank_preload() -> list:
    """What the servers of ranks import once (:func:`warm_ranks`' and :func:`forkserver`'s): what
    ``tests/warm_python.py`` preloads, torch.distributed, and torchtitan's trainer where it imports on its own
    (torch 2.11 lacks a name torchtitan 0.3.0 imports: a rank puts the launcher's stand-in in place first)."""
    from warm_python import PRELOAD

    from examples.titan.launch import torchtitan_imports_alone

    return [*PRELOAD, "torch.distributed", *(("torchtitan.train",) if torchtitan_imports_alone() else ())]


def forkserver():
    """multiprocessing's forkserver context, its server preloading :func:`rank_preload`: a process of it starts in
    milliseconds instead of the seconds of a fresh interpreter's imports. The server starts on the first
    process and keeps the environment of that moment (no caller changes os.environ for its processes)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(rank_preload())
    _start_quietly()
    return ctx


FORKSERVER_LOG = os.path.join(tempfile.gettempdir(), f"moe_quant_tests_forkserver_{os.getpid()}.log")


def _start_quietly() -> None:
    """Start the forkserver, and multiprocessing's resource tracker, with stdout on /dev/null and stderr into
    :data:`FORKSERVER_LOG`: their processes keep the descriptors of their start, and a session starts them outside
    any test's capture (at collection), where the preload's import-time notes (torchao's), a process's traceback
    and the tracker's notes at exit would reach the terminal. A forked process writes there too."""
    from multiprocessing import forkserver as _fs, resource_tracker

    if getattr(_fs._forkserver, "_forkserver_pid", None) is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    log = os.open(FORKSERVER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(null, 1)
        os.dup2(log, 2)
        resource_tracker.ensure_running()
        _fs.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null, log):
            os.close(fd)
