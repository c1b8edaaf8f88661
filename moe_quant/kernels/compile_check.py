"""Compile every kernel variant (every family: a subpackage with a ``config`` module) for one GPU arch without a
GPU (CI), and report ptxas resources.

    python -m moe_quant.kernels.compile_check sm_90a [sm_100a ...]

Each arch is compiled in its own subprocess with ``CUTE_DSL_ARCH`` set before cutlass is
imported (CuTe DSL 4.8.1 cross-compiles for the arch named there when no GPU is present).
ptxas' resource report (``remarks{ptx}``) is parsed for registers, spills and stack frame.
Prints one JSON object per variant (``variant`` is ``family/key``): ``{"arch", "variant", "seconds",
"registers", "spill_bytes",
"stack_bytes", "smem_bytes", "tvm_ffi"}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

_MARK = "@@compile_check@@"


_PARENT = "MOE_QUANT_COMPILE_CHECK_PARENT"  # set by start(): the pid its workers end with


def _die_with_parent() -> None:
    """Linux: a worker gets SIGKILL when the process that started it ends (a test session killed before it
    collected the results, ``tests/test_kernel_compile.py`` starts them at collection), instead of compiling on
    for minutes with nobody to read its report."""
    parent = os.environ.pop(_PARENT, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # it ended before prctl
        os._exit(1)


def _worker(arch: str) -> None:
    _die_with_parent()
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")  # really compile, every time
    from .compile_cache import compile_variant

    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except Exception:
        tvm = False
    for v in all_variants():
        name = variant_name(v)
        print(f"{_MARK} begin {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        compile_variant(v, tvm_ffi=tvm, extra_options="remarks{ptx}")
        dt = time.perf_counter() - t0
        print(f"{_MARK} end {name} {dt:.3f} {int(tvm)}", file=sys.stderr, flush=True)


def all_variants() -> list:
    """Every variant the package can launch, ``all_variants()`` of each family's ``config`` module (a family is a
    subpackage with one), then the A/B candidates a family offers (its ``candidate_variants()``,
    ``scripts/ab_kernels.py``)."""
    import importlib
    import importlib.util
    import pkgutil

    from . import __path__ as here

    out = []
    for info in sorted(pkgutil.iter_modules(here), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"{__package__}.{info.name}.config") is not None:
            mod = importlib.import_module(f"{__package__}.{info.name}.config")
            out += mod.all_variants()
            out += [v for v in getattr(mod, "candidate_variants", list)() if v not in out]
    return out


def variant_name(v) -> str:
    return f"{v.family}/{v.key}"


def _parse(arch: str, stderr: str) -> list[dict]:
    out = []
    cur = []
    for line in stderr.splitlines():
        if line.startswith(_MARK):
            parts = line.split()
            if parts[1] == "begin":
                cur = []
            else:
                text = "\n".join(cur)
                regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
                spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
                stack = [int(s) for s in re.findall(r"(\d+) bytes stack frame", text)]
                smem = [int(s) for s in re.findall(r"(\d+) bytes smem", text)]
                out.append(
                    dict(
                        arch=arch,
                        variant=parts[2],
                        seconds=float(parts[3]),
                        tvm_ffi=bool(int(parts[4])),
                        registers=max(regs) if regs else None,
                        spill_bytes=sum(spills) if spills else None,
                        stack_bytes=max(stack) if stack else None,
                        smem_bytes=max(smem) if smem else 0,
                    )
                )
        else:
            cur.append(line)
    return out


def run(archs: list[str], timeout: float = 900) -> list[dict]:
    """Compile all variants for each arch, one subprocess per arch, in parallel."""
    return collect(start(archs), timeout)


def start(archs: list[str], nice: int = 0) -> list:
    """Start :func:`run`'s subprocesses (one per arch) and return at once; :func:`collect` waits for them and
    parses their reports. ``nice``: their scheduling niceness (``os.nice``), e.g. to run behind other work.
    Their output goes to temporary files, so nobody needs to read it while they run."""
    import tempfile

    started = []
    for arch in archs:
        env = dict(os.environ, CUTE_DSL_ARCH=arch, **{_PARENT: str(os.getpid())})
        err = tempfile.TemporaryFile(mode="w+t")
        proc = subprocess.Popen(
            _worker_command(arch),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
        started.append((arch, proc, err))
        if nice:  # set from here, not by a preexec_fn (unsafe in a process with threads, e.g. torch's)
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
            except (AttributeError, OSError):  # no setpriority (Windows), or the worker ended already
                pass
    return started


def _worker_command(arch: str) -> list[str]:
    """The command line of :func:`start`'s worker for ``arch`` (``tests/test_compile_check_workers.py`` puts a
    cheap one in its place)."""
    return [sys.executable, "-m", "moe_quant.kernels.compile_check", "--worker", arch]


def collect(started: list, timeout: float = 900) -> list[dict]:
    """Wait for :func:`start`'s subprocesses (each at most ``timeout`` seconds from now) and return their results;
    a failed one raises, and the others are killed."""
    results = []
    try:
        for arch, p, err in started:
            p.wait(timeout=timeout)
            err.seek(0)
            text = err.read()
            if p.returncode != 0:
                raise RuntimeError(f"compile for {arch} failed (rc={p.returncode}):\n{text[-6000:]}")
            results += _parse(arch, text)
    finally:
        stop(started)
    return results


def stop(started: list) -> None:
    """Kill :func:`start`'s subprocesses that still run and close their output files."""
    for _, p, err in started:
        if p.poll() is None:
            p.kill()
            p.wait()
        err.close()


def format_results(results: list[dict]) -> str:
    """One readable line per compiled variant (registers, spills, stack, smem, compile time)."""
    return "\n".join(
        f"{r['arch']:8s} {r['variant']:48s} regs={r['registers']} spill={r['spill_bytes']}B "
        f"stack={r['stack_bytes']}B smem={r['smem_bytes']}B {r['seconds']:.2f}s tvm_ffi={r['tvm_ffi']}"
        for r in results
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    for r in run(argv or ["sm_90a", "sm_100a"]):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
