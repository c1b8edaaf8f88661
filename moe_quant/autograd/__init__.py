from .grouped_mm import mxfp8_grouped_mm
from .swiglu_block import mxfp8_swiglu_experts, swiglu_experts_unfused

__all__ = ["mxfp8_grouped_mm", "mxfp8_swiglu_experts", "swiglu_experts_unfused"]
