"""moe_quant: MXFP8 training for the routed experts of Mixture-of-Experts models.

Public API:

* :func:`mxfp8_grouped_mm` -- differentiable MXFP8 drop-in for ``torch._grouped_mm``.
* :func:`mxfp8_swiglu_experts` -- a whole SwiGLU expert block (three grouped GEMMs) in MXFP8 with fused
  quantization passes; :func:`swiglu_experts_unfused` is the same block through three
  :func:`mxfp8_grouped_mm` calls (equal bit for bit). :func:`mxfp8_swiglu_experts_w13` is the block with
  the gate and up weights concatenated (transformers' ``gate_up_proj``), equal to
  :func:`swiglu_experts_w13_unfused`.
* :func:`to_mxfp8` / :func:`from_mxfp8` -- quantize / dequantize along the last dim.
* Scale layouts (docs/design.md section 3): :func:`to_blocked`, :func:`from_blocked`,
  :func:`to_blocked_m_groups`, :func:`from_blocked_m_groups`, :func:`to_blocked_k_groups`,
  :func:`from_blocked_k_groups`, :func:`to_blocked_3d`, :func:`from_blocked_3d`.
* Operand quantizers for the three GEMMs: :func:`quantize_rowwise`,
  :func:`quantize_colwise_k_groups`, :func:`quantize_3d` (kernels where available).
* Reuse of quantized weights across the micro-batches of one optimizer step:
  :func:`reuse_quantized_weights` (:mod:`moe_quant.reuse`).
* Model conversion (:mod:`moe_quant.conversion`): :func:`convert` (``convert(model, config, filter_fn=...)``:
  converts the matched experts modules through torchao's ``quantize_``, returns them by name, raises when none
  converted), :class:`MXFP8MoEConfig` for torchao's ``quantize_``, :func:`unconvert`, :func:`fallback_counts`, :func:`register_experts_implementation` (transformers'
  experts interface); a reference MoE block in :mod:`moe_quant.moe`.
"""

from .autograd import (
    mxfp8_grouped_mm,
    mxfp8_swiglu_experts,
    mxfp8_swiglu_experts_w13,
    swiglu_experts_unfused,
    swiglu_experts_w13_unfused,
)
from .backends import GemmBackend
from .conversion import (
    MXFP8MoEConfig,
    fallback_counts,
    register_experts_implementation,
    reset_fallback_counts,
    unconvert,
)
from .conversion.model import convert
from .layouts import (
    blocked_offset,
    from_blocked,
    from_blocked_3d,
    from_blocked_k_groups,
    from_blocked_m_groups,
    padded_group_offsets,
    to_blocked,
    to_blocked_3d,
    to_blocked_k_groups,
    to_blocked_m_groups,
)
from .numerics import BLOCK_SIZE, ScaleMode
from .quantize import (
    fake_quantize_rowwise,
    quantize_3d,
    quantize_colwise_k_groups,
    quantize_rowwise,
)
from .reference import from_mxfp8, to_mxfp8
from .reuse import reuse_quantized_weights

from .conversion import hf as _hf

# "moe_quant_mxfp8" in transformers' experts interface: now if transformers is imported, else when it is (an import
# hook; transformers is not imported here)
_hf.register_when_imported()

__all__ = [
    "BLOCK_SIZE",
    "GemmBackend",
    "MXFP8MoEConfig",
    "convert",
    "fallback_counts",
    "register_experts_implementation",
    "reset_fallback_counts",
    "reuse_quantized_weights",
    "unconvert",
    "ScaleMode",
    "blocked_offset",
    "fake_quantize_rowwise",
    "from_blocked",
    "from_blocked_3d",
    "from_blocked_k_groups",
    "from_blocked_m_groups",
    "from_mxfp8",
    "mxfp8_grouped_mm",
    "mxfp8_swiglu_experts",
    "mxfp8_swiglu_experts_w13",
    "padded_group_offsets",
    "quantize_3d",
    "quantize_colwise_k_groups",
    "quantize_rowwise",
    "to_blocked",
    "to_blocked_3d",
    "to_blocked_k_groups",
    "to_blocked_m_groups",
    "swiglu_experts_unfused",
    "swiglu_experts_w13_unfused",
    "to_mxfp8",
]
