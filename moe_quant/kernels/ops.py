"""The public torch ops of the quantization kernels, in one namespace (each family's ops live in its
``<family>/ops.py``; the compile cache and launch path in :mod:`moe_quant.kernels.compile_cache`)."""

from .compile_cache import STATS, cache_dir, get_kernel  # noqa: F401
from .quantize_1x32.ops import (  # noqa: F401
    SCALE_LAYOUTS,
    fake_quantize_1x32,
    fake_quantize_3d_along_k,
    quantize_1x32,
    quantize_3d_along_k,
    run_3d_along_k,
    run_fake_3d_along_k,
    run_fake_quantize_1x32,
    run_quantize_1x32,
)
from .quantize_32x1.ops import (  # noqa: F401
    fake_quantize_3d_along_n,
    fake_quantize_32x1_k_groups,
    quantize_3d_along_n,
    quantize_32x1_k_groups,
    run_3d_along_n,
    run_fake_3d_along_n,
    run_fake_quantize_32x1_k_groups,
    run_quantize_32x1_k_groups,
)
