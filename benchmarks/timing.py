"""Shared timing helpers for the benchmarks: do_bench medians, a memcpy ceiling, tables.

Run on a CUDA device (:func:`require_cuda` ends a benchmark with one line and exit status 2
elsewhere). Bandwidth counts bytes read + bytes written once each.
"""

from __future__ import annotations

import os
import sys

import torch

NO_GPU_EXIT_CODE = 2


def require_cuda(argv: list[str] | None = None) -> None:
    """Exit with status 2 and one line on stderr unless a CUDA GPU is available (``--help`` still works)."""
    argv = sys.argv[1:] if argv is None else argv
    if torch.cuda.is_available() or "-h" in argv or "--help" in argv:
        return
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name else os.path.basename(sys.argv[0] or "benchmark")
    print(f"{prog}: needs a CUDA GPU, and torch {torch.__version__} sees none (no GPU, or a CPU-only build)", file=sys.stderr)
    raise SystemExit(NO_GPU_EXIT_CODE)


def bench_us(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of ``fn()`` in microseconds (``triton.testing.do_bench``, CUDA events)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


class Rotating:
    """Cycle through copies of the inputs so that the working set exceeds L2 (50 MB on H100)."""

    def __init__(self, make, min_bytes: int = 256 << 20):
        first = make()
        per = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
        n = max(1, min(8, -(-min_bytes // max(per, 1))))
        self.sets = [first] + [make() for _ in range(n - 1)]
        self.i = 0

    def next(self):
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def memcpy_tbps(shape, dtype=torch.bfloat16) -> tuple[float, float]:
    """(us, TB/s) of a device-to-device copy of a tensor of ``shape`` (read + write)."""
    rot = Rotating(lambda: (torch.randn(shape, device="cuda", dtype=dtype), torch.empty(shape, device="cuda", dtype=dtype)))

    def run():
        src, dst = rot.next()
        dst.copy_(src)

    us = bench_us(run)
    nbytes = 2 * torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    return us, nbytes / us / 1e6


def tbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e6


def print_table(title: str, header: list[str], rows: list[list], file=None) -> str:
    """Print and return a fixed-width table."""
    cells = [[str(h) for h in header]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(cells[0], widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, file=file, flush=True)
    return text


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
