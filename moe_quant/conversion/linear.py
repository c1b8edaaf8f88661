"""The converted forward of ``nn.Linear``: one expert's projection as an MXFP8 GEMM of one group.

Experts written as a ``ModuleList`` of per-expert modules (``nn.Linear`` layers, or small MLPs of them) run each
expert's Linear layers on that expert's tokens. Converted, ``y = x W^T + b`` is :func:`moe_quant.mxfp8_grouped_mm`
of ``x`` as ``(M, K)`` by ``W^T`` as one group (G = 1: the same 1x32 / 32x1 quantizers and GEMMs -- forward, input
gradient, weight gradient -- as a stacked experts module's), the bias added to its output. The parameters stay the
Linear's own. A call MXFP8 cannot serve (K or N not a multiple of 32, fp16) runs ``F.linear``, counted as a
fallback. Under ``torch.autocast`` it runs at the autocast dtype, as ``F.linear`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import autograd as _autograd
from .fallbacks import fallback
from .gemm import _IN_DTYPES, _autocast_dtype, unsupported_reason


def linear_forward(self, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``, converted: ``input (..., K)`` -> ``(..., N)``, the GEMM in MXFP8 (one group of all rows)."""
    config = self._mxfp8_config
    weight, bias = self.weight, self.bias
    cast = _autocast_dtype(input.device.type)
    if cast is not None and cast not in _IN_DTYPES:
        reason = f"nn.Linear under autocast to {cast} (MXFP8 serves bfloat16 / float32)"
    else:
        x = input if cast is None else input.to(cast)
        a = x.reshape(-1, x.shape[-1])
        w_t = weight.t().unsqueeze(0)  # (1, K, N): the weight of the one group, a view of the parameter
        offs = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)
        out_dtype = config.out_dtype or a.dtype
        reason = unsupported_reason(a, w_t, offs, out_dtype)
        if reason is None:
            # looked up on each call: tests and tools may wrap it
            y = _autograd.mxfp8_grouped_mm(a, w_t, offs, scale_mode=config.scale_mode, out_dtype=out_dtype,
                                           backend=config.backend)
            if x.dim() != 2:  # as F.linear: not a view of the 2-D result (an in-place op on it stays safe)
                y = torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))
            return y if bias is None else y + bias.to(y.dtype)
        reason = f"nn.Linear: {reason}"
    fallback(reason, config.allow_fallback)
    return F.linear(input, weight, bias)
