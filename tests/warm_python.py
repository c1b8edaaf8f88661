"""A fork server for ``repo_subprocess.run_python(..., warm=True)``: ``python tests/warm_python.py``.

A fresh ``python`` spends about 5 s of a CPU core importing torch, torch._dynamo, sympy, numpy and torchao before
an entry point of this repository reaches its first line of its own (a benchmark without a GPU then exits after
0.1 s). This process imports those third-party modules once, then for each request forks a child that runs the
command the way the interpreter would: ``python -m MOD ARGS``, ``python -c CODE ARGS`` or ``python FILE ARGS``,
with the request's environment, working directory, ``sys.argv``, and a ``sys.path`` built as the interpreter
builds it (the script's folder, the working directory or ``''`` first, then ``PYTHONPATH``, then the
installation's paths); stdin ``/dev/null``, stdout and stderr into the request's files, the exit status of
``SystemExit`` or 1 after an uncaught exception's traceback. No module of this repository is imported here, so
a child imports every one of them itself, through its own ``sys.path``.

What differs from a fresh interpreter, and why the callers do not mind: the preloaded modules' import-time
output (torchao's notes about its extensions) goes to this server's stderr, not the child's
(``tests/test_quiet_import.py`` keeps a real interpreter for that); torch read the environment at import in
this process, so a request whose environment differs from this server's in anything but ``PYTHONPATH`` (and
pytest's ``PYTEST_CURRENT_TEST``) is refused (the caller starts a real interpreter instead).

Protocol: one JSON request per line on stdin (``argv`` without the interpreter, ``env``, ``cwd``, ``stdout``,
``stderr`` (file paths), ``timeout`` in seconds), one JSON reply per line on stdout: ``{"rc": int}``,
``{"timeout": true}`` (the child's process group was killed) or ``{"refused": reason}``. EOF on stdin ends it,
and kills a command still running (as does this server's end: the child dies with it, ``PR_SET_PDEATHSIG``).
"""

import json
import os
import select
import signal
import sys
import time

PRELOAD = ("torch", "torch._dynamo", "sympy", "numpy", "torchao.quantization")
_BASE_PATH = sys.path[1:]  # what the installation adds (sys.path[0] is this file's folder)
_ENV = dict(os.environ)


# may differ: torch reads none of them (the last two: repo_subprocess.warm_ranks, for torchrun's ranks)
_ENV_FREE = ("PYTHONPATH", "PYTEST_CURRENT_TEST", "PYTHON_EXEC", "MOE_QUANT_WARM_RANKS")


def _same_env(env: dict) -> bool:
    return ({k: v for k, v in env.items() if k not in _ENV_FREE}
            == {k: v for k, v in _ENV.items() if k not in _ENV_FREE})


def _child(req: dict, proto: tuple, server: int) -> None:
    """In the forked child: become the command; never returns."""

    def setup():
        os.setpgid(0, 0)
        _die_with(server)
        for fd in proto:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)

    become(setup, req["argv"], req["env"], req["cwd"])


def become(setup, argv: list, env: dict, cwd: str) -> None:
    """In a forked child: ``setup()`` (its process group, descriptors), then the command ``argv`` in the
    environment ``env`` and the working directory ``cwd``; exits with its status (never returns)."""
    code = 1
    try:
        setup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        code = _run(argv, env.get("PYTHONPATH", ""))
    except BaseException:  # noqa: BLE001 - the child reports anything, as the interpreter would
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(_finish(code))


def _die_with(server: int) -> None:
    """Linux: this process gets SIGKILL when the server ends (killed, or interrupted while it waits), so that a
    command never outlives the test session in its own process group."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server ended before prctl
        os._exit(1)


def _sys_path(first: str, extra: list) -> list:
    """``sys.path`` as the interpreter builds it: ``first``, what ``.pth`` files put in front, ``PYTHONPATH``, the
    standard library and site-packages (this server was started without ``PYTHONPATH``)."""
    zips = [i for i, p in enumerate(_BASE_PATH) if p.endswith("python%d%d.zip" % sys.version_info[:2])]
    i = zips[0] if zips else 0
    return [first, *_BASE_PATH[:i], *extra, *_BASE_PATH[i:]]


def _excepthook(skip_runpy: bool) -> None:
    """The uncaught exception's traceback without this file's frames (nor runpy's, for ``FILE`` and ``-c``, which
    the interpreter runs without it)."""
    import traceback

    kind, value, tb = sys.exc_info()
    here = os.path.abspath(__file__)
    while tb is not None and (tb.tb_frame.f_code.co_filename == here or skip_runpy and (
            tb.tb_frame.f_code.co_filename in ("<frozen runpy>",) or tb.tb_frame.f_globals.get("__name__") == "runpy")):
        tb = tb.tb_next
    if sys.excepthook is sys.__excepthook__:
        traceback.print_exception(kind, value, tb)
    else:
        sys.excepthook(kind, value, tb)


def _run(argv: list, pythonpath: str) -> int:
    import random
    import runpy
    import types

    random.seed()  # a fresh interpreter's random state, not the server's
    extra = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-m":
            sys.path[:] = _sys_path(os.getcwd(), extra)
            sys.argv = ["-m", *argv[2:]]
            runpy._run_module_as_main(argv[1], alter_argv=True)
        elif argv[0] == "-c":
            sys.path[:] = _sys_path("", extra)
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.path[:] = _sys_path(os.path.dirname(os.path.abspath(argv[0])), extra)
            sys.argv = list(argv)
            path = os.path.join(os.getcwd(), argv[0])  # the interpreter's __file__: absolute, not normalized
            if os.path.isfile(path) and not path.endswith(".pyc"):  # a source file: run as the interpreter does
                from importlib.machinery import SourceFileLoader

                with open(path, "rb") as f:
                    code = compile(f.read(), path, "exec", dont_inherit=True)
                main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
                exec(code, main.__dict__)
            else:  # a folder or zip file with a __main__.py, a .pyc
                runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback, status 1
        _excepthook(skip_runpy=argv[0] != "-m")
        return 1
    return 0


def _finish(code: int) -> int:
    """What the interpreter does on the way out: join threads, run atexit functions, flush."""
    import atexit
    import threading

    for step in (threading._shutdown, atexit._run_exitfuncs):
        try:
            step()
        except BaseException:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    return code & 0xFF


def _serve(req: dict, proto: tuple) -> dict:
    argv = req["argv"]
    if not argv or argv[0] in ("-m", "-c") and len(argv) < 2 or argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        return {"refused": f"not a command this server runs: {argv[:2]}"}
    if not _same_env(req["env"]):
        return {"refused": "the environment differs from the server's"}
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(req, proto, server)
    try:
        os.setpgid(pid, pid)  # the child does so too: either may run first
    except OSError:
        pass
    return _wait(pid, req.get("timeout"), proto[0])


def _wait(pid: int, timeout, requests: int) -> dict:
    """Wait for the child; its process group is killed at the timeout, when the client closes its end of the
    requests (it sends nothing while it waits for a reply: the session ended, e.g. interrupted) and when this
    server is interrupted."""
    deadline = time.monotonic() + timeout if timeout else None
    delay = 0.002
    reaped = False
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reaped = True
                return {"rc": os.waitstatus_to_exitcode(status)}
            if deadline is not None and time.monotonic() > deadline:
                return {"timeout": True}
            if select.select([requests], [], [], delay)[0]:  # EOF: nobody waits for this command any more
                return {"gone": True}
            delay = min(2 * delay, 0.05)
    finally:
        if not reaped:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            os.waitpid(pid, 0)


def main() -> None:
    # the protocol on its own descriptors; fd 0 and 1 become /dev/null (nothing imported writes into the replies)
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    requests, replies = os.fdopen(rfd, "r"), os.fdopen(wfd, "w")
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    replies.write(json.dumps({"ready": list(PRELOAD)}) + "\n")
    replies.flush()
    for line in requests:
        try:
            reply = _serve(json.loads(line), (rfd, wfd))
        except Exception as e:  # noqa: BLE001 - a broken request is answered, the server goes on
            reply = {"refused": f"{type(e).__name__}: {e}"}
        if reply.get("gone"):
            break
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
