"""The fork server for torchrun's ranks (``tests/warm_ranks.py``) and its client (``tests/warm_rank.py``, torchrun's
``PYTHON_EXEC``), tested directly.

A rank run through the client must do what ``python [-u] ARGS`` does on the same descriptors: output (buffered as
the interpreter buffers it), exit status, death by a signal, ``sys.argv``; a signal sent to the client reaches the
rank; a client that dies takes the rank with it; a request the server cannot serve faithfully, or no server at all,
runs the real interpreter. The servers here preload ``colorsys`` only (``torch`` for the torchrun case).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from process_checks import gone, kill_quietly, wait_until
from repo_subprocess import ROOT, rank_client

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")),
                                reason="the rank server forks, passes descriptors and waits on pidfds (Linux)")

SERVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])  # as `python tests/warm_ranks.py` has it
    import warm_ranks
    warm_ranks.serve(sys.argv[2], sys.argv[3].split(","))
""")


class RankServer:
    def __init__(self, folder: Path, preload: str = "colorsys", unbuffered: bool = False):
        self.sock = str(folder / "socket")
        self.exe = rank_client(folder)
        self.log = folder / "server.log"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONUNBUFFERED")}
        if unbuffered:
            self.env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT / "tests"), self.sock, preload],
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert wait_until(lambda: os.path.exists(self.sock) or self.proc.poll() is not None, 120), self.log.read_text()
        assert self.proc.poll() is None, self.log.read_text()
        self.env["MOE_QUANT_WARM_RANKS"] = self.sock

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", params=["buffered", "PYTHONUNBUFFERED"])
def server(tmp_path_factory, request):
    """A server and its client; the environment of both with PYTHONUNBUFFERED or without."""
    s = RankServer(tmp_path_factory.mktemp("ranks"), unbuffered=request.param != "buffered")
    yield s
    s.close()


PROBE = """
import sys
warm = "colorsys" in sys.modules  # the servers' preload; nothing a fresh interpreter imports
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
                  "rank": os.environ.get("RANK"), "warm": warm, "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
outcome = sys.argv[-1]
if outcome == "exit3":
    raise SystemExit(3)
if outcome == "raise":
    raise ValueError("the probe fails on purpose")
if outcome == "lost":  # what is still buffered is lost, unless -u
    os._exit(4)
if outcome == "SIGKILL":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
""".replace("import json, os, sys", "import json, os, signal, sys")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    (root / "work").mkdir()
    (root / "work" / "probe_main.py").write_text(PROBE)
    (root / "scripts").mkdir()
    (root / "scripts" / "probe_script.py").write_text(PROBE)
    return root


def _run(cmd: list, cwd: Path, env: dict) -> tuple:
    """(pid, exit status, stdout, stderr) of ``cmd`` with ``on stdin`` on its stdin."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    out, err = p.communicate("on stdin", timeout=60)
    return p.pid, p.returncode, out, err


OUTCOMES = {"ok": 0, "exit3": 3, "raise": 1, "lost": 4, "SIGKILL": -signal.SIGKILL}


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("unbuffered", [True, False])
@pytest.mark.parametrize("form", ["-m", "FILE"])
def test_a_rank_does_what_the_interpreter_does(server, tree, form, unbuffered, outcome):
    command = ["-m", "probe_main"] if form == "-m" else ["../scripts/probe_script.py"]
    argv = [*(["-u"] if unbuffered else []), *command, "--flag", "two words", outcome]
    env = dict(server.env, RANK="1", WORLD_SIZE="2")  # what torchrun adds may differ from the server's
    client, rc, out, err = _run([server.exe, *argv], tree / "work", env)
    _, cold_rc, cold_out, cold_err = _run([sys.executable, *argv], tree / "work", env)

    assert rc == cold_rc == OUTCOMES[outcome], (err, cold_err)
    assert err == cold_err
    if outcome == "lost" and not unbuffered and "PYTHONUNBUFFERED" not in env:
        assert out == cold_out == ""  # buffered, then lost: as the interpreter loses it
        return
    got, want = json.loads(out), json.loads(cold_out)
    # forked from the server, which preloaded colorsys
    assert got["warm"] and not want["warm"], (got, want, server.log.read_text()[-2000:])
    assert got["pid"] != client  # not the client: a child of the server
    for key in ("argv", "path0", "cwd", "rank", "stdin"):
        assert got[key] == want[key], key
    assert got["stdin"] == "on stdin" and got["rank"] == "1"


@pytest.mark.parametrize("how", ["TORCH_LOGS differs", "no server"])
def test_the_real_interpreter_runs_what_the_server_cannot(server, tree, tmp_path, how):
    env = dict(server.env)
    if how == "no server":
        env["MOE_QUANT_WARM_RANKS"] = str(tmp_path / "nobody")
    else:
        env["TORCH_LOGS"] = "dynamo"  # torch reads it at import: the server's import did not see it
    p = subprocess.Popen([server.exe, "-u", "-m", "probe_main", "exit3"], cwd=tree / "work", env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    got = json.loads(out)
    assert not got["warm"] and got["pid"] == p.pid  # the client became the interpreter (exec)
    assert server.proc.poll() is None  # and the server goes on


SLEEPER = """
import os, signal, subprocess, sys, time
p = subprocess.Popen(["sleep", "60"])
print(os.getpid(), p.pid, flush=True)
if sys.argv[1] == "handles":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
time.sleep(60)
"""


@pytest.mark.parametrize("end", ["SIGTERM", "SIGTERM handled", "client SIGKILL"])
def test_the_client_relays_signals_and_takes_the_rank_with_it(server, tree, tmp_path, end):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    p = subprocess.Popen([server.exe, "-u", str(tmp_path / "sleeper.py"), "handles" if "handled" in end else "-"],
                         cwd=tmp_path, env=server.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and p.pid not in pids, (pids, p.pid)
        rank, grandchild = pids
        assert not gone(rank) and not gone(grandchild)
        time.sleep(0.2)  # the handler is set up
        p.send_signal(signal.SIGKILL if end == "client SIGKILL" else signal.SIGTERM)
        rc = p.wait(30)
        assert rc == {"SIGTERM": -signal.SIGTERM, "SIGTERM handled": 7, "client SIGKILL": -signal.SIGKILL}[end]
        if end != "SIGTERM handled":  # the rank's process group (its children too) is gone
            assert wait_until(lambda: gone(rank) and gone(grandchild)), [x for x in pids if not gone(x)]
        else:
            assert wait_until(lambda: gone(rank))
    finally:
        kill_quietly(*pids)
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        p.stderr.close()


def test_the_ranks_die_with_the_server(tree, tmp_path):
    s = RankServer(tmp_path)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    p = subprocess.Popen([s.exe, str(tmp_path / "sleeper.py"), "-"], cwd=tmp_path, env=s.env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rank = None
    try:
        rank = int(p.stdout.readline().split()[0])
        assert not gone(rank)
        s.proc.kill()
        assert wait_until(lambda: gone(rank)), "the rank outlived the server"
        assert p.wait(30) == 1  # the client saw the server go
    finally:
        kill_quietly(rank)
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        s.close()


RANK = """
import json, os, sys
warm = "torch" in sys.modules  # before this script imported anything
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
sys.stdout.write(json.dumps({"rank": dist.get_rank(), "sum": t.tolist(), "warm": warm,  # one write: the ranks
                             "threads": torch.get_num_threads(), "argv": sys.argv[1:]}) + "\\n")  # share the pipe
rank = dist.get_rank()
dist.destroy_process_group()
if sys.argv[1] == "fail" and rank == 1:
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_torchrun_runs_its_ranks_warm(tmp_path, outcome):
    """``torchrun`` with the client as ``PYTHON_EXEC``: its ranks are forks of the server (torch preloaded), with
    torchrun's one thread a rank (``OMP_NUM_THREADS=1``); a rank killed by SIGKILL is reported as torchrun reports
    it."""
    s = RankServer(tmp_path, preload="torch")
    try:
        (tmp_path / "rank.py").write_text(RANK)
        env = dict(s.env, PYTHON_EXEC=s.exe)
        env.pop("OMP_NUM_THREADS", None)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(tmp_path / "rank.py"), outcome], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240)
        lines = sorted((json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")), key=lambda r: r["rank"])
        assert [r["sum"] for r in lines] == [[3.0] * 3] * 2, proc.stderr[-3000:]
        assert all(r["warm"] and r["threads"] == 1 and r["argv"] == [outcome] for r in lines), lines
        if outcome == "ok":
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    finally:
        s.close()
