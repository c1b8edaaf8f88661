"""The demo's command line: ``--plot`` checked before training, ``--threads``, the backend line."""

import io
import os
import sys

import pytest
import torch
from repo_subprocess import run_python

from moe_quant import demo


def _demo_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert "tiny MoE" not in out, "the demo started training before rejecting --plot"
    return err


@pytest.mark.parametrize(
    "plot, message",
    [
        ("curves.jpg", "must end with .png"),
        ("no_such_dir/curves.png", "does not exist"),
        ("README.md/curves.png", "does not exist"),  # the "directory" is a file
    ],
)
def test_demo_rejects_bad_plot_path_before_training(plot, message, capsys):
    err = _demo_error(["--plot", plot], capsys)
    assert message in err, err


def test_demo_rejects_a_directory_as_plot(tmp_path, capsys):
    target = tmp_path / "curves.png"
    target.mkdir()
    assert "is a directory" in _demo_error(["--plot", str(target)], capsys)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write to read-only directories")
def test_demo_rejects_unwritable_plot_directory(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "cannot write" in _demo_error(["--plot", str(locked / "curves.png")], capsys)
    finally:
        locked.chmod(0o700)


def test_demo_plot_path_accepted(tmp_path):
    assert demo.check_plot_path(str(tmp_path / "curves.png")) is None
    assert demo.check_plot_path(str(tmp_path / "curves.PNG")) is None
    assert list(tmp_path.iterdir()) == []  # the writability probe leaves nothing behind


def test_demo_short_run_reports_threads_backend_and_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    threads = torch.get_num_threads()
    png = tmp_path / "curves.png"
    try:
        assert demo.main(["--steps", "3", "--tokens", "64", "--plot", str(png), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "1 CPU thread(s)" in out, out
    assert "mxfp8 run: scale mode rceil, GEMM backend emulated" in out, out
    assert "quantization PyTorch reference" in out, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_keeps_both_curves_visible_where_they_coincide():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    same = [0.5, 0.4, 0.3, 0.25]
    results = {name: demo.RunResult(losses=list(same), eval_loss=0.2) for name in ("bf16", "mxfp8")}
    fig = demo.loss_figure(results, plt)
    try:
        lines = {line.get_label().split()[0]: line for line in fig.axes[0].get_lines()}
        bf16, mx = lines["bf16"], lines["mxfp8"]
        # the curve drawn on top is thinner and dashed, so the one below shows around and through it
        assert mx.get_zorder() > bf16.get_zorder()
        assert bf16.get_linewidth() >= 2 * mx.get_linewidth()
        assert mx.get_linestyle() != "-"
        assert bf16.get_color() != mx.get_color()
    finally:
        plt.close(fig)


_UNUSABLE = ["meta", "garbage", "xla"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])


@pytest.mark.parametrize("device", _UNUSABLE)
def test_demo_rejects_an_unusable_device_in_one_line_before_training(device):
    proc = run_python("-m", "moe_quant.demo", "--device", device, "--steps", "1", "--tokens", "8", warm=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "tiny MoE" not in proc.stdout, "the demo started training"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m moe_quant.demo: --device"), proc.stderr[-3000:]
    assert device in lines[0]


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--tokens", "abc"], ["--threads", "-1"], ["--steps", "1.5"]])
def test_demo_rejects_bad_numbers_while_parsing(argv, capsys):
    err = _demo_error(argv, capsys)
    assert f"argument {argv[0]}" in err, err


def test_demo_writes_one_progress_line_per_run_to_a_log(tmp_path):
    """stderr a file or a pipe (a CI log): one summary line per training run, not a line per step."""
    proc = run_python("-m", "moe_quant.demo", "--steps", "40", "--tokens", "64", "--plot", str(tmp_path / "c.png"),
                      timeout=300, warm=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final held-out loss" in proc.stdout, proc.stdout
    lines = proc.stderr.splitlines()  # splits at "\r" too, as a log viewer shows a redrawn bar
    assert [line.split(":")[0].strip() for line in lines] == ["bf16", "mxfp8"], proc.stderr[-3000:]
    assert all("40/40 steps" in line for line in lines), lines


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tqdm", ["installed", "missing"])
def test_progress_is_live_on_a_terminal_and_one_line_elsewhere(tqdm, monkeypatch):
    """A bar drawn from the start on a terminal (tqdm, else the text bar); nothing until the end on a log."""
    if tqdm == "missing":
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    else:
        pytest.importorskip("tqdm")
    log, terminal = io.StringIO(), _Terminal()
    for stream in (log, terminal):
        bar = demo._Progress(100, "bf16", stream=stream)
        for step in range(100):
            bar(step, 0.5)
            if step == 49:
                mid = stream.getvalue()
        bar.close()
        if stream is log:
            assert mid == "" and stream.getvalue().count("\n") == 1 and "100/100 steps" in stream.getvalue()
        else:
            assert mid and "100/100" in stream.getvalue(), stream.getvalue()  # drawn while it runs


WITHOUT_OTHER_EXTRAS = """
import runpy, sys
BLOCKED = ("pytest", "hypothesis", "transformers", "torchtitan")  # the test, hf and titan extras
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
for name in BLOCKED:  # as if not installed: importing raises ModuleNotFoundError, importlib.util.find_spec gives None
    sys.modules[name] = None
sys.argv = ["moe_quant.demo", "--steps", "2", "--tokens", "64", "--plot", sys.argv[1]]
runpy.run_module("moe_quant.demo", run_name="__main__")
"""


def test_demo_runs_with_the_demo_extra_alone(tmp_path):
    """``pip install -e ".[demo]"`` is enough for the demo (issue 56): it imports nothing of the test, hf and titan
    extras (checked by hand in a fresh venv: torch 2.13.0, then the demo extra, then ``python -m moe_quant.demo``)."""
    proc = run_python("-c", WITHOUT_OTHER_EXTRAS, str(tmp_path / "c.png"), timeout=300, warm=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final held-out loss" in proc.stdout and (tmp_path / "c.png").exists(), proc.stdout
