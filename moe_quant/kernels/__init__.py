"""CuTe-DSL quantization kernels (import ``moe_quant.kernels.ops`` for the torch ops)."""
