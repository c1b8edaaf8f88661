"""One expert GEMM of a converted module: MXFP8 where it can serve the call, else the counted fallback.

* :func:`grouped_mm` -- ``torch._grouped_mm(A, B_t, offs=offs)`` with ``A (M, K)`` tokens grouped
  by expert and ``B_t (E, K, N)`` (normally ``W.transpose(-2, -1)`` of an ``(E, N, K)`` weight).
* :func:`bmm` -- ``torch.bmm(x, w)`` with ``x (E, T, K)`` and ``w (E, K, N)``: every expert sees T
  tokens (Hugging Face's Llama4 experts), a grouped GEMM of E uniform groups of T rows. Under
  ``torch.autocast`` it runs at the autocast dtype, as the plain ``bmm`` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import autograd as _autograd
from ..numerics import BLOCK_SIZE
from .config import OUT_DTYPES, MXFP8MoEConfig
from .fallbacks import fallback

_IN_DTYPES = (torch.bfloat16, torch.float32)


def unsupported_reason(A, B_t, offs, out_dtype) -> Optional[str]:
    """Why MXFP8 cannot serve ``A @ B_t`` grouped by ``offs``, or None. Reasons name no sizes: each is
    logged once, not once per shape."""
    if A.ndim != 2 or B_t.ndim != 3:
        return f"{A.ndim}D x {B_t.ndim}D operands (MXFP8 serves 2D x 3D with offs)"
    if offs is None:
        return "2D x 3D without offs"
    if A.dtype not in _IN_DTYPES or B_t.dtype not in _IN_DTYPES:
        return f"dtypes {A.dtype} x {B_t.dtype} (MXFP8 serves bfloat16 / float32)"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype {out_dtype} (MXFP8 serves bfloat16 / float32)"
    if B_t.shape[-2] % BLOCK_SIZE or B_t.shape[-1] % BLOCK_SIZE:
        return f"K or N not a multiple of {BLOCK_SIZE}"
    return None


def grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: Optional[torch.Tensor], config: MXFP8MoEConfig,
               *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` in MXFP8 (forward, dgrad and wgrad), or the plain op,
    counted, where MXFP8 cannot serve it. fp32 master weights are read as bf16; their gradient is fp32."""
    resolved = out_dtype or config.out_dtype or A.dtype
    reason = unsupported_reason(A, B_t, offs, resolved)
    if reason is None:
        # looked up on each call: tests and tools may wrap it
        return _autograd.mxfp8_grouped_mm(A, B_t, offs, scale_mode=config.scale_mode, out_dtype=resolved,
                                          backend=config.backend)
    fallback(reason, config.allow_fallback)
    return torch._grouped_mm(A, B_t, offs=offs, out_dtype=out_dtype)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def bmm(x: torch.Tensor, w: torch.Tensor, config: MXFP8MoEConfig) -> torch.Tensor:
    """``torch.bmm(x, w)``, ``x (E, T, K)``, ``w (E, K, N)``: one MXFP8 grouped GEMM of E groups of T rows."""
    cast = _autocast_dtype(x.device.type)
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        reason = "bmm of other shapes than (E, T, K) x (E, K, N)"
    elif cast is not None and cast not in _IN_DTYPES:
        reason = f"bmm under autocast to {cast} (MXFP8 serves bfloat16 / float32)"
    else:
        if cast is not None:  # autocast runs bmm at its dtype: so does MXFP8 (w is read as bf16 anyway)
            x = x.to(cast)
        e, t, k = x.shape
        a = x.reshape(e * t, k)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=x.device) * t
        reason = unsupported_reason(a, w, offs, config.out_dtype or a.dtype)
        if reason is None:
            return grouped_mm(a, w, offs, config).view(e, t, w.shape[-1])
        reason = f"bmm: {reason}"
    fallback(reason, config.allow_fallback)
    return torch.bmm(x, w)
