"""Shared timing helpers for the benchmarks: do_bench medians, a memcpy ceiling, tables.

Run on a CUDA device (:func:`require_cuda` ends a benchmark with one line and exit status 2
elsewhere). Bandwidth counts bytes read + bytes written once each.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

from moe_quant.cli import NO_CUDA_STATUS as NO_GPU_EXIT_CODE
from moe_quant.cli import no_cuda_message


def require_cuda(argv: list[str] | None = None) -> None:
    """Exit with status 2 and one line on stderr unless a CUDA GPU is available (``--help`` still works)."""
    argv = sys.argv[1:] if argv is None else argv
    if torch.cuda.is_available() or "-h" in argv or "--help" in argv:
        return
    print(f"{prog_name()}: {no_cuda_message()}", file=sys.stderr)
    raise SystemExit(NO_GPU_EXIT_CODE)


def prog_name() -> str:
    """How the running benchmark was started: ``python -m benchmarks.NAME`` (or the script's name)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name}" if spec is not None and spec.name else os.path.basename(sys.argv[0] or "benchmark")


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


def memcpy_call(shape, dtype=torch.bfloat16):
    """``(run, bytes)``: a device-to-device copy of a ``shape`` tensor, its inputs rotated past the L2, and the
    bytes it moves (read + write)."""
    def make():
        src = (torch.randn(shape, device="cuda", dtype=dtype) if dtype.is_floating_point
               else torch.randint(0, 127, shape, device="cuda", dtype=dtype))
        return src, torch.empty_like(src)

    rot = Rotating(make)

    def run():
        src, dst = rot.next()
        dst.copy_(src)

    return run, 2 * torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()


def memcpy_tbps(shape, dtype=torch.bfloat16) -> tuple[float, float]:
    """(us, TB/s) of a device-to-device copy of a tensor of ``shape`` (read + write)."""
    run, nbytes = memcpy_call(shape, dtype)
    us = bench_us(run)
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


def call_ms(fn, device="cuda") -> float:
    """Milliseconds of one ``fn()`` call: CUDA events around it on the current stream, the host waiting for the
    end (nothing synchronized before: the caller decides what ran ahead); the wall clock on any other device."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    import time

    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def bench_ms(fn, device="cuda", *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds on ``device``.

    CUDA: ``triton.testing.do_bench`` (CUDA events), as :func:`bench_us`. Any other device: a
    wall-clock median of at least 3 calls after one warm-up call, for smoke runs only (a CPU
    number says nothing about the GPU targets).
    """
    if torch.device(device).type == "cuda":
        return bench_us(fn, warmup_ms=warmup_ms, rep_ms=rep_ms) / 1e3
    import statistics
    import time

    fn()
    times = []
    stop = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (len(times) < 50 and time.perf_counter() < stop):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def peak_memory_bytes(fn, device="cuda") -> int | None:
    """Peak CUDA memory one call of ``fn()`` allocates on top of what was allocated before it.

    Resets the peak statistics, reads ``torch.cuda.memory_allocated()``, runs ``fn()`` once and
    returns ``torch.cuda.max_memory_allocated() - before`` (bytes; what ``fn`` returns is dropped).
    None on any other device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@contextlib.contextmanager
def patched_around(targets, around):
    """Within it, each function ``module.name`` of ``targets`` (``(module, name, label)`` triples) runs inside the
    context manager ``around(label)``, ``label`` a string or ``label(args, kwargs)`` where it is callable: patched on
    its module, so the callers that look it up there at each call run it inside."""
    from unittest import mock

    def wrapped(label, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with around(label(args, kwargs) if callable(label) else label):
                return fn(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        for module, name, label in targets:
            stack.enter_context(mock.patch.object(module, name, wrapped(label, getattr(module, name))))
        yield


def profiler_ranges(targets):
    """:func:`patched_around` with a profiler range (``torch.profiler.record_function``) named ``label`` around each
    function of ``targets``, which :func:`profile_device_ops` reports in the ``scopes`` of every kernel the profiler
    links to a launching op."""
    return patched_around(targets, torch.profiler.record_function)


def profile_device_ops(fn, device="cuda", iters: int = 3) -> list[dict]:
    """Run ``fn()`` ``iters`` times under ``torch.profiler``; one dict per device op executed.

    CUDA: one entry per kernel / memcpy / memset on the GPU, ``us`` its GPU duration. Other
    devices: one entry per ``aten::`` (or custom ``ns::op``) CPU op, ``us`` its self CPU time.
    ``record_function`` ranges are no ops, on either (a range named ``ns::x`` included).
    ``scopes``: names of the CPU op that launched it and of every range around that op
    (``record_function`` ranges, autograd nodes), innermost first; empty when the profiler did
    not link the kernel to a launching op (``linked`` False). ``start_us``, ``end_us``: when it
    ran (the profiler's clock, shared by host and device events; on the CPU the op's whole span,
    children included); ``stream``: the CUDA stream (None on the CPU or where the profiler does not say).
    """
    return profile_trace(fn, device, iters)["ops"]


def profile_trace(fn, device="cuda", iters: int = 3) -> dict:
    """:func:`profile_device_ops` with the host side of the same run: ``{"ops": [...], "host": [...],
    "trace_start_us": t}`` (``t``: the wall-clock time, in us since the epoch, that the ``start_us`` of ``ops``
    and ``host`` count from: the same clock in every process of one host, so ranks' traces line up).

    ``host``: one ``{"name", "start_us", "end_us"}`` per host event of the run (CPU ops,
    ``record_function`` ranges and, on CUDA, the runtime API calls: ``cudaLaunchKernel``,
    ``cudaStreamSynchronize``, ...), in the clock of ``ops``' ``start_us``.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()

    def chain(evt):
        names = []
        while evt is not None:
            names.append(evt.name)
            evt = evt.cpu_parent
        return tuple(names)

    def span(e):
        return float(e.time_range.start), float(e.time_range.end)

    def annotation(e):  # a record_function range (on the GPU: its row spanning the kernels it launched)
        return getattr(e, "is_user_annotation", False) or getattr(e, "activity_type", None) == "gpu_user_annotation"

    out = []
    if cuda:
        # CPU ops and ranges (not the runtime API calls, which carry a linked id of their own)
        def link(e):
            return getattr(e, "linked_correlation_id", 0)

        ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and link(e) == 0}
        for e in events:
            if e.device_type != DeviceType.CUDA or annotation(e):
                continue
            op = ops.get(link(e)) if link(e) else None
            start, end = span(e)
            out.append(
                {
                    "name": e.name,
                    "us": end - start,
                    "scopes": chain(op) if op is not None else (),
                    "linked": op is not None,
                    "start_us": start,
                    "end_us": end,
                    "stream": getattr(e, "device_resource_id", None),
                }
            )
    else:
        for e in events:
            if (e.device_type != DeviceType.CPU or "::" not in e.name or e.name.startswith("autograd::")
                    or annotation(e)):
                continue
            start, end = span(e)
            out.append(
                {"name": e.name, "us": float(e.self_cpu_time_total), "scopes": chain(e), "linked": True,
                 "start_us": start, "end_us": end, "stream": None}
            )
    host = [{"name": e.name, "start_us": span(e)[0], "end_us": span(e)[1]}
            for e in events if e.device_type == DeviceType.CPU]
    start = getattr(getattr(getattr(prof, "profiler", None), "kineto_results", None), "trace_start_ns", None)
    return {"ops": out, "host": host, "trace_start_us": start() / 1e3 if start is not None else None}


def loop_us(fn, device="cuda", *, calls: int = 40, reps: int = 5) -> float:
    """Time per call of ``fn`` called back to back, as a user's eager loop calls it: ``calls`` calls with nothing
    between them (no cache flush, no wait), timed as one :func:`call_ms` (device events around the batch; the wall
    clock on any other device), the median of ``reps`` batches (after ``calls`` calls of warm-up). Where the
    call's host time exceeds its kernel's, this is the host's rate, not the kernel's (``bench_us`` times the kernel
    alone)."""
    import statistics

    def batch():
        for _ in range(calls):
            fn()

    batch()
    per = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()  # each batch starts on an idle device
        per.append(1e3 * call_ms(batch, device) / calls)
    return statistics.median(per)


def host_us(fn, n: int = 100, reps: int = 20) -> float:
    """CPU time per eager call of ``fn`` in microseconds: the best of ``reps`` batches of ``n`` calls,
    few enough that the launch queue never fills (so the GPU never throttles the loop)."""
    import time

    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best / n * 1e6


def write_json(path: str | None, record: dict) -> None:
    """``record`` as JSON into ``path`` (``--json``); nothing when ``path`` is empty or None."""
    if path:
        import json

        with open(path, "w") as fh:
            json.dump(record, fh, indent=1)
