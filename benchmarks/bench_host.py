"""Host (CPU) time of the MXFP8 grouped GEMM and of each quantize kernel launch, against the host targets.

    python -m benchmarks.bench_host [--n 100] [--reps 20] [--rounds 5] [--only launches] [--json PATH]
    python -m benchmarks.bench_host --only launches --against DIR [--processes 4]

Per call, eager, warm, inputs already on the GPU:

* ``host us``: ``time.perf_counter`` around batches of ``--n`` calls with no synchronization inside the
  batch (few enough calls that the launch queue never fills, so the GPU never throttles the loop); the
  best batch of ``--reps`` (:func:`benchmarks.timing.host_us`). The two fwd+bwd rows of a size are timed
  in ``--rounds`` interleaved rounds (torch, then mxfp8, each round), since the host's speed drifts within
  a run: their ``host us`` is the median over rounds, and the ratio is the median of the per-round ratios
  with its range over the rounds.
* ``profiler us``: the CPU time ``torch.profiler`` attributes to the ops of the same calls (the sum of every
  event's self CPU time, per call; excludes Python between ops), and ``launches``: CUDA kernel launches per
  call (``cudaLaunchKernel`` / ``cuLaunchKernel`` / ``cudaLaunchKernelExC`` / ``cuLaunchKernelEx`` events).

Rows: ``torch._grouped_mm`` fwd+bwd (bf16) vs ``mxfp8_grouped_mm`` fwd+bwd (default backend) at a tiny and a
small-M size; each quantize kernel through its public op (1x32 with M-groups, 32x1 K-groups, the permute
kernel's blocked output), and of that: the compiled kernel called alone (the TVM-FFI function, as the op calls
it), TVM-FFI's no-op function called with the same arguments (the kernel call less its own work: the compiled
function's argument checks, device switch and CUDA launch), the op's output allocations alone, and the rest (the
op's Python); each timed in ``--rounds`` interleaved rounds, the median. For scale: a native torch op
(``torch.neg``), one CUDA allocation (``torch.empty``) and one bare kernel launch through torch
(``torch.cuda._sleep(0)``: no allocation, no dispatcher) on the same host, the device test the launch path ran
per call until 2026-12-03 (``x.get_device() != torch._C._cuda_getDevice()``), the 1x32 op's outputs allocated
one ``torch.empty`` each against views of one allocation (and one view op alone), and TVM-FFI's no-op function
with no and four tensor arguments (its cost per tensor argument). ``--only launches`` skips the fwd+bwd rows.
``--against DIR`` times the launch rows of this checkout's ``moe_quant`` and of the one in folder ``DIR`` (e.g.
``git archive REV moe_quant | tar -x -C DIR``), in ``--processes`` processes each, alternating, and prints each
row's median over the processes (min-max) on both sides and their ratio. Targets (issue 20):
``mxfp8_grouped_mm`` fwd+bwd at most 2x ``torch._grouped_mm``'s host time; each kernel launch (its op) at
most 10 us; no device-to-host synchronization (``syncs``: a call under ``torch.cuda.set_sync_debug_mode("error")``,
which raises on ``.item()``, ``.cpu()``, stream synchronizations, must not raise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

if "--tree" in sys.argv[:-1]:  # a child of --against: the moe_quant of that folder, before anything imports one
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--tree") + 1]))

import torch  # noqa: E402

from benchmarks.timing import device_name, host_us, print_table, prog_name, require_cuda, write_json  # noqa: E402
from moe_quant import cli  # noqa: E402

MAX_RATIO = 2.0  # mxfp8_grouped_mm fwd+bwd host time / torch._grouped_mm's
MAX_LAUNCH_US = 10.0  # host time of one quantize kernel launch (its torch op)
ISSUE57_LAUNCH_US = 15.0  # issue 57's: at most 15 us per quantize call from Python
SIZES = {"tiny": (256, 256, 256, 8), "small-M": (2048, 2048, 1024, 8)}  # M, K, N, experts
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # not the calls' time


def profile_cpu(fn, n: int) -> dict:
    """``torch.profiler`` over ``n`` calls: CPU us per call (sum of self CPU times) and kernel launches per call;
    ``syncs``: 1 if a call synchronizes the device with the host (``torch.cuda.set_sync_debug_mode("error")``
    raises on it), else 0."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    launches = sum(1 for e in events if e.name in LAUNCH_EVENTS)
    cpu = sum(e.self_cpu_time_total for e in events if e.name not in SYNC_EVENTS)
    return {"profiler_us": cpu / n, "launches": launches / n, "syncs": int(synchronizes(fn))}


def synchronizes(fn) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def dlpack_exchange_api() -> bool | None:
    """Whether TVM-FFI (once imported) has torch's C DLPack exchange API, its fast path for tensor arguments
    (``torch.Tensor.__dlpack_c_exchange_api__``: torch's own, or tvm_ffi's JIT-built addon); None without tvm_ffi."""
    try:
        import tvm_ffi  # noqa: F401  (installs the addon where torch lacks the API)
    except Exception:
        return None
    return hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def grouped_mm_problem(m: int, k: int, n: int, e: int):
    from moe_quant import layouts

    g = torch.Generator().manual_seed(0)
    sizes = torch.rand(e, generator=g) + 0.1
    ends = layouts.round_up((torch.cumsum(sizes, 0) / sizes.sum() * m).long(), 32).clamp(max=m)
    ends[-1] = m
    offs = ends.to(torch.int32).cuda()
    A = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return A, W, offs, grad


def fwd_bwd(impl, A, W, offs, grad):
    def run():
        out = impl(A, W.transpose(-2, -1), offs)
        torch.autograd.grad(out, (A, W), grad)

    return run


def fwd_only(impl, A, W, offs, grad):
    """The forward alone (no autograd graph): where fwd+bwd's host time goes."""
    def run():
        with torch.no_grad():
            impl(A, W.transpose(-2, -1), offs)

    return run


def quantize_launches() -> list[tuple[str, object, object, object, object]]:
    """(name, torch op call, compiled kernel call alone, TVM-FFI's no-op with the same arguments (None without
    tvm_ffi), the op's output allocations alone) of each quantize kernel, tiny inputs: what is left of the op's host
    time after the kernel call and the allocations is its Python (argument checks, shapes, the kernel lookup)."""
    from moe_quant import layouts
    from moe_quant.kernels import ops
    from moe_quant.kernels.quantize_1x32 import ops as ops_1x32
    from moe_quant.kernels.quantize_32x1 import ops as ops_32x1
    from moe_quant.kernels.permute import ops as ops_permute

    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    d = torch.empty(256, 256, device="cuda", dtype=torch.float8_e4m3fn)
    sc = torch.empty(layouts.m_groups_blocked_shape(256, 8, 2), device="cuda", dtype=torch.float8_e8m0fnu)
    k1 = ops_1x32._kernel_for(x, "rceil", "mgroups", "float8_e4m3fn")

    (r, mp), (sr, sw) = ops_32x1._k_groups_shapes(256, 256, 2)
    d32 = torch.empty(r, mp, device="cuda", dtype=torch.float8_e4m3fn)
    s32 = torch.empty(sr, sw, device="cuda", dtype=torch.float8_e8m0fnu)
    p32 = torch.empty(2, device="cuda", dtype=torch.int32)
    k32 = ops_32x1._kernel_32x1(x, "rceil", "kgroups", torch.float8_e4m3fn)

    data = torch.randint(0, 127, (256, 256), device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.randint(100, 140, (256, 8), device="cuda", dtype=torch.uint8).view(torch.float8_e8m0fnu)
    counts = torch.tensor([[60, 40], [100, 56]], dtype=torch.int32, device="cuda")
    pd = torch.empty(256, 256, device="cuda", dtype=torch.float8_e4m3fn)
    ps = torch.empty(layouts.m_groups_blocked_shape(256, 8, 2), device="cuda", dtype=torch.float8_e8m0fnu)
    po = torch.empty(2, device="cuda", dtype=torch.int32)
    kp = ops_permute._kernel("blocked", torch.bfloat16, x.device)
    def empties(*like):  # as the ops allocate: the size by keyword, a torch.device (the faster argument parsing)
        shapes = [(tuple(t.shape), t.dtype) for t in like]
        return lambda: [torch.empty(size=shape, dtype=dtype, device=x.device) for shape, dtype in shapes]

    nop = tvm_ffi_nop()
    k1, k32, kp = k1.call, k32.call, kp.call  # what the ops call (no Python frame of compile_cache between)

    def same_args(*args):
        return None if nop is None else (lambda: nop(*args))

    return [
        ("quantize_1x32 (M-groups)", lambda: ops.quantize_1x32(x, "rceil", offs), lambda: k1(x, d, sc, offs),
         same_args(x, d, sc, offs), empties(d, sc)),
        ("quantize_32x1_k_groups", lambda: ops.quantize_32x1_k_groups(x, "rceil", offs),
         lambda: k32(x, d32, s32, offs, p32), same_args(x, d32, s32, offs, p32), empties(d32, s32, p32)),
        ("permute_mxfp8 (blocked)", lambda: ops_permute.permute_mxfp8(data, scales, counts, "blocked"),
         lambda: kp(data, scales, counts, pd, ps, po), same_args(data, scales, counts, pd, ps, po),
         empties(pd, ps, po)),
    ]


def tvm_ffi_nop():
    """TVM-FFI's no-op function (``testing.nop``), or None without tvm_ffi."""
    try:
        import tvm_ffi

        return tvm_ffi.get_global_func("testing.nop")
    except Exception:
        return None


def allocation_peers(device: torch.device) -> list[tuple[str, object]]:
    """What the outputs of one 1x32 call cost to allocate (256 x 256, M-groups scales of 2 groups): as the op
    allocates them (one ``torch.empty`` each, in the dtypes the kernel takes), and as views of one allocation
    (issue 57's idea: one ``torch.empty`` and a view per output, each view a dispatcher call too); and one view op
    of each kind alone."""
    from moe_quant import layouts

    m, k = 256, 256
    sr, sc = layouts.m_groups_blocked_shape(m, k // 32, 2)
    e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu

    def separate():
        return (torch.empty(size=(m, k), dtype=e4m3, device=device),
                torch.empty(size=(sr, sc), dtype=e8m0, device=device))

    def one_buffer():
        buf = torch.empty(size=(m * k + sr * sc,), dtype=e4m3, device=device)
        return buf.as_strided((m, k), (k, 1)), buf.as_strided((sr, sc), (sc, 1), m * k).view(e8m0)

    buf = torch.empty(m * k + sr * sc, dtype=e4m3, device=device)
    return [("1x32's outputs: torch.empty each (the op)", separate),
            ("1x32's outputs: views of one torch.empty", one_buffer),
            ("  one as_strided view", lambda: buf.as_strided((sr, sc), (sc, 1), m * k)),
            ("  one view(dtype)", lambda: buf.view(torch.uint8))]


def tvm_ffi_peers(x: torch.Tensor) -> list[tuple[str, object]]:
    """TVM-FFI's own cost per call and per tensor argument: its no-op function (``testing.nop``) with no tensor
    and with four (what a 1x32 call passes); the compiled kernels' calls add their argument checks and the
    launch. Empty without tvm_ffi."""
    nop = tvm_ffi_nop()
    if nop is None:
        return []
    offs = torch.zeros(2, dtype=torch.int32, device=x.device)
    return [("TVM-FFI no-op call, no tensor", lambda: nop()),
            ("TVM-FFI no-op call, 4 CUDA tensors", lambda: nop(x, x, x, offs))]


def launch_rows(args) -> tuple[list, list]:
    """``(rows, results)`` of each quantize op's launch: the op, the compiled kernel alone, TVM-FFI's no-op with the
    same arguments, the allocations alone and the rest, each the median of ``--rounds`` interleaved rounds."""
    rows, results = [], []
    launches = quantize_launches()
    parts = {name: {"op": op, "kernel": raw, "nop": nop, "alloc": alloc} for name, op, raw, nop, alloc in launches}
    got = {name: {part: [] for part, fn in fns.items() if fn is not None} for name, fns in parts.items()}
    for _ in range(args.rounds):  # interleaved: the host's speed drifts
        for name, fns in parts.items():
            for part, us in got[name].items():
                us.append(host_us(fns[part], args.n, args.reps))
    for name, fns in parts.items():
        med = {part: statistics.median(us) for part, us in got[name].items()}
        r = {"host_us": med["op"], "rounds_us": got[name]["op"], **profile_cpu(fns["op"], args.n)}
        rest = med["op"] - med["kernel"] - med["alloc"]
        ok = r["host_us"] <= MAX_LAUNCH_US and r["syncs"] == 0
        ok57 = r["host_us"] <= ISSUE57_LAUNCH_US and r["syncs"] == 0
        rows.append(["launch", "256x256", name, r["host_us"], r["profiler_us"], r["launches"], r["syncs"],
                     f"<= {MAX_LAUNCH_US:g} / {ISSUE57_LAUNCH_US:g} us", f"{'PASS' if ok else 'FAIL'} / "
                     f"{'PASS' if ok57 else 'FAIL'}"])
        rows.append(["", "", "  of which: compiled kernel alone", med["kernel"], "", "", "", "", ""])
        if "nop" in med:
            rows.append(["", "", "    of that: TVM-FFI no-op, same arguments", med["nop"], "", "", "", "", ""])
        rows.append(["", "", "  of which: its output allocations alone", med["alloc"], "", "", "", "", ""])
        rows.append(["", "", "  of which: the rest (the op's Python)", rest, "", "", "", "", ""])
        results.append({"name": name, **r, "compiled_kernel_us": med["kernel"], "nop_same_args_us": med.get("nop"),
                        "allocations_us": med["alloc"], "rest_us": rest, "target_us": MAX_LAUNCH_US,
                        "issue57_target_us": ISSUE57_LAUNCH_US, "pass": ok, "pass_issue57": ok57})
    return rows, results


def package_tree(text: str) -> str:
    """``type=`` of ``--against``: a folder holding a ``moe_quant`` package. (Here, not in ``moe_quant.cli``: the
    children of ``--against`` import the other folder's ``moe_quant``, which may predate it.)"""
    if not os.path.isfile(os.path.join(text, "moe_quant", "__init__.py")):
        raise argparse.ArgumentTypeError(f"expected a folder holding a moe_quant package, got {text!r}")
    return text


def against(args) -> int:
    """``--against DIR``: the launch rows of this checkout and of ``DIR``'s moe_quant in alternating processes."""
    trees = {"this checkout": None, args.against: args.against}
    got: dict = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            for tree in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                out = os.path.join(tmp, f"{i}-{len(got[tree])}-{tree is None}.json")
                cmd = [sys.executable, "-m", "benchmarks.bench_host", "--only", "launches", "--json", out,
                       "--n", str(args.n), "--reps", str(args.reps), "--rounds", str(args.rounds)]
                cmd += [] if trees[tree] is None else ["--tree", trees[tree]]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as fh:
                    got[tree].append(json.load(fh))
    rows = []
    mine, theirs = got.values()

    def cell(values):
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    for i, launch in enumerate(mine[0]["launches"]):
        for key, what in (("host_us", launch["name"]), ("compiled_kernel_us", "  compiled kernel alone"),
                          ("nop_same_args_us", "    TVM-FFI no-op, same arguments"),
                          ("allocations_us", "  output allocations alone"), ("rest_us", "  the rest (Python)")):
            if launch.get(key) is None:
                continue
            a, b = ([run["launches"][i][key] for run in runs] for runs in (mine, theirs))
            rows.append([what, cell(a), cell(b), f"{statistics.median(a) - statistics.median(b):+.2f}"])
    for name in mine[0]["peers"]:  # the same host's scale, this checkout's processes
        rows.append([f"peer: {name}", cell([run["peers"][name] for run in mine]), "", ""])
    print_table(f"host us per call, median over {args.processes} processes each (min-max), {device_name()}",
                ["call", "this checkout", args.against, "difference"], rows)
    write_json(args.json, {"device": device_name(), "this checkout": mine, args.against: theirs})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog_name(), description=__doc__.splitlines()[0])
    p.add_argument("--n", type=cli.positive_int, default=100, help="calls per timed batch")
    p.add_argument("--reps", type=cli.positive_int, default=20, help="timed batches (the best is kept)")
    p.add_argument("--rounds", type=cli.positive_int, default=5, help="interleaved rounds of the fwd+bwd rows and "
                   "of the launch rows")
    p.add_argument("--only", choices=("all", "launches"), default="all", help="launches: the launch rows and peers")
    p.add_argument("--against", type=package_tree, default=None, metavar="DIR",
                   help="time the launch rows of this checkout and of the moe_quant in folder DIR, alternating")
    p.add_argument("--processes", type=cli.positive_int, default=4, help="with --against: processes per side")
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)  # a child of --against (read at import)
    p.add_argument("--json", type=cli.writable_file, default=None, help="write the results here")
    args = p.parse_args(argv)
    require_cuda(argv)
    if args.against:
        return against(args)
    from moe_quant import mxfp8_grouped_mm

    impls = {"torch._grouped_mm": lambda a, w, o: torch._grouped_mm(a, w, offs=o), "mxfp8_grouped_mm": mxfp8_grouped_mm}
    import moe_quant

    results = {"device": device_name(), "torch": torch.__version__, "grouped_mm": [], "launches": [],
               "tvm_ffi_dlpack_exchange_api": dlpack_exchange_api(),
               "moe_quant": os.path.dirname(os.path.dirname(os.path.abspath(moe_quant.__file__)))}
    print(f"TVM-FFI passes torch tensors through the C DLPack exchange API: {results['tvm_ffi_dlpack_exchange_api']} "
          "(without it every tensor argument of a kernel call goes through the Python DLPack protocol)")
    rows = []
    for size, (m, k, n, e) in (SIZES.items() if args.only == "all" else ()):
        problem = grouped_mm_problem(m, k, n, e)
        runs = {name: fwd_bwd(impl, *problem) for name, impl in impls.items()}
        rounds = {name: [] for name in impls}
        for _ in range(args.rounds):  # interleaved: the host's speed drifts
            for name, run in runs.items():
                rounds[name].append(host_us(run, args.n, args.reps))
        per = {name: {"host_us": statistics.median(us), "rounds_us": us, **profile_cpu(runs[name], args.n)}
               for name, us in rounds.items()}
        ratios = sorted(a / b for a, b in zip(rounds["mxfp8_grouped_mm"], rounds["torch._grouped_mm"]))
        ratio = statistics.median(ratios)
        ok = ratio <= MAX_RATIO and per["mxfp8_grouped_mm"]["syncs"] == 0
        spread = f"{ratio:.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}] (<= {MAX_RATIO}x)"
        for name, r in per.items():
            rows.append([size, f"{m}x{k}->{n} E={e}", name + " fwd+bwd", r["host_us"], r["profiler_us"], r["launches"],
                         r["syncs"], spread if name == "mxfp8_grouped_mm" else "",
                         ("PASS" if ok else "FAIL") if name == "mxfp8_grouped_mm" else ""])
        for name, impl in impls.items():  # diagnostic: the forward alone
            run = fwd_only(impl, *problem)
            per[name]["fwd_only_us"] = host_us(run, args.n, args.reps)
            rows.append(["", "", f"  {name} fwd only (no_grad)", per[name]["fwd_only_us"], "", "", "", "", ""])
        results["grouped_mm"].append({"size": size, "shape": [m, k, n, e], **{k_: v for k_, v in per.items()},
                                      "ratio": ratio, "ratio_range": [ratios[0], ratios[-1]],
                                      "target_ratio": MAX_RATIO, "pass": ok})
    launch_table, results["launches"] = launch_rows(args)
    rows += launch_table
    # the scale of a launch on this host: one native torch op with its output, one CUDA allocation (an op with two
    # or three outputs allocates two or three times) and one bare launch
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    results["peers"] = {}
    for name, fn in (("torch.neg (a native op, one output)", lambda: torch.neg(x)),
                     ("torch.empty (one CUDA allocation)", lambda: torch.empty(256, 264, device="cuda",
                                                                               dtype=torch.float8_e4m3fn)),
                     ("torch.cuda._sleep(0) (one bare launch through torch)", lambda: torch.cuda._sleep(0)),
                     ("the device test dropped from the launch path",
                      lambda: x.get_device() != torch._C._cuda_getDevice()),
                     *allocation_peers(x.device), *tvm_ffi_peers(x)):
        us = results["peers"][name] = host_us(fn, args.n, args.reps)
        rows.append(["peer", "256x256", name, us, "", "", "", "", ""])
    print_table(f"host time per eager call ({results['device']}, torch {torch.__version__})",
                ["size", "shape", "call", "host us", "profiler us", "launches", "syncs", "target", "result"], rows)
    results["pass"] = all(r["pass"] for r in results["grouped_mm"] + results["launches"])
    print("all host targets met" if results["pass"] else "host targets NOT all met")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
