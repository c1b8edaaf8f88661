"""Train a small MoE in bf16 and in MXFP8 and compare: ``python -m moe_quant.demo``.

The task is learnable and synthetic: a fixed random *teacher* MoE model maps random
inputs to targets, and a student of the same architecture (router, top-k, token
permutation, grouped SwiGLU experts on ``torch._grouped_mm``) learns it with an MSE loss.
The student is trained twice from the same initial weights on the same batches: once in
plain bf16, once after ``quantize_(model, MXFP8MoEConfig(...), filter_fn=...)`` converts
its experts. The script prints both final losses (on a fixed held-out batch) and their
relative gap, and plots both training-loss curves (``--plot``; needs matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cli
from .backends import GemmBackend, resolve_gemm_backend, use_quant_kernels
from .conversion import MXFP8MoEConfig, fallback_counts
from .moe import GroupedExperts, TinyMoEModel
from .numerics import ScaleMode


@dataclass
class TaskConfig:
    in_dim: int = 32
    dim: int = 64
    hidden: int = 128
    num_experts: int = 8
    top_k: int = 2
    n_layers: int = 2
    out_dim: int = 32
    tokens: int = 512  # per step
    steps: int = 300
    lr: float = 2e-3
    seed: int = 0
    teacher_expert_std: float = 0.2
    eval_tokens: int = 2048


@dataclass
class RunResult:
    losses: list = field(default_factory=list)  # training loss per step
    eval_loss: float = float("nan")  # held-out loss after training
    seconds: float = 0.0


def make_models(cfg: TaskConfig, device):
    """(student in bf16, teacher in fp32), deterministic from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    args = (cfg.in_dim, cfg.dim, cfg.hidden, cfg.num_experts, cfg.top_k, cfg.n_layers, cfg.out_dim)
    student = TinyMoEModel(*args).to(device=device, dtype=torch.bfloat16)
    torch.manual_seed(cfg.seed + 1)
    teacher = TinyMoEModel(*args).to(device)
    for mod in teacher.modules():
        if isinstance(mod, GroupedExperts):
            mod.init_weights(std=cfg.teacher_expert_std)  # make the experts matter for the target
    teacher.requires_grad_(False)
    return student, teacher


def make_batch(teacher, n_tokens: int, seed: int, cfg: TaskConfig, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, cfg.in_dim, generator=g).to(device)
    with torch.no_grad():
        y = teacher(x)
    return x.to(torch.bfloat16), y


def train(model, teacher, cfg: TaskConfig, device, progress=None, step_fn=None) -> RunResult:
    """AdamW on ``model`` for ``cfg.steps`` steps; batch ``i`` is the same for every run."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    forward = step_fn or model
    result = RunResult()
    start = time.perf_counter()
    for step in range(cfg.steps):
        x, y = make_batch(teacher, cfg.tokens, cfg.seed * 100_003 + step, cfg, device)
        loss = F.mse_loss(forward(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(loss.item())
        if progress is not None:
            progress(step, loss.item())
    x, y = make_batch(teacher, cfg.eval_tokens, -1 - cfg.seed, cfg, device)
    with torch.no_grad():
        result.eval_loss = F.mse_loss(model(x).float(), y).item()
    result.seconds = time.perf_counter() - start
    return result


def convert(model, scale_mode: str = "rceil", backend: str = "auto"):
    from torchao.quantization import quantize_

    config = MXFP8MoEConfig(scale_mode=scale_mode, backend=backend)
    quantize_(model, config, filter_fn=lambda mod, fqn: "experts" in fqn)
    return model


class _Progress:
    """Progress of one training run on ``stream`` (stderr): on a terminal a live bar (tqdm when installed, else
    a one-line text bar); elsewhere (a log file, a pipe) one summary line when the run ends, not a line per
    update."""

    def __init__(self, total: int, desc: str, stream=None):
        self.total, self.desc = total, desc
        self.stream = sys.stderr if stream is None else stream
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.loss, self.start = 0, float("nan"), time.perf_counter()
        self.bar = None
        if self.live:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=True, file=self.stream)
            except ImportError:
                pass

    def __call__(self, step: int, loss: float):
        self.done, self.loss = step + 1, loss
        if not self.live:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        done = self.done
        if done == self.total or done % max(1, self.total // 50) == 0:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\r{self.desc:>6} [{bar}] {done}/{self.total} loss {loss:.4f}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif not self.live:
            self.stream.write(f"{self.desc:>6}: {self.done}/{self.total} steps in "
                              f"{time.perf_counter() - self.start:.1f} s, last loss {self.loss:.4f}\n")
            self.stream.flush()


# The two training curves differ by well under 1%, so drawn alike the second hides the first:
# bf16 is a wide translucent band, MXFP8 a thin dashed line on top of it.
CURVE_STYLES = {
    "bf16": dict(color="tab:blue", linewidth=3.5, alpha=0.45, zorder=2),
    "mxfp8": dict(color="tab:red", linewidth=1.0, linestyle="--", zorder=3),
}


def loss_figure(results: dict, plt):
    """The loss-curve figure: both training curves, and their relative difference below."""
    fig, (ax, ax_gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    for name, r in results.items():
        style = CURVE_STYLES.get(name, dict(linewidth=1))
        ax.plot(r.losses, label=f"{name} (held-out {r.eval_loss:.5f})", **style)
    ax.set_ylabel("training MSE loss")
    ax.set_yscale("log")
    ax.set_title("tiny MoE: bf16 vs MXFP8 experts")
    ax.legend()
    if {"bf16", "mxfp8"} <= results.keys():  # the curves overlap: show their relative difference too
        ref, mx = results["bf16"].losses, results["mxfp8"].losses
        ax_gap.plot([100 * (m - b) / b for m, b in zip(mx, ref)], linewidth=0.8, color="tab:red")
        ax_gap.axhline(0, color="gray", linewidth=0.5)
        ax_gap.set_ylabel("mxfp8 vs bf16 (%)")
    ax_gap.set_xlabel("step")
    fig.tight_layout()
    return fig


def plot(results: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig = loss_figure(results, plt)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curves written to {path}"


def check_plot_path(path: str) -> str | None:
    """Why ``path`` cannot take the PNG (checked before training), or None if it can."""
    if not path.lower().endswith(".png"):
        return f"--plot {path!r}: the loss-curve file must end with .png"
    if os.path.isdir(path):
        return f"--plot {path!r} is a directory; give a file name ending with .png"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--plot {path!r}: directory {os.path.dirname(path) or '.'!r} does not exist"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"--plot {path!r}: the file exists and is not writable"
    try:  # os.access says yes to root even on read-only mounts: really create a file there
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".moe_quant_demo_", suffix=".png"):
            pass
    except OSError as err:
        return f"--plot {path!r}: cannot write to directory {os.path.dirname(path) or '.'!r} ({err.strerror})"
    return None


def describe_mxfp8(scale_mode: str, backend: str, device: torch.device) -> str:
    """One line: which scale mode, GEMM backend and quantizer the MXFP8 run uses on ``device``."""
    gemm = resolve_gemm_backend(backend, device)
    gemm_text = {
        GemmBackend.SCALED: "scaled (torch._scaled_grouped_mm, MXFP8 tensor cores)",
        GemmBackend.EMULATED: "emulated (dequantize to bf16, torch._grouped_mm)",
    }[gemm]
    quant = "CuTe-DSL kernels" if use_quant_kernels(torch.empty(0, device=device)) else "PyTorch reference"
    return f"mxfp8 run: scale mode {ScaleMode.parse(scale_mode).value}, GEMM backend {gemm_text}, quantization {quant}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_quant.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--steps", type=cli.positive_int, default=TaskConfig.steps)
    p.add_argument("--tokens", type=cli.positive_int, default=TaskConfig.tokens, help="tokens per step")
    p.add_argument("--seed", type=int, default=TaskConfig.seed)
    p.add_argument("--scale-mode", default="rceil", choices=["rceil", "floor"])
    p.add_argument("--backend", default="auto", choices=["auto", "emulated", "scaled"])
    p.add_argument("--plot", default="loss_curves.png", help="PNG path for the loss curves (default %(default)s)")
    p.add_argument(
        "--threads",
        type=cli.non_negative_int,
        default=1,
        help="CPU threads for PyTorch (default 1: this model is too small to gain from more, and "
        "several threads slow it down many times over on a busy machine; 0 keeps PyTorch's default)",
    )
    args = p.parse_args(argv)
    device = cli.exit_unless_device_runs(p, args.device)  # one line and exit status 2 (meta, no GPU, ...)
    plot_error = check_plot_path(args.plot)
    if plot_error:
        p.error(plot_error)
    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        resolve_gemm_backend(args.backend, device)
    except ValueError as err:  # e.g. --backend scaled without an SM100 GPU
        p.error(str(err))
    cfg = TaskConfig(steps=args.steps, tokens=args.tokens, seed=args.seed)
    student, teacher = make_models(cfg, device)
    models = {"bf16": copy.deepcopy(student), "mxfp8": convert(copy.deepcopy(student), args.scale_mode, args.backend)}
    print(
        f"tiny MoE: {cfg.n_layers} layers, dim {cfg.dim}, hidden {cfg.hidden}, "
        f"{cfg.num_experts} experts top-{cfg.top_k}, "
        f"{cfg.tokens} tokens/step, {cfg.steps} steps, device {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU thread(s)"
    )
    print(describe_mxfp8(args.scale_mode, args.backend, device))
    results = {}
    for name, model in models.items():
        bar = _Progress(cfg.steps, name)
        try:
            results[name] = train(model, teacher, cfg, device, progress=bar)
        finally:
            bar.close()
    bf16, mx = results["bf16"], results["mxfp8"]
    gap = (mx.eval_loss - bf16.eval_loss) / bf16.eval_loss
    print(f"initial loss (step 0): bf16 {bf16.losses[0]:.5f}, mxfp8 {mx.losses[0]:.5f}")
    print(
        f"final held-out loss:   bf16 {bf16.eval_loss:.5f} ({bf16.seconds:.1f} s), "
        f"mxfp8 {mx.eval_loss:.5f} ({mx.seconds:.1f} s)"
    )
    print(f"relative gap (mxfp8 - bf16) / bf16: {100 * gap:+.2f}%")
    if fallback_counts():
        print(f"grouped_mm fallbacks to the plain op: {fallback_counts()}")
    print(plot(results, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
