"""Expert parallelism with MXFP8 on the wire.

:func:`permute_received` reorders the rows an all-to-all delivered, in (source rank, local expert)
order, to the expert-major order the grouped GEMM takes (:mod:`moe_quant.ep.permute`).
"""

from .permute import permute_received

__all__ = ["permute_received"]
