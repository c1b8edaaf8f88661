"""The compile, memory and disk cache of the CuTe-DSL kernels, and the launch path every family's ops use.

A kernel family is a subpackage of three modules: ``config.py`` (a frozen ``Variant`` dataclass: everything
that changes the generated code, plus ``family``, ``key`` and ``kernel_module``; no cutlass import), the kernel
module it names (``kernel.py``: ``compile_variant(variant, tvm_ffi, extra_options)``, the only place cutlass is
imported) and ``ops.py`` (torch ops: checks, allocation, launch). This module imports a kernel module only to
compile, by the name its variant carries, so no config module imports its kernel and a new family adds files,
not branches.

Compiled kernels are cached by variant and GPU arch -- never by shapes or group values. With
``apache-tvm-ffi`` present, kernels are called through TVM-FFI (torch tensors passed straight to the
compiled host stub, the current torch stream taken from the environment) and exported to disk: an
object file, linked into a shared library where a C compiler is found, so another process loads them
with ``tvm_ffi.load_module`` -- no tracing, no compiling, no cutlass import. The directory is
``$MOE_QUANT_CACHE_DIR`` or ``~/.cache/moe_quant/cutedsl``; file names carry a hash of the family's
kernel sources and the cutlass-dsl / tvm-ffi versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import threading
import time
from pathlib import Path

import torch

from .. import layouts
from ..backends import device_capability, importable

# Tests set this to fill every output with 0xFF bytes before the launch, so that a byte the
# kernel fails to write shows up as a mismatch.
POISON_OUTPUTS = False
INT32_MAX = 2**31 - 1
# Tests and ``scripts/host_glue_cpu.py`` set this, with compiling and launching stubbed, to count and time the ops'
# own Python (their checks, plans and allocations) on CPU tensors: the ops' test of a CUDA input then takes the CPU.
CPU_STUBS = False


def empty(shape, dtype, device) -> torch.Tensor:
    """An output buffer (0xFF bytes when :data:`POISON_OUTPUTS` is set).

    The size goes by keyword, as in every op's eager allocations (``torch.empty(size=shape, ...)``, or one int
    positionally): a positional tuple takes a slower path of torch's argument parser, 0.8-1.5 µs more per call,
    a positional ``torch.Size`` 1.8-3 µs more, where the whole allocation costs 1.7 µs (CPU, torch 2.11 and 2.13,
    2026-12-02)."""
    t = torch.empty(size=(shape,) if isinstance(shape, int) else shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        poison(t)
    return t


def compile_variant(variant, tvm_ffi: bool, extra_options: str = ""):
    """Compile ``variant`` with its kernel module (imported here, by name, on first use)."""
    module = importlib.import_module(f"{__package__}.{variant.kernel_module}")
    return module.compile_variant(variant, tvm_ffi=tvm_ffi, extra_options=extra_options)


# ----------------------------------------------------------------------------- compile cache

_SRC_HASH: dict = {}  # kernel module -> hash


def _source_file(module: str) -> Path:
    """The source file of ``module``, a module name relative to the ``moe_quant`` package
    (``kernels.quantize_32x1.kernel``, ``numerics``), found without importing it."""
    return Path(__file__).resolve().parent.parent.joinpath(*module.split(".")).with_suffix(".py")


def sources(variant) -> list[Path]:
    """Every source that shapes the variant's generated code: its kernel module, its config module (the constants
    the kernel reads), the modules the kernel builds on (``kernel_deps``: names relative to ``moe_quant``) and
    the shared device helpers, layouts and numerics."""
    config = type(variant).__module__.split(".", 1)[1]  # moe_quant.kernels.<family>.config -> kernels.<family>.config
    names = (f"kernels.{variant.kernel_module}", config, *getattr(variant, "kernel_deps", ()), "kernels.cute_utils",
             "layouts", "numerics")
    return [_source_file(n) for n in dict.fromkeys(names)]


def _src_hash(variant) -> str:
    """Hash of :func:`sources` plus the cutlass-dsl / tvm-ffi versions: editing one family's kernel keeps the
    other families' disk cache."""
    module = variant.kernel_module
    if module in _SRC_HASH:
        return _SRC_HASH[module]
    h = hashlib.sha256()
    for p in sources(variant):
        h.update(p.read_bytes())
    try:
        from importlib.metadata import version

        h.update(version("nvidia-cutlass-dsl").encode())
    except Exception:  # pragma: no cover - metadata missing
        h.update(b"cutlass-dsl-unknown")
    try:
        import tvm_ffi

        h.update(str(getattr(tvm_ffi, "__version__", "tvm")).encode())
    except Exception:
        pass
    _SRC_HASH[module] = h.hexdigest()[:16]
    return _SRC_HASH[module]


def cache_dir() -> Path:
    d = os.environ.get("MOE_QUANT_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "moe_quant" / "cutedsl"


def tvm_ffi_available() -> bool:
    return importable("tvm_ffi", "MOE_QUANT_NO_TVM_FFI")


class Compiled:
    """A compiled variant and how to call it."""

    __slots__ = ("fn", "tvm", "source", "owner", "call")

    def __init__(self, fn, tvm: bool, source: str, owner=None):
        self.fn = fn  # with TVM-FFI: the positional-only tvm_ffi.Function (the kernel's arguments, in order)
        self.tvm = tvm
        self.source = source  # "compiled" | "disk"
        self.owner = owner  # keeps the compiled module (and its engine) alive
        # what :func:`launch` calls: the TVM-FFI function itself (no Python frame in between), else the DLPack path
        self.call = fn if tvm else self._call_dlpack

    def __call__(self, *tensors):
        self.call(*tensors)

    def _call_dlpack(self, *tensors):
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack

        def conv(t):
            if not isinstance(t, torch.Tensor):  # None, or a scalar argument (an int)
                return t
            align = 4 if t.dtype == torch.int32 else 16
            return from_dlpack(t, assumed_align=align).mark_layout_dynamic()

        device = tensors[0].device
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        with torch.cuda.device(device):  # the launch goes to the current device's context
            self.fn(*(conv(t) for t in tensors), stream)


_LOCK = threading.Lock()
_KERNELS: dict = {}
STATS = {"compiled": 0, "disk_hits": 0, "compile_s": 0.0, "load_s": 0.0}
# _save_to_disk links a shared library beside each object file where a C compiler is found; off for a cache that is
# filled for another machine (scripts/warm_kernel_cache.py): the library would point at this machine's runtime
# libraries, and the object file loads there anyway
LINK_SHARED = True


def get_kernel(variant, arch: str) -> Compiled:
    """The compiled kernel of ``variant`` for ``arch`` (memory cache, then disk, then compile)."""
    key = (variant, arch)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    with _LOCK:
        k = _KERNELS.get(key)
        if k is None:
            k = build(variant, arch)
            _KERNELS[key] = k
    return k


def _disk_ok() -> bool:
    return os.environ.get("MOE_QUANT_NO_DISK_CACHE", "0") != "1"


def _load_from_disk(stem: Path, name: str):
    """A cached kernel: the linked ``.so`` through tvm_ffi alone (no cutlass import), else the ``.o``
    through cutlass' loader. None if neither loads."""
    so, obj = stem.with_suffix(".so"), stem.with_suffix(".o")
    if so.exists():
        try:
            import tvm_ffi

            mod = tvm_ffi.load_module(str(so))
            return mod[name], mod
        except Exception:
            pass
    if obj.exists():
        try:
            from cutlass.runtime import load_module

            mod = load_module(str(obj), enable_tvm_ffi=True)
            return getattr(mod, name), mod
        except Exception:
            pass
    return None


def _save_to_disk(fn, stem: Path, name: str) -> None:
    """Export the compiled kernel (object file) and, where a C compiler is found, link it into a shared
    library that tvm_ffi loads without the DSL. Writes go through temporary names, then rename."""
    import shutil
    import subprocess

    stem.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.tmp"
    obj = stem.with_suffix(".o")
    tmp_obj = stem.parent / (stem.name + tag + ".o")
    fn.export_to_c(str(tmp_obj), function_name=name)
    cc = (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) if LINK_SHARED else None
    if cc:
        try:
            from cutlass.runtime import find_runtime_libraries

            libs = find_runtime_libraries(enable_tvm_ffi=True)
            tmp_so = stem.parent / (stem.name + tag + ".so")
            cmd = [cc, "-shared", "-o", str(tmp_so), str(tmp_obj)]
            for lib in libs:
                cmd += [lib, f"-Wl,-rpath,{os.path.dirname(lib)}"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
            os.replace(tmp_so, stem.with_suffix(".so"))
        except Exception:
            pass  # the object file alone still serves (through cutlass' loader)
    os.replace(tmp_obj, obj)


def build(variant, arch: str) -> Compiled:
    tvm = tvm_ffi_available()
    name = f"mq_{variant.family}_{variant.key.replace('-', '_')}"
    stem = cache_dir() / f"{variant.family}-{variant.key}-{arch}-{_src_hash(variant)}"
    if tvm and _disk_ok():
        t0 = time.perf_counter()
        hit = _load_from_disk(stem, name)
        if hit is not None:
            STATS["disk_hits"] += 1
            STATS["load_s"] += time.perf_counter() - t0
            return Compiled(hit[0], True, "disk", owner=hit[1])
    t0 = time.perf_counter()
    fn = compile_variant(variant, tvm_ffi=tvm, extra_options=f"--gpu-arch {arch}")
    STATS["compiled"] += 1
    STATS["compile_s"] += time.perf_counter() - t0
    if not tvm:
        return Compiled(fn, False, "compiled")
    if _disk_ok():
        try:
            _save_to_disk(fn, stem, name)
        except Exception:
            pass  # a read-only cache dir only costs the next process a compile
    raw = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else None
    if raw is None:  # no execution engine (cross-compiled for another arch): the wrapper says so on call
        raw = fn
    return Compiled(raw, True, "compiled", owner=fn)


# ----------------------------------------------------------------------------- launch path


def arch(device: torch.device) -> str:
    """CuTe-DSL target of a CUDA device, e.g. ``sm_90a`` (capability cached in ``backends``)."""
    major, minor = device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


_SMS: dict = {}  # device index -> streaming multiprocessors


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached): what a persistent grid is sized by."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SMS.get(index)
    if n is None:
        n = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_FAST: dict = {}  # (family key..., device index) -> Compiled: one dict lookup


def _fast_key(key: tuple, device: torch.device) -> tuple:
    return key + (device.index,)


def kernel_for(key: tuple, make_variant, device: torch.device) -> Compiled:
    """The compiled kernel for ``key`` (a hashable tuple unique to the variant, without the device) on
    ``device``; ``make_variant()`` builds the variant on the first call only. The ops with plans look it up once
    per shape (their :func:`plan` holds it)."""
    fast_key = _fast_key(key, device)
    k = _FAST.get(fast_key)
    if k is None:
        k = _FAST[fast_key] = get_kernel(make_variant(), arch(device))
    return k


PLAN_LIMIT = 4096  # plans one op keeps; past it the op's dict is emptied (shapes that vary without end)
_PLAN_TABLES: list = []  # every op's dict of plans (plan_table): emptied when a kernel is swapped (in_place_of)


def plan_table() -> dict:
    """A new dict of an op's plans (:func:`plan`), emptied whenever :func:`in_place_of` swaps a kernel (a plan holds
    the compiled kernel it launches)."""
    table: dict = {}
    _PLAN_TABLES.append(table)
    return table


def forget_plans() -> None:
    """Empty every op's plans: the next call at each shape makes its plan again (and looks its kernel up again)."""
    for table in _PLAN_TABLES:
        table.clear()


def plan(plans: dict, key: tuple, make):
    """``plans[key]``, made by ``make(*key)`` on a miss: what an op's eager call at one shape needs beyond its
    tensors (output shapes, the compiled kernel on the device the key ends with, or None where nothing launches),
    computed once per shape. ``make`` may raise (a buffer past the int32 range): nothing is kept then. Keyed by every
    argument the plan depends on, so a hit is the plain computation's answer; the ops read their dict first
    (``plans.get(key) or cc.plan(plans, key, make)``: one lookup per call). Only eager calls use plans (under
    tracing the ops' fake implementations run), so no compiled graph guards on them."""
    p = make(*key)
    if len(plans) >= PLAN_LIMIT:
        plans.clear()
    plans[key] = p
    return p


def poison(*tensors) -> None:
    """Fill each output (``None`` skipped) with 0xFF bytes: see :data:`POISON_OUTPUTS`."""
    for t in tensors:
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


@contextlib.contextmanager
def in_place_of(key: tuple, variant, device: torch.device):
    """Within the block, the op whose ``kernel_for`` key on ``device`` is ``key`` launches ``variant`` (another
    variant of the same kernel: same arguments) instead of its own: how the A/B script and the GPU tests run
    the candidates (``CANDIDATES`` of a config module) through the ops."""
    fast_key = _fast_key(key, device)
    kernel = get_kernel(variant, arch(device))
    old = _FAST.get(fast_key)
    _FAST[fast_key] = kernel
    forget_plans()  # the plans made before hold the op's own kernel
    try:
        yield
    finally:
        if old is None:
            _FAST.pop(fast_key, None)
        else:
            _FAST[fast_key] = old
        forget_plans()


def via_dispatcher(t: torch.Tensor) -> bool:
    """Go through the ``torch.ops.moe_quant`` op (its fake implementation under tracing) rather than
    launching directly: while compiling, and for any tensor that is not a plain ``torch.Tensor`` (the
    FakeTensors dynamo propagates through a subclass' ``__torch_function__``, functional tensors)."""
    return type(t) is not torch.Tensor or torch.compiler.is_compiling()


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel reads it: row-major strides (also with no elements, see ``layouts.row_major``) and
    16-byte aligned (the kernels load 16-byte vectors): ``t`` itself where it already is, else a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel():  # the hot path: nothing to do
        return t
    t = layouts.row_major(t)
    return t if t.data_ptr() % 16 == 0 else t.clone()


def launch(kernel: Compiled, x, *tensors) -> None:
    """Run ``kernel(x, *tensors)`` on ``x``'s device and the current stream. Through TVM-FFI that is the call
    itself: the compiled function switches to the device of its first CUDA tensor for the launch and back
    (CuTe DSL's TVM-FFI call provider) and launches on that device's current torch stream (TVM-FFI's environment
    stream, set from torch's ``current_work_stream`` of the first CUDA argument's device), so no Python guard
    runs per call; the DLPack path (no TVM-FFI) switches in Python (:meth:`Compiled._call_dlpack`). The ops whose
    plans hold their kernel call ``kernel.call(x, *tensors)`` themselves: the same, without this function's frame."""
    kernel.call(x, *tensors)
