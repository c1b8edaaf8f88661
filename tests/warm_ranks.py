"""A fork server for torchrun's ranks: ``python tests/warm_ranks.py SOCKET MODULES``, with ``tests/warm_rank.py``
as the interpreter torchrun starts (its ``PYTHON_EXEC``); :func:`repo_subprocess.warm_ranks` sets both up and names
the modules to preload (``MODULES``, comma separated: :func:`repo_subprocess.rank_preload`).

A rank of a torchtitan job spends about 12 s of a CPU core importing torch, torch._dynamo, torchtitan and torchao
before its first line of work; a 2-rank job of the CPU suite trains for a few seconds. This server imports those
third-party modules once (:mod:`warm_python`'s preload, and torchtitan's trainer where it imports on its own) and
listens on a Unix socket. ``warm_rank.py``, started by torchrun as ``PYTHON_EXEC -u -m MOD ARGS`` (or ``-u FILE
ARGS``), connects, sends its command line, environment and working directory with its descriptors 0, 1 and 2, and
the server forks a child that becomes that command as :mod:`warm_python` runs one (its ``sys.argv``, ``sys.path``,
``__main__``, exit status), on the rank's own stdin, stdout and stderr, unbuffered for ``-u`` (or
``PYTHONUNBUFFERED``) as the interpreter is, with ``torch.set_num_threads`` from the rank's ``OMP_NUM_THREADS`` (the
OpenMP runtime read the variable when this server loaded torch). The client relays what torchrun does to it: a
signal it gets is sent to the child's process group; the child's exit status is its own (a child killed by signal N
kills the client with N, the ``exitcode: -N`` torchrun reports). A client that dies (torchrun's SIGKILL) takes the
child's process group with it.

What torch reads at import is this server's: a request whose environment differs from the server's in anything
but what torchrun sets for a rank (:data:`RANK_VARS`), ``PYTHONPATH``, ``PYTEST_CURRENT_TEST`` and moe_quant's own
``MOE_QUANT_*`` (moe_quant is not preloaded) is refused, and the client runs the real interpreter instead
(``exec``), as it does when no server listens yet (the preload takes a while; jobs started meanwhile run cold).

Protocol, per connection: the client sends a 4-byte big-endian length with descriptors 0, 1, 2 attached
(``SCM_RIGHTS``), then that many bytes of JSON ``{"argv", "env", "cwd"}``; the server answers lines of JSON:
``{"pid": N}`` once the child runs, or ``{"refused": reason}``; then ``{"status": S}`` (``waitpid``'s status) when
it ends. The client sends ``"SIG N"`` lines for the signals it gets; its EOF (it died) makes the server SIGKILL the
child's process group. EOF on this server's stdin ends it, and with it every child (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys

import warm_python

# what torch.distributed.run puts in a rank's environment (torch 2.11-2.13), none read by torch at import
RANK_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
             "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "OMP_NUM_THREADS")
FREE_PREFIXES = ("MOE_QUANT_",)


def _free(name: str) -> bool:
    return name in RANK_VARS or name in warm_python._ENV_FREE or name.startswith(FREE_PREFIXES)


def same_env(env: dict) -> bool:
    return ({k: v for k, v in env.items() if not _free(k)}
            == {k: v for k, v in warm_python._ENV.items() if not _free(k)})


def parse_argv(argv: list) -> tuple[list, bool] | None:
    """(the command warm_python runs, unbuffered) of the interpreter's ``argv``: ``[-u] (-m MOD | -c CODE | FILE)
    ARGS``; None for any other option."""
    unbuffered = bool(argv) and argv[0] == "-u"
    rest = argv[1:] if unbuffered else argv
    if not rest or rest[0] in ("-m", "-c") and len(rest) < 2 or rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        return None
    return rest, unbuffered


def _streams(unbuffered: bool) -> None:
    """``sys.stdout`` / ``sys.stderr`` over descriptors 1 and 2 as the interpreter makes them (``-u``: no
    buffer; stdout line-buffered on a terminal, stderr by line)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffer, encoding=getattr(sys, name).encoding,
                                  errors="backslashreplace" if fd == 2 else getattr(sys, name).errors,
                                  line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=sys.stdin.encoding, errors=sys.stdin.errors)


def _child(req: dict, fds: list, command: list, unbuffered: bool, server: int, sockets: list, pidfds: list) -> None:
    """In the forked child: become the rank; never returns."""

    def setup():
        os.setpgid(0, 0)
        warm_python._die_with(server)
        for s in sockets:
            s.close()
        for fd in pidfds:
            os.close(fd)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        _streams(unbuffered)
        threads = req["env"].get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))

    warm_python.become(setup, command, req["env"], req["cwd"])


def _recv_request(conn: socket.socket) -> tuple[dict, list]:
    conn.settimeout(30)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request starts with its length and descriptors 0, 1, 2")
    size = struct.unpack(">I", head)[0]
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the request ended early")
        data += chunk
    conn.settimeout(None)
    return json.loads(data), fds


def _send(conn: socket.socket, reply: dict) -> None:
    try:
        conn.sendall((json.dumps(reply) + "\n").encode())
    except OSError:
        pass


class _Rank:
    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid, self.pidfd, self.buf, self.client_gone = conn, pid, os.pidfd_open(pid), b"", False


def _kill_group(pid: int, sig: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
            return
        except OSError:
            pass


def serve(path: str, preload: list) -> None:
    """Import the modules ``preload`` names, listen on ``path``, fork a rank per connection until stdin ends."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # nothing imported writes where a rank's output would go
    os.close(null)
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients connect only once the preload is done
    server = os.getpid()
    ranks: dict[int, _Rank] = {}  # by pidfd
    try:
        while True:
            watched = [0, listener, *ranks, *(r.conn for r in ranks.values() if not r.client_gone)]
            ready = select.select(watched, [], [])[0]
            if 0 in ready and not os.read(0, 4096):
                return
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_request(conn)
                except (OSError, ValueError) as e:
                    _send(conn, {"refused": f"{type(e).__name__}: {e}"})
                    conn.close()
                    continue
                parsed = parse_argv(req.get("argv", []))
                reason = ("not a command line this server runs" if parsed is None else
                          None if same_env(req.get("env", {})) else "the environment differs from the server's")
                if reason:
                    for fd in fds:
                        os.close(fd)
                    _send(conn, {"refused": reason})
                    conn.close()
                    continue
                command, unbuffered = parsed
                unbuffered = unbuffered or bool(req["env"].get("PYTHONUNBUFFERED"))  # as the interpreter reads it
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, command, unbuffered, server, [listener, conn, *(r.conn for r in ranks.values())],
                           list(ranks))
                for fd in fds:
                    os.close(fd)
                try:
                    os.setpgid(pid, pid)  # the child does so too: either may run first
                except OSError:
                    pass
                rank = _Rank(conn, pid)
                ranks[rank.pidfd] = rank
                _send(conn, {"pid": pid})
            for rank in list(ranks.values()):
                if not rank.client_gone and rank.conn in ready:  # a signal to relay, or the client is gone
                    data = rank.conn.recv(4096)
                    if not data:
                        rank.client_gone = True
                        _kill_group(rank.pid, signal.SIGKILL)
                    rank.buf += data
                    *lines, rank.buf = rank.buf.split(b"\n")
                    for line in lines:
                        if line.startswith(b"SIG "):
                            _kill_group(rank.pid, int(line[4:]))
                if rank.pidfd in ready:
                    _, status = os.waitpid(rank.pid, 0)
                    _send(rank.conn, {"status": status})
                    os.close(rank.pidfd)
                    rank.conn.close()
                    del ranks[rank.pidfd]
    finally:
        for rank in ranks.values():
            _kill_group(rank.pid, signal.SIGKILL)
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2].split(","))
