"""Converted forwards of the SwiGLU expert modules conversion knows, all through :func:`swiglu_experts`.

``swiglu_experts(x, w1, w3, w2, offs, config)`` is the one place where a block of routed SwiGLU
experts runs: ``silu(x @ w1^T) * (x @ w3^T) @ w2^T`` per expert, three MXFP8 grouped GEMMs. A fused
expert-block implementation replaces this function and every converted module follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MXFP8MoEConfig
from .gemm import grouped_mm


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                   config: MXFP8MoEConfig) -> torch.Tensor:
    """``x (M, D)`` tokens grouped by expert (``offs (E,)`` int32 cumulative ends); ``w1``, ``w3``
    ``(E, F, D)``, ``w2`` ``(E, D, F)`` (``(out, in)`` per expert) -> ``(M, D)``."""
    h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offs, config))
    h = h * grouped_mm(x, w3.transpose(-2, -1), offs, config)
    return grouped_mm(h, w2.transpose(-2, -1), offs, config)


def moe_quant_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """:class:`moe_quant.moe.GroupedExperts`, converted."""
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    x = x.to(self.w1.dtype)
    return swiglu_experts(x, self.w1, self.w3, self.w2, offs, self._mxfp8_config)


def _local(w):
    return w.to_local() if hasattr(w, "to_local") else w  # a DTensor (expert / tensor parallel) -> its shard


def torchtitan_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3.0's ``GroupedExperts``, converted: as its forward (bf16 activations, output in
    ``x``'s dtype), the three GEMMs in MXFP8; fp32 master weights are read as bf16 inside them."""
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    return swiglu_experts(x_RD.bfloat16(), w1, w3, w2, offs, self._mxfp8_config).type_as(x_RD)


def grouped_mm_seam(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The ``_grouped_mm(self, *, A, B_t, offs)`` seam of a module, converted."""
    return grouped_mm(A, B_t, offs, self._mxfp8_config)
