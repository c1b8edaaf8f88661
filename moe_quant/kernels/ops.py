"""Torch ops over the CuTe-DSL quantization kernels.

``quantize_1x32`` / ``fake_quantize_1x32`` validate their arguments, allocate the
outputs and launch a compiled kernel. They are registered as ``torch.library`` custom
ops (``torch.ops.moe_quant.*``) with fake implementations, so ``torch.compile(fullgraph=True)``
keeps them in the graph; in eager mode on plain tensors the Python wrappers call the implementation
directly (no dispatcher round trip), which keeps the host overhead of a call small.

Compiled kernels are cached by :class:`~moe_quant.kernels.quantize_1x32.Variant` (what
changes the code: input dtype, scale mode, output kind, out dtype, tile config) and the
GPU arch -- never by M, K, G or the values of ``offs``. With ``apache-tvm-ffi`` present,
kernels are called through TVM-FFI (torch tensors passed straight to the compiled host
stub, the current torch stream taken from the environment) and exported to disk: an
object file, linked into a shared library where a C compiler is found, so another process
loads them with ``tvm_ffi.load_module`` -- no tracing, no compiling, no cutlass import.
The directory is ``$MOE_QUANT_CACHE_DIR`` or ``~/.cache/moe_quant/cutedsl``; file names carry
a hash of the kernel sources and the cutlass-dsl / tvm-ffi versions.
"""

from __future__ import annotations

import hashlib
import time
import os
import threading
from pathlib import Path

import torch

from .. import layouts
from ..backends import device_capability, importable
from ..numerics import BLOCK_SIZE, ScaleMode

_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FAKE_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SCALE_LAYOUTS = ("blocked", "plain")
_INT32_MAX = 2**31 - 1

# Tests set this to fill every output with 0xFF bytes before the launch, so that a byte the
# kernel fails to write shows up as a mismatch.
POISON_OUTPUTS = False


def _empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        t.view(torch.uint8).fill_(0xFF)
    return t

# ----------------------------------------------------------------------------- validation


def _check_x(x, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be 2D (M, K), got shape {tuple(x.shape)}")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"{fn}: x.shape[1] (K={x.shape[1]}) must be a multiple of {BLOCK_SIZE}")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: x must be contiguous (row-major), got strides {x.stride()}")


def _check_device(x, fn: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{fn}: x must be on a CUDA device, got {x.device}")


def _check_offs(offs, x: torch.Tensor, fn: str) -> None:
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{fn}: offs must be a torch.Tensor or None, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{fn}: offs must be int32, got {offs.dtype}")
    if offs.dim() != 1:
        raise ValueError(f"{fn}: offs must be 1D (G,), got shape {tuple(offs.shape)}")
    if offs.device != x.device and x.device.type != "cpu":
        raise ValueError(f"{fn}: offs must be on the same device as x ({x.device}), got {offs.device}")


def _scale_shape(m: int, k: int, offs, scale_layout: str) -> tuple[int, int]:
    kb = k // BLOCK_SIZE
    if offs is not None:
        return layouts.m_groups_blocked_shape(m, kb, offs.shape[0])
    if scale_layout == "blocked":
        return layouts.blocked_shape(m, kb)
    return m, kb


# ----------------------------------------------------------------------------- compile cache


_SRC_HASH = None


def _src_hash() -> str:
    """Hash of every source that shapes the generated code, plus the cutlass-dsl / tvm-ffi versions."""
    global _SRC_HASH
    if _SRC_HASH is not None:
        return _SRC_HASH
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in (here / "quantize_1x32.py", here / "quantize_32x1.py", here / "cute_utils.py", here.parent / "layouts.py",
              here.parent / "numerics.py"):
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
    _SRC_HASH = h.hexdigest()[:16]
    return _SRC_HASH


def cache_dir() -> Path:
    d = os.environ.get("MOE_QUANT_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "moe_quant" / "cutedsl"


def _tvm_ffi_available() -> bool:
    return importable("tvm_ffi", "MOE_QUANT_NO_TVM_FFI")


class _Compiled:
    """A compiled variant and how to call it."""

    __slots__ = ("fn", "tvm", "source", "owner")

    def __init__(self, fn, tvm: bool, source: str, owner=None):
        self.fn = fn  # with TVM-FFI: the positional-only tvm_ffi.Function (the kernel's tensors, in order)
        self.tvm = tvm
        self.source = source  # "compiled" | "disk"
        self.owner = owner  # keeps the compiled module (and its engine) alive

    def __call__(self, *tensors):
        if self.tvm:
            self.fn(*tensors)
            return
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack

        def conv(t):
            if t is None:
                return None
            align = 4 if t.dtype == torch.int32 else 16
            return from_dlpack(t, assumed_align=align).mark_layout_dynamic()

        stream = cuda.CUstream(torch.cuda.current_stream(tensors[0].device).cuda_stream)
        self.fn(*(conv(t) for t in tensors), stream)


_LOCK = threading.Lock()
_KERNELS: dict = {}
STATS = {"compiled": 0, "disk_hits": 0, "compile_s": 0.0, "load_s": 0.0}


def get_kernel(variant, arch: str) -> _Compiled:
    """The compiled kernel of ``variant`` for ``arch`` (memory cache, then disk, then compile)."""
    key = (variant, arch)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    with _LOCK:
        k = _KERNELS.get(key)
        if k is None:
            k = _build(variant, arch)
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
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
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


def _build(variant, arch: str) -> _Compiled:
    tvm = _tvm_ffi_available()
    name = f"mq_{variant.family}_{variant.key.replace('-', '_')}"
    stem = cache_dir() / f"{variant.family}-{variant.key}-{arch}-{_src_hash()}"
    if tvm and _disk_ok():
        t0 = time.perf_counter()
        hit = _load_from_disk(stem, name)
        if hit is not None:
            STATS["disk_hits"] += 1
            STATS["load_s"] += time.perf_counter() - t0
            return _Compiled(hit[0], True, "disk", owner=hit[1])
    t0 = time.perf_counter()
    fn = variant.compile(tvm_ffi=tvm, extra_options=f"--gpu-arch {arch}")
    STATS["compiled"] += 1
    STATS["compile_s"] += time.perf_counter() - t0
    if not tvm:
        return _Compiled(fn, False, "compiled")
    if _disk_ok():
        try:
            _save_to_disk(fn, stem, name)
        except Exception:
            pass  # a read-only cache dir only costs the next process a compile
    raw = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else None
    if raw is None:  # no execution engine (cross-compiled for another arch): the wrapper says so on call
        raw = fn
    return _Compiled(raw, True, "compiled", owner=fn)


# ----------------------------------------------------------------------------- implementations

def _arch(device: torch.device) -> str:
    """CuTe-DSL target of a CUDA device, e.g. ``sm_90a`` (capability cached in ``backends``)."""
    major, minor = device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _variant(in_dtype, mode: ScaleMode, kind: str, out_dtype: str = "float8_e4m3fn"):
    from .config_1x32 import Variant

    key = (in_dtype, mode, kind, out_dtype)
    v = _VARIANTS.get(key)
    if v is None:
        v = _VARIANTS[key] = Variant(_IN_DTYPES[in_dtype], mode.value, kind, out_dtype)
    return v


_VARIANTS: dict = {}


def _via_dispatcher(t: torch.Tensor) -> bool:
    """Go through the ``torch.ops.moe_quant`` op (its fake implementation under tracing) rather than
    launching directly: while compiling, and for any tensor that is not a plain ``torch.Tensor`` (the
    FakeTensors dynamo propagates through a subclass' ``__torch_function__``, functional tensors)."""
    return type(t) is not torch.Tensor or torch.compiler.is_compiling()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel reads it: 16-byte aligned, row-major strides (also with no elements)."""
    t = layouts.row_major(t)
    return t if t.data_ptr() % 16 == 0 else t.clone()


_FAST: dict = {}  # (dtype, mode, kind, out, device index) -> _Compiled: one dict lookup per call


def _kernel_for(x: torch.Tensor, mode: str, kind: str, out: str) -> _Compiled:
    key = (x.dtype, mode, kind, out, x.get_device())
    k = _FAST.get(key)
    if k is None:
        k = _FAST[key] = get_kernel(_variant(x.dtype, ScaleMode(mode), kind, out), _arch(x.device))
    return k


def _launch(kernel: _Compiled, x, *tensors) -> None:
    if x.get_device() != torch._C._cuda_getDevice():
        with torch.cuda.device(x.device):
            kernel(x, *tensors)
    else:
        kernel(x, *tensors)


def _quantize_impl(x: torch.Tensor, mode: str, offs, scale_layout: str):
    m, k = x.shape
    kind = "mgroups" if offs is not None else ("blocked" if scale_layout == "blocked" else "plain")
    srows, scols = _scale_shape(m, k, offs, scale_layout)
    data = _empty((m, k), torch.float8_e4m3fn, x.device)
    scales = _empty((srows, scols), torch.uint8, x.device)
    if scales.numel() > _INT32_MAX:
        raise ValueError(f"quantize_1x32: scale buffer of {scales.numel()} bytes exceeds the int32 index range")
    if x.numel() or scales.numel():
        _launch(_kernel_for(x, mode, kind, "float8_e4m3fn"), _aligned(x), data, scales, offs)
    return data, scales.view(torch.float8_e8m0fnu)


def _fake_impl(x: torch.Tensor, mode: str, out_dtype: torch.dtype):
    out = _empty(x.shape, out_dtype, x.device)
    if x.numel():
        _launch(_kernel_for(x, mode, "fake", _FAKE_OUT_DTYPES[out_dtype]), _aligned(x), out, None, None)
    return out


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("moe_quant::quantize_1x32", mutates_args=(), device_types="cuda")
def _quantize_1x32_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor | None, scale_layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, mode, offs, scale_layout)


@_quantize_1x32_op.register_fake
def _(x, mode, offs, scale_layout):
    m, k = x.shape
    srows, scols = _scale_shape(m, k, offs, scale_layout)
    data = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((srows, scols), dtype=torch.float8_e8m0fnu)
    return data, scales


@torch.library.custom_op("moe_quant::fake_quantize_1x32", mutates_args=(), device_types="cuda")
def _fake_quantize_1x32_op(x: torch.Tensor, mode: str, out_dtype: torch.dtype) -> torch.Tensor:
    return _fake_impl(x, mode, out_dtype)


@_fake_quantize_1x32_op.register_fake
def _(x, mode, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


# ----------------------------------------------------------------------------- public API


def quantize_1x32(
    x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor | None = None, scale_layout: str = "blocked"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1x32 MXFP8: ``(data float8_e4m3fn (M, K), scales float8_e8m0fnu)``.

    Scales: with ``offs`` the M-groups blocked buffer ``layouts.m_groups_blocked_shape(M, K/32, G)``;
    without, ``scale_layout="blocked"`` gives ``layouts.to_blocked`` of the whole matrix and
    ``"plain"`` gives ``(M, K/32)``. Bit-identical to :func:`moe_quant.reference.quantize_rowwise`.
    """
    fn = "quantize_1x32"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    if offs is not None:
        _check_offs(offs, x, fn)
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{fn}: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    _check_device(x, fn)
    if _via_dispatcher(x):
        return torch.ops.moe_quant.quantize_1x32(x, mode.value, offs, scale_layout)
    return _quantize_impl(x, mode.value, offs, scale_layout)


def fake_quantize_1x32(x: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantized rowwise 1x32 MXFP8 of ``x`` as ``out_dtype`` (bf16 or fp32), in one pass.

    Bit-identical to :func:`moe_quant.reference.fake_quantize_rowwise` (NaN blocks are the
    canonical NaN: bf16 0x7FC0, fp32 0x7FC00000).
    """
    fn = "fake_quantize_1x32"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    if out_dtype not in _FAKE_OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    _check_device(x, fn)
    if _via_dispatcher(x):
        return torch.ops.moe_quant.fake_quantize_1x32(x, mode.value, out_dtype)
    return _fake_impl(x, mode.value, out_dtype)


# ----------------------------------------------------------------------------- colwise 32x1 (wgrad operands, 3D along N)

_OUT_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _variant_32x1(in_dtype, mode: str, groups: str, out_dtype: torch.dtype):
    from .config_32x1 import Variant

    key = ("32x1", in_dtype, mode, groups, out_dtype)
    v = _VARIANTS.get(key)
    if v is None:
        v = _VARIANTS[key] = Variant(_IN_DTYPES[in_dtype], mode, groups, _OUT_NAMES[out_dtype])
    return v


def _kernel_32x1(x: torch.Tensor, mode: str, groups: str, out_dtype: torch.dtype) -> _Compiled:
    key = ("32x1", x.dtype, mode, groups, out_dtype, x.get_device())
    k = _FAST.get(key)
    if k is None:
        k = _FAST[key] = get_kernel(_variant_32x1(x.dtype, mode, groups, out_dtype), _arch(x.device))
    return k


def _k_groups_shapes(m: int, r: int, g: int):
    mp = layouts.k_groups_padded_len(m, g)
    return (r, mp), layouts.k_groups_blocked_shape(r, m, g)


def _quantize_32x1_k_groups_impl(x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype):
    m, r = x.shape
    data_shape, scale_shape = _k_groups_shapes(m, r, offs.shape[0])
    fp8 = out_dtype == torch.float8_e4m3fn
    data = _empty(data_shape, out_dtype, x.device)
    scales = _empty(scale_shape, torch.uint8, x.device) if fp8 else None
    if scales is not None and scales.numel() > _INT32_MAX:
        raise ValueError(f"quantize_32x1: scale buffer of {scales.numel()} bytes exceeds the int32 index range")
    poffs = _empty((offs.shape[0],), torch.int32, x.device)
    if data.numel():
        _launch(_kernel_32x1(x, mode, "kgroups", out_dtype), _aligned(x), data, scales, offs, poffs)
    else:  # R = 0, or M = G = 0: no CTA, but the padded offsets still follow from offs
        poffs.copy_(layouts.padded_group_offsets(offs, m))
    return data, (scales.view(torch.float8_e8m0fnu) if fp8 else None), poffs


def _quantize_32x1_3d_impl(w: torch.Tensor, mode: str, out_dtype: torch.dtype):
    e, n, k = w.shape
    fp8 = out_dtype == torch.float8_e4m3fn
    data = _empty((e, k, n), out_dtype, w.device)
    scales = None
    if fp8:
        rp, cp = layouts.blocked_shape(k, n // BLOCK_SIZE)
        scales = _empty((e, rp * cp), torch.uint8, w.device)
    if w.numel():
        _launch(_kernel_32x1(w, mode, "uniform", out_dtype), _aligned(w.view(e * n, k)), data, scales, None, None)
    elif scales is not None:
        scales.zero_()
    return data, (scales.view(torch.float8_e8m0fnu) if fp8 else None)


@torch.library.custom_op("moe_quant::quantize_32x1_k_groups", mutates_args=(), device_types="cuda")
def _quantize_32x1_k_groups_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data, scales, poffs = _quantize_32x1_k_groups_impl(x, mode, offs, torch.float8_e4m3fn)
    return data, scales, poffs


@_quantize_32x1_k_groups_op.register_fake
def _(x, mode, offs):
    data_shape, scale_shape = _k_groups_shapes(x.shape[0], x.shape[1], offs.shape[0])
    return (x.new_empty(data_shape, dtype=torch.float8_e4m3fn), x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu),
            offs.new_empty(offs.shape))


@torch.library.custom_op("moe_quant::fake_quantize_32x1_k_groups", mutates_args=(), device_types="cuda")
def _fake_quantize_32x1_k_groups_op(
    x: torch.Tensor, mode: str, offs: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    data, _, poffs = _quantize_32x1_k_groups_impl(x, mode, offs, out_dtype)
    return data, poffs


@_fake_quantize_32x1_k_groups_op.register_fake
def _(x, mode, offs, out_dtype):
    data_shape, _ = _k_groups_shapes(x.shape[0], x.shape[1], offs.shape[0])
    return x.new_empty(data_shape, dtype=out_dtype), offs.new_empty(offs.shape)


@torch.library.custom_op("moe_quant::quantize_32x1_3d", mutates_args=(), device_types="cuda")
def _quantize_32x1_3d_op(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    data, scales = _quantize_32x1_3d_impl(w, mode, torch.float8_e4m3fn)
    return data, scales


@_quantize_32x1_3d_op.register_fake
def _(w, mode):
    e, n, k = w.shape
    rp, cp = layouts.blocked_shape(k, n // BLOCK_SIZE)
    return w.new_empty((e, k, n), dtype=torch.float8_e4m3fn), w.new_empty((e, rp * cp), dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("moe_quant::fake_quantize_32x1_3d", mutates_args=(), device_types="cuda")
def _fake_quantize_32x1_3d_op(w: torch.Tensor, mode: str, out_dtype: torch.dtype) -> torch.Tensor:
    return _quantize_32x1_3d_impl(w, mode, out_dtype)[0]


@_fake_quantize_32x1_3d_op.register_fake
def _(w, mode, out_dtype):
    e, n, k = w.shape
    return w.new_empty((e, k, n), dtype=out_dtype)


def _check_out_dtype(fn: str, out_dtype) -> None:
    if out_dtype not in _FAKE_OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _check_w(w, fn: str, dims=((1, "N"), (2, "K"))) -> None:
    """``w (E, N, K)``: bf16/fp32, contiguous, on CUDA, ``dims`` multiples of 32."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 3:
        raise ValueError(f"{fn}: w must be 3D (E, N, K), got shape {tuple(w.shape)}")
    if w.dtype not in _IN_DTYPES:
        raise TypeError(f"{fn}: w must be bfloat16 or float32, got {w.dtype}")
    for dim, name in dims:
        if w.shape[dim] % BLOCK_SIZE:
            raise ValueError(f"{fn}: w.shape[{dim}] ({name}={w.shape[dim]}) must be a multiple of {BLOCK_SIZE}")
    if not w.is_contiguous():
        raise ValueError(f"{fn}: w must be contiguous (E, N, K), got strides {w.stride()}")
    if not w.is_cuda:
        raise ValueError(f"{fn}: w must be on a CUDA device, got {w.device}")


def quantize_32x1_k_groups(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor):
    """Colwise 32x1 MXFP8 of a wgrad operand ``x (M, R)`` with token groups ``offs``.

    Returns ``(data_t float8_e4m3fn (R, Mp), scales float8_e8m0fnu (round_up(R, 128), ceil(M/32) + 4 G),
    padded_offs int32 (G,))``, ``Mp = round_up(M, 32) + 32 G``: each group's tokens start at a multiple
    of 32, gaps and tail zero. Bit-identical to :func:`moe_quant.reference.quantize_colwise_k_groups`.
    """
    fn = "quantize_32x1_k_groups"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    _check_offs(offs, x, fn)
    _check_device(x, fn)
    if _via_dispatcher(x):
        return torch.ops.moe_quant.quantize_32x1_k_groups(x, mode.value, offs)
    return _quantize_32x1_k_groups_impl(x, mode.value, offs, torch.float8_e4m3fn)


def fake_quantize_32x1_k_groups(x: torch.Tensor, mode: ScaleMode | str, offs: torch.Tensor,
                                out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized colwise 32x1 MXFP8 of ``x (M, R)`` in the layout of :func:`quantize_32x1_k_groups`:
    ``(values_t out_dtype (R, Mp), padded_offs int32 (G,))``, in one pass. Bit-identical to
    :func:`moe_quant.reference.fake_quantize_colwise_k_groups`."""
    fn = "fake_quantize_32x1_k_groups"
    mode = ScaleMode.parse(mode, "mode")
    _check_x(x, fn)
    _check_offs(offs, x, fn)
    _check_out_dtype(fn, out_dtype)
    _check_device(x, fn)
    if _via_dispatcher(x):
        return torch.ops.moe_quant.fake_quantize_32x1_k_groups(x, mode.value, offs, out_dtype)
    data, _, poffs = _quantize_32x1_k_groups_impl(x, mode.value, offs, out_dtype)
    return data, poffs


def quantize_3d_along_n(w: torch.Tensor, mode: ScaleMode | str):
    """Expert weights ``w (E, N, K)`` in blocks of 32 along N: ``(data (E, K, N) e4m3, scales (E, blocked
    K x N/32) e8m0)``. Bit-identical to ``reference.quantize_3d(w, mode, "n")``."""
    fn = "quantize_3d_along_n"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn)
    if _via_dispatcher(w):
        return torch.ops.moe_quant.quantize_32x1_3d(w, mode.value)
    return _quantize_32x1_3d_impl(w, mode.value, torch.float8_e4m3fn)


def fake_quantize_3d_along_n(w: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized ``w (E, N, K)`` in blocks of 32 along N, written ``(E, K, N)`` (N contiguous)."""
    fn = "fake_quantize_3d_along_n"
    mode = ScaleMode.parse(mode, "mode")
    _check_w(w, fn)
    _check_out_dtype(fn, out_dtype)
    if _via_dispatcher(w):
        return torch.ops.moe_quant.fake_quantize_32x1_3d(w, mode.value, out_dtype)
    return _quantize_32x1_3d_impl(w, mode.value, out_dtype)[0]


# ----------------------------------------------------------------------------- 3D along K: the 1x32 kernel


def _uniform_offsets(e: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, e + 1, dtype=torch.int32, device=device) * n


def quantize_3d_along_k(w: torch.Tensor, mode: ScaleMode | str):
    """Expert weights ``w (E, N, K)`` in blocks of 32 along K: ``(data (E, N, K) e4m3, scales (E, blocked
    N x K/32) e8m0)``: the 1x32 kernel on ``(E*N, K)`` with E groups of N rows, whose M-groups layout is
    the per-expert blocked layout (the whole-matrix blocked layout when N % 128 == 0)."""
    fn = "quantize_3d_along_k"
    _check_w(w, fn, dims=((2, "K"),))
    e, n, k = w.shape
    rp, cp = layouts.blocked_shape(n, k // BLOCK_SIZE)
    x = w.view(e * n, k)
    if n % layouts.TILE_ROWS == 0:
        data, scales = quantize_1x32(x, mode, None, scale_layout="blocked")
    else:
        data, scales = quantize_1x32(x, mode, _uniform_offsets(e, n, w.device))
        scales = scales[: e * rp]
    return data.view(e, n, k), scales.reshape(e, rp * cp)


def fake_quantize_3d_along_k(w: torch.Tensor, mode: ScaleMode | str, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantized ``w (E, N, K)`` in blocks of 32 along K (same shape), in one pass."""
    _check_w(w, "fake_quantize_3d_along_k", dims=((2, "K"),))
    e, n, k = w.shape
    return fake_quantize_1x32(w.view(e * n, k), mode, out_dtype).view(e, n, k)
