"""Converted forwards of the SwiGLU expert modules conversion knows, all through :func:`swiglu_experts`.

``swiglu_experts(x, w1, w3, w2, offs, config)`` is the one place where a block of routed SwiGLU
experts runs: ``silu(x @ w1^T) * (x @ w3^T) @ w2^T`` per expert, three MXFP8 grouped GEMMs. Where the
fused block (:func:`moe_quant.mxfp8_swiglu_experts`) serves the call it runs that (same numerics, bit
for bit, fewer quantization passes); otherwise the three GEMMs of :func:`moe_quant.conversion.gemm.grouped_mm`
(each MXFP8 or its counted fallback).
"""

from __future__ import annotations

import inspect

import torch

from .. import autograd as _autograd
from ..autograd.swiglu_block import swiglu_of_gemms, swiglu_w13_of_gemms
from .config import MXFP8MoEConfig
from .gemm import grouped_mm, unsupported_reason


def block_serves(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, offs: torch.Tensor,
                 config: MXFP8MoEConfig) -> bool:
    """The fused block serves this call: ``config.fused_block``, bf16 activations and bf16 GEMM outputs
    (``config.out_dtype`` None or bf16), no ``torch.func`` transform active (the block is no functorch-aware
    function), and each of the three GEMMs one that :func:`grouped_mm` would run in MXFP8 (no counted
    fallback). ``w3`` None: ``w1`` is the concatenated ``w13``. Tokens that arrived in MXFP8 (expert
    parallelism's wire, :mod:`moe_quant.prequantized`) take the block too: its x operand is the received
    form, no quantization pass (:func:`moe_quant.block_quantize.rowwise`)."""
    if not config.fused_block or x.dtype != torch.bfloat16 or config.out_dtype not in (None, torch.bfloat16):
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    # h (w2's A) is (M, F) bf16 like x: the reasons depend on A's rank and dtype only
    return all(unsupported_reason(x, w.transpose(-2, -1), offs, torch.bfloat16) is None
               for w in (w1, w3, w2) if w is not None)


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                   config: MXFP8MoEConfig) -> torch.Tensor:
    """``x (M, D)`` tokens grouped by expert (``offs (E,)`` int32 cumulative ends); ``w1``, ``w3``
    ``(E, F, D)``, ``w2`` ``(E, D, F)`` (``(out, in)`` per expert) -> ``(M, D)``."""
    if block_serves(x, w1, w3, w2, offs, config):
        # looked up on each call: tests and tools may wrap it
        return _autograd.mxfp8_swiglu_experts(x, w1, w3, w2, offs, scale_mode=config.scale_mode,
                                              backend=config.backend, dswiglu_cols_fp8=config.dswiglu_cols_fp8)
    return swiglu_of_gemms(lambda A, W_t: grouped_mm(A, W_t, offs, config), x, w1, w3, w2)


def swiglu_experts_w13(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                       config: MXFP8MoEConfig) -> torch.Tensor:
    """:func:`swiglu_experts` with the gate and up weights concatenated: ``w13 (E, 2H, D)`` (gate rows, then up
    rows, transformers' ``gate_up_proj`` layout) -- the fused block :func:`moe_quant.mxfp8_swiglu_experts_w13`
    where it serves, else two grouped GEMMs around ``chunk`` and silu (the same bits)."""
    if block_serves(x, w13, None, w2, offs, config):
        return _autograd.mxfp8_swiglu_experts_w13(x, w13, w2, offs, scale_mode=config.scale_mode,
                                                  backend=config.backend, dswiglu_cols_fp8=config.dswiglu_cols_fp8)
    return swiglu_w13_of_gemms(lambda A, W_t: grouped_mm(A, W_t, offs, config), x, w13, w2)


def moe_quant_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """:class:`moe_quant.moe.GroupedExperts`, converted."""
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    x = x.to(self.w1.dtype)
    return swiglu_experts(x, self.w1, self.w3, self.w2, offs, self._mxfp8_config)


def _local(w):
    """A DTensor weight (expert / tensor parallel) -> its local shard. ``isinstance``, not ``hasattr(w,
    "to_local")``: dynamo answers that ``hasattr`` False for a DTensor, so a compiled forward would take
    the global weight (torchtitan's EP under ``torch.compile``: all experts for this rank's offsets)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(w, DTensor):
            return w.to_local()
    return w


def torchtitan_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3.0's ``GroupedExperts``, converted: as its forward (bf16 activations, output in
    ``x``'s dtype), the three GEMMs in MXFP8; fp32 master weights are read as bf16 inside them."""
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    return swiglu_experts(x_RD.bfloat16(), w1, w3, w2, offs, self._mxfp8_config).type_as(x_RD)


def grouped_mm_seam(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The ``_grouped_mm(self, *, A, B_t, offs)`` seam of a module, converted."""
    return grouped_mm(A, B_t, offs, self._mxfp8_config)


_SEAM_PARAMETERS = [("A", inspect.Parameter.KEYWORD_ONLY), ("B_t", inspect.Parameter.KEYWORD_ONLY),
                    ("offs", inspect.Parameter.KEYWORD_ONLY)]


def is_seam(method) -> bool:
    """``method`` (a class attribute) has the seam's signature ``(self, *, A, B_t, offs)``, the one
    :func:`grouped_mm_seam` replaces it with: a method of that name and another signature is the module's own helper
    (calls of it would not bind to the converted seam)."""
    if not inspect.isfunction(method):
        return False
    params = list(inspect.signature(method).parameters.values())
    self_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(params) and params[0].kind in self_kinds and [(p.name, p.kind) for p in params[1:]] == _SEAM_PARAMETERS
