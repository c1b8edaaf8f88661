"""The fork server of ``tests/warm_python.py`` (``repo_subprocess.run_python(..., warm=True)``), tested directly.

A forked command must do what ``python ARGS`` does (stdout, stderr, exit status, ``sys.argv``, ``sys.path``,
working directory, environment); a request it cannot serve faithfully is refused; a command it forked never
outlives its timeout, nor the server. The servers here run ``warm_python.py``'s own code with a cheap preload
(``json``, not torch: the preload is all a test here would wait for), through the protocol of its docstring.
"""

import json
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from process_checks import gone, kill_quietly, wait_until
from repo_subprocess import ROOT

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "fork")),
                                reason="the warm server forks and uses Linux's PR_SET_PDEATHSIG")

WARM = ROOT / "tests" / "warm_python.py"
# warm_python.py as `python tests/warm_python.py` runs it (sys.path[0], the file's folder, is not kept: the
# server keeps sys.path[1:]), with a preload that takes milliseconds
SERVER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("warm_python", sys.argv[1])
    warm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warm)
    warm.PRELOAD = ("json",)
    warm.main()
""")


def _server_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # repo_subprocess starts it so
    env["PYTEST_CURRENT_TEST"] = "the server's"
    return env


class Server:
    def __init__(self, log: Path):
        self.env = _server_env()
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(WARM)], cwd=ROOT, env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         bufsize=1)
        assert "ready" in self.reply(60), self.log.read_text()

    def reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else {"no reply": self.log.read_text()[-3000:]}

    def send(self, argv: list, cwd: Path, out: Path, env=None, timeout=None) -> None:
        request = {"argv": argv, "env": self.env if env is None else env, "cwd": str(cwd),
                   "stdout": str(out / "stdout"), "stderr": str(out / "stderr"), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def run(self, argv: list, cwd: Path, out: Path, env=None, timeout=None) -> tuple:
        """(reply, stdout, stderr) of one forked command."""
        out.mkdir(parents=True, exist_ok=True)
        self.send(argv, cwd, out, env, timeout)
        reply = self.reply(60 if timeout is None else timeout + 60)
        return (reply, *((out / n).read_text() if (out / n).exists() else None for n in ("stdout", "stderr")))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("warm") / "server.log")
    yield s
    s.close()


PROBE = '''
import json, os, sys


def main():
    main = sys.modules["__main__"]
    print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
                      "main": [main.__name__, getattr(main, "__file__", None)]}), flush=True)
    outcome = sys.argv[-1]
    if outcome == "exit3":
        raise SystemExit(3)
    if outcome == "raise":
        raise ValueError("the probe fails on purpose")
'''


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """lib/probe_lib.py (on PYTHONPATH), work/ (the working directory: work/probe_main.py for ``-m``, work/rel
    on PYTHONPATH as a relative entry), scripts/probe_script.py (run as ``../scripts/probe_script.py``)."""
    root = tmp_path_factory.mktemp("tree")
    for d in ("lib", "work/rel", "scripts"):
        (root / d).mkdir(parents=True)
    (root / "lib" / "probe_lib.py").write_text(PROBE)
    for f in (root / "work" / "probe_main.py", root / "scripts" / "probe_script.py"):
        f.write_text("import probe_lib\n\nprobe_lib.main()\n")
    return root


FORMS = {
    "-m": ["-m", "probe_main"],
    "-c": ["-c", "import probe_lib\n\nprobe_lib.main()\n"],
    "FILE": ["../scripts/probe_script.py"],
}
OUTCOMES = {"ok": 0, "exit3": 3, "raise": 1}


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("form", FORMS)
def test_a_forked_command_does_what_a_fresh_interpreter_does(server, tree, tmp_path, form, outcome):
    work = tree / "work"
    argv = [*FORMS[form], "--flag", "two words", outcome]
    env = dict(server.env, PYTHONPATH=os.pathsep.join([str(tree / "lib"), "rel"]),
               PYTEST_CURRENT_TEST="the request's")  # the two variables that may differ from the server's
    fresh = subprocess.run([sys.executable, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    reply, stdout, stderr = server.run(argv, work, tmp_path, env=env, timeout=60)

    assert reply == {"rc": OUTCOMES[outcome]}, (reply, stderr)
    assert fresh.returncode == OUTCOMES[outcome], fresh.stderr
    assert stdout == fresh.stdout
    assert stderr == fresh.stderr
    if outcome == "raise":
        lines = stderr.strip().splitlines()
        assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "ValueError: the probe fails on purpose"
    else:
        assert stderr == ""
    got = json.loads(stdout)
    assert got["cwd"] == str(work) and got["env"] == env
    assert got["argv"] == {"-m": [str(work / "probe_main.py")], "-c": ["-c"], "FILE": [argv[0]]}[form] + argv[-3:]
    # sys.path: the script's folder, the working directory or '' first; then PYTHONPATH; then the installation
    first = {"-m": str(work), "-c": "", "FILE": str(tree / "scripts")}[form]
    path = got["path"]
    assert path[0] == first
    pp = [str(tree / "lib"), str(work / "rel")]
    i = path.index(pp[0])
    stdlib = os.path.dirname(os.__file__)
    assert path[i:i + 2] == pp and i + 2 <= path.index(stdlib) and first not in path[1:], path


@pytest.mark.parametrize("change", ["added", "removed", "changed"])
def test_a_request_whose_environment_differs_otherwise_is_refused(server, tree, tmp_path, change):
    env = dict(server.env)
    if change == "added":
        env["MOE_QUANT_WARM_TEST"] = "1"
    elif change == "removed":
        env.pop(next(k for k in sorted(env) if k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")))
    else:
        env["PATH"] = str(tmp_path) + os.pathsep + env.get("PATH", "")
    reply, stdout, _ = server.run(["-c", "print('ran')"], tree / "work", tmp_path, env=env, timeout=60)
    assert "refused" in reply and "environment" in reply["refused"], reply
    assert stdout is None  # nothing forked
    # the server goes on
    assert server.run(["-c", "print('ran')"], tree / "work", tmp_path / "next", timeout=60)[:2] == ({"rc": 0}, "ran\n")


@pytest.mark.parametrize("argv", [[], ["-m"], ["-c"], ["-X", "dev", "x.py"]])
def test_a_command_line_it_does_not_run_is_refused(server, tree, tmp_path, argv):
    reply, stdout, _ = server.run(argv, tree / "work", tmp_path, timeout=60)
    assert "refused" in reply and "not a command" in reply["refused"], reply
    assert stdout is None


SPAWNS = """
import os, subprocess, time
p = subprocess.Popen(["sleep", "60"])
print(os.getpid(), p.pid, flush=True)
time.sleep(60)
"""


def test_a_timeout_kills_the_process_group(server, tree, tmp_path):
    timeout = 2.0
    t0 = time.monotonic()
    reply, stdout, stderr = server.run(["-c", SPAWNS], tree / "work", tmp_path, timeout=timeout)
    elapsed = time.monotonic() - t0
    pids = [int(p) for p in (stdout or "").split()]
    try:
        assert reply == {"timeout": True}, (reply, stderr)
        assert timeout <= elapsed < timeout + 30
        assert len(pids) == 2, f"the command did not start its grandchild within {timeout} s: {stdout!r} {stderr!r}"
        child, grandchild = pids
        assert wait_until(lambda: gone(child) and gone(grandchild)), \
            f"still running after the timeout: {[p for p in pids if not gone(p)]}"
    finally:
        kill_quietly(*pids)


SLEEPS = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n"


@pytest.mark.parametrize("end", ["SIGKILL", "stdin EOF"])
def test_a_running_command_dies_with_the_server(tree, tmp_path, end):
    server = Server(tmp_path / "server.log")
    pid = None
    try:
        server.send(["-c", SLEEPS], tree / "work", tmp_path, timeout=60)
        # the command prints its pid once it runs, after the server's fork set up its death with the server
        assert wait_until(lambda: (tmp_path / "stdout").exists() and (tmp_path / "stdout").read_text().endswith("\n")), \
            server.log.read_text()
        pid = int((tmp_path / "stdout").read_text())
        assert not gone(pid)
        if end == "SIGKILL":
            server.proc.kill()
        else:
            server.proc.stdin.close()
        assert server.proc.wait(10) is not None
        assert wait_until(lambda: gone(pid)), f"the command ({pid}) outlived the server ({end})"
    finally:
        kill_quietly(pid)
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        server.proc.stdout.close()
