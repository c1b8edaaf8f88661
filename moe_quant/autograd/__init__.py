from .grouped_mm import mxfp8_grouped_mm
from .swiglu_block import mxfp8_swiglu_experts, mxfp8_swiglu_experts_w13, swiglu_experts_unfused, swiglu_experts_w13_unfused

__all__ = ["mxfp8_grouped_mm", "mxfp8_swiglu_experts", "mxfp8_swiglu_experts_w13", "swiglu_experts_unfused",
           "swiglu_experts_w13_unfused"]
