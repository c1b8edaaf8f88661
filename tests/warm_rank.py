"""The interpreter torchrun starts for a rank under :func:`repo_subprocess.warm_ranks` (``PYTHON_EXEC``: a copy of
this file under a ``#!`` line, :func:`repo_subprocess.rank_client`): the rank runs as a child of
``tests/warm_ranks.py``'s server, which imported torch and torchtitan once; see that module for the protocol.

Standard library only, and fast to start. Where no server listens at ``MOE_QUANT_WARM_RANKS`` or it refuses the
request, this process becomes the real interpreter with the same arguments and environment (``exec``).
"""

import json
import os
import signal
import socket
import struct
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _cold() -> None:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def _reply(conn: socket.socket, buf: list) -> dict | None:
    """The server's next line (``buf``: what was read past it), None at EOF."""
    while b"\n" not in buf[0]:
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf[0] += chunk
    line, buf[0] = buf[0].split(b"\n", 1)
    return json.loads(line)


def main() -> None:
    path = os.environ.get("MOE_QUANT_WARM_RANKS", "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        _cold()
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    pending = []  # signals that came before the child ran
    for sig in RELAYED:
        signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        socket.send_fds(conn, [struct.pack(">I", len(request))], [0, 1, 2])
        conn.sendall(request)
    except OSError:
        conn.close()
        _cold()
    buf = [b""]
    first = _reply(conn, buf)
    if first is None or "pid" not in first:  # refused (or the server died before the fork)
        conn.close()
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        for sig in pending:
            os.kill(os.getpid(), sig)
        _cold()

    def relay(signum, _frame):
        try:
            conn.sendall(b"SIG %d\n" % signum)
        except OSError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    for sig in pending:
        relay(sig, None)
    done = _reply(conn, buf)
    if done is None:  # the server died: so did the child (PR_SET_PDEATHSIG)
        sys.exit(1)
    status = done["status"]
    if os.WIFSIGNALED(status):  # die as the child died: torchrun reports exitcode -N
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
