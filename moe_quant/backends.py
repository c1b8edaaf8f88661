"""Backend selection, in one place.

Two independent choices:

* quantization: the CuTe-DSL kernels on CUDA devices of compute capability 9.0+ when
  ``nvidia-cutlass-dsl`` imports; the pure-PyTorch reference everywhere else (on a 9.0+ device without
  cutlass-dsl a warning once says so, with the pip line).
* GEMM: ``"scaled"`` (``torch._scaled_grouped_mm`` with e8m0 blocked scales, SM100+ only)
  or ``"emulated"`` (dequantize to bf16, ``torch._grouped_mm``; any device).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from .choices import Choice


class GemmBackend(Choice):
    AUTO = "auto"
    EMULATED = "emulated"
    SCALED = "scaled"
    __argname__ = "backend"


_CAPABILITY: dict = {}  # CUDA device index -> compute capability (fixed per process)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None for any other device; cached per device like the decisions
    below (:func:`cached_unless_tracing`: dynamo traces the query itself, with no cache wrapper to warn about)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cached_unless_tracing(_CAPABILITY, index, True, lambda: torch.cuda.get_device_capability(index))


def importable(module: str, disable_env: str) -> bool:
    """``module`` imports and the environment variable ``disable_env`` is not ``"1"``."""
    if os.environ.get(disable_env, "0") == "1":
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


DISABLE_KERNELS = "MOE_QUANT_DISABLE_KERNELS"
KERNELS_PIP = "pip install 'nvidia-cutlass-dsl>=4.8,<4.9' 'apache-tvm-ffi>=0.1.15,<0.2'"  # pyproject.toml's pins
logger = logging.getLogger("moe_quant")


@functools.lru_cache(maxsize=None)
def _cutedsl_importable() -> bool:
    return importable("cutlass.cute", DISABLE_KERNELS)


def cutedsl_import_error() -> str | None:
    """Why ``cutlass.cute`` does not import (None if it does)."""
    try:
        importlib.import_module("cutlass.cute")
    except Exception as e:  # noqa: BLE001 -- any failure means no kernels; the message says which
        return f"{type(e).__name__}: {e}"
    return None


_SAID_NO_KERNELS: list = []  # the warning below, once per process


@torch._dynamo.assume_constant_result
def _say_no_kernels() -> bool:
    """A device that the kernels serve (Hopper or newer) runs the reference quantizers because nvidia-cutlass-dsl
    does not import: say so once, with the pip line, unless ``MOE_QUANT_DISABLE_KERNELS=1`` chose the reference.
    Runs in Python while Dynamo traces (no graph break)."""
    if not _SAID_NO_KERNELS and os.environ.get(DISABLE_KERNELS, "0") != "1":
        _SAID_NO_KERNELS.append(True)
        logger.warning(
            "moe_quant: this GPU (compute capability 9.0 or newer) could run moe_quant's CuTe-DSL quantization "
            "kernels, but nvidia-cutlass-dsl does not import (%s), so the plain-PyTorch reference quantizes instead: "
            "the same bits, slower. Install the kernels: %s (or pip install -e '.[kernels]'); "
            "%s=1 chooses the reference and silences this. (Logged once.)",
            cutedsl_import_error(), KERNELS_PIP, DISABLE_KERNELS)
    return True


@torch._dynamo.assume_constant_result
def cutedsl_importable() -> bool:
    """nvidia-cutlass-dsl is installed (``MOE_QUANT_DISABLE_KERNELS=1`` forces the reference); cached.

    A constant to ``torch.compile``: dynamo runs it in Python while it traces (it cannot trace an import,
    nor does it honour the cache), so every kernel-or-reference decision (:func:`use_quant_kernels`, the
    per-GEMM and the block paths alike) traces to a constant."""
    return _cutedsl_importable()


def _cacheable(device: torch.device) -> bool:
    """A decision about ``device`` may be cached: it names one device (a CUDA device without an index means
    whichever is current, which can change)."""
    return device.type != "cuda" or device.index is not None


def cached_unless_tracing(cache: dict, key, cacheable: bool, compute):
    """``compute()``, kept in ``cache[key]`` where ``cacheable``. While ``torch.compile`` traces, the cache is
    neither read nor written: dynamo guards on what it reads there, so a cache filled by the trace (or
    later) would make the next call's guards fail and retrace the graph."""
    if torch.compiler.is_compiling():
        return compute()
    hit = cache.get(key)
    if hit is not None:
        return hit
    value = compute()
    if cacheable:
        cache[key] = value
    return value


_KERNELS_ON: dict = {}  # device -> use_quant_kernels' answer (capability and cutlass-dsl are fixed per process)


def use_quant_kernels(x: torch.Tensor) -> bool:
    """True where the CuTe-DSL quantization kernels serve ``x`` (Hopper or newer, cutlass-dsl present). A Hopper or
    newer device without cutlass-dsl logs a warning once (the pip line), unless ``MOE_QUANT_DISABLE_KERNELS=1``."""
    device = x.device

    def compute():
        cap = device_capability(device)
        if cap is None or cap < (9, 0):
            return False
        if cutedsl_importable():
            return True
        _say_no_kernels()
        return False

    return cached_unless_tracing(_KERNELS_ON, device, _cacheable(device), compute)


def supports_scaled_grouped_mm(device: torch.device) -> bool:
    """MXFP8 block-scaled grouped GEMM exists on SM100+ only."""
    cap = device_capability(device)
    return cap is not None and cap >= (10, 0)


_RESOLVED: dict = {}  # (requested, device) -> backend, for requests that resolved (errors are raised every call)


def resolve_gemm_backend(requested: GemmBackend | str, device: torch.device) -> GemmBackend:
    """``auto`` -> ``scaled`` on SM100+, else ``emulated``; an explicit ``scaled`` elsewhere is an error."""
    key = (requested, device) if isinstance(requested, str) else None  # members are str too
    return cached_unless_tracing(_RESOLVED, key, key is not None and _cacheable(device), lambda: _resolve(requested, device))


def _resolve(requested, device: torch.device) -> GemmBackend:
    backend = GemmBackend.parse(requested)
    if backend is GemmBackend.AUTO:
        return GemmBackend.SCALED if supports_scaled_grouped_mm(device) else GemmBackend.EMULATED
    if backend is GemmBackend.SCALED and not supports_scaled_grouped_mm(device):
        raise ValueError(
            f"backend='scaled' needs a CUDA device of compute capability 10.0+ (MXFP8 tensor cores); "
            f"got device {device} (capability {device_capability(device)}); use backend='emulated' or 'auto'"
        )
    return backend


def grouped_mm_zero_fills_empty_groups(device: torch.device) -> bool:
    """``torch._grouped_mm``'s 2D x 2D (weight-gradient) form writes exact zeros for a group with no
    tokens on Hopper (its SM90 CUTLASS kernel; pinned by ``tests/test_grouped_mm_gpu.py`` after poisoning
    the allocator), so the emulated wgrad needs no extra pass over dW there. Elsewhere (CPU, SM100's
    scaled GEMM, which is known to leave garbage, other GPUs) the plugin zeroes empty experts itself."""
    return device_capability(device) == (9, 0)
