"""The conversion config: what ``quantize_(model, MXFP8MoEConfig(...), filter_fn)`` is told.

No kernel and no autograd import here: a config is plain data, cheap to build and compare.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .._torchao import AOBaseConfig
from ..backends import GemmBackend
from ..numerics import ScaleMode
from ..validation import check_bool

OUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class MXFP8MoEConfig(AOBaseConfig):
    """Train the matched expert modules' grouped GEMMs in MXFP8.

    Args:
        scale_mode: e8m0 scale rounding, ``"rceil"`` (default) or ``"floor"``.
        backend: GEMM backend, ``"auto"`` (``scaled`` on SM100+, else ``emulated``),
            ``"emulated"`` (dequantize + bf16 ``torch._grouped_mm``, any device) or
            ``"scaled"`` (``torch._scaled_grouped_mm``, SM100+ only).
        out_dtype: output dtype of each MXFP8 grouped GEMM: ``None`` (default: the dtype of its
            input, as the plain op), ``torch.bfloat16`` or ``torch.float32``.
        allow_fallback: when True (default) a GEMM MXFP8 cannot serve runs the plain op and is
            counted (:func:`moe_quant.fallback_counts`) and logged once; when False it raises
            ``ValueError``.
        fused_block: when True (default) the SwiGLU expert modules (moe_quant's and torchtitan's
            ``GroupedExperts``) run the fused block :func:`moe_quant.mxfp8_swiglu_experts` where it serves;
            when False, three :func:`moe_quant.mxfp8_grouped_mm` calls. The same bits either way; the fused
            block quantizes x once for w1 and w3 and fuses the SwiGLU passes, the per-GEMM path makes each
            operand's forms separately (more passes, and at its peak holds fewer transient forms).
        dswiglu_cols_fp8: the fused block's backward on the emulated GEMM (Hopper) makes the colwise forms of
            grad_a and grad_b (w1's and w3's weight-gradient operands) in fp8 and scales and dequantizes each just
            before its GEMM (True: the block's backward peak about ``2 H`` bytes a routed row lower, for two
            dequantization passes; :func:`moe_quant.mxfp8_swiglu_experts`), or in bf16 from dSwiGLU on (False,
            default: on one H200 the block's step was 2-3.5% slower with True, and torchtitan's trainer's peak,
            which is not in a block's backward, the same; docs/limitations.md). The same bits either way; no
            effect on the scaled GEMM or the per-GEMM path.

    Use it as ``quantize_(model, MXFP8MoEConfig(...), filter_fn=...)``. The handler converts each
    matched expert module in place: its class becomes a generated subclass whose forward runs the
    expert GEMMs in MXFP8 (``moe_quant/conversion/``); its parameters stay the plain
    ``nn.Parameter`` objects they were. Supported: :class:`moe_quant.moe.GroupedExperts`,
    torchtitan's ``GroupedExperts``, Hugging Face transformers' experts modules (those of the
    experts interface, and Llama4's), any module with a ``_grouped_mm(self, *, A, B_t, offs)``
    method (the seam the module's forward calls for each grouped GEMM), and any other module whose
    own forward calls ``torch._grouped_mm`` / ``F.grouped_mm`` (a subclass's own forward included;
    under ``torch.compile`` it runs behind a graph break, docs/design.md section 8.2).

    **filter_fn.** Match the routed-experts module, e.g. ``lambda mod, fqn: isinstance(mod,
    GroupedExperts)``. A matched container (a module without 3-D floating-point parameters of its
    own, e.g. torchtitan's ``RoutedExperts`` matched by ``"experts" in fqn``) converts the experts
    modules inside it; one with none (torchtitan's ``shared_experts``) is left alone, with a warning
    once per module class.

    **Calling quantize_ again re-configures**: the module keeps its parameters and takes the new
    config; an equal config is a no-op.
    """

    scale_mode: ScaleMode = ScaleMode.RCEIL
    backend: GemmBackend = GemmBackend.AUTO
    out_dtype: Optional[torch.dtype] = None
    allow_fallback: bool = True
    fused_block: bool = True
    dswiglu_cols_fp8: bool = False

    def __post_init__(self):
        object.__setattr__(self, "scale_mode", ScaleMode.parse(self.scale_mode, "scale_mode"))
        object.__setattr__(self, "backend", GemmBackend.parse(self.backend, "backend"))
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be None, torch.bfloat16 or torch.float32, got {self.out_dtype!r}")
        for name in ("allow_fallback", "fused_block", "dswiglu_cols_fp8"):
            check_bool(name, getattr(self, name))
