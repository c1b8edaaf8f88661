"""The colwise 32x1 quantization kernel (K-groups, and 3D weights along N): ``config``, ``kernel``, ``ops``."""
