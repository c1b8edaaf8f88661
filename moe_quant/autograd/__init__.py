from .grouped_mm import mxfp8_grouped_mm
from .swiglu_block import mxfp8_swiglu_experts, mxfp8_swiglu_experts_w13, swiglu_experts_unfused, swiglu_experts_w13_unfused
from . import grouped_mm_ops  # noqa: F401  (registers the compiled GEMM's ops: moe_quant::grouped_mm_*)
from . import swiglu_block_ops  # noqa: F401  (registers the compiled block's ops: moe_quant::swiglu_block_*)

__all__ = ["mxfp8_grouped_mm", "mxfp8_swiglu_experts", "mxfp8_swiglu_experts_w13", "swiglu_experts_unfused",
           "swiglu_experts_w13_unfused"]
