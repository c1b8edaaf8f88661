"""The SwiGLU expert block's fused quantization kernel: ``config``, ``kernel``, ``ops``."""
