"""The rowwise 1x32 quantization kernel (M-groups, and 3D weights along K): ``config``, ``kernel``, ``ops``."""
