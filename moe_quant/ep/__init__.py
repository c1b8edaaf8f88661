"""Expert parallelism with MXFP8 on the wire.

* :class:`MXFP8TokenDispatcher` (:mod:`moe_quant.ep.dispatcher`): torchtitan-shaped ``dispatch`` /
  ``combine`` over a ``torch.distributed`` process group; :class:`moe_quant.moe.EPMoE` uses it.
* :func:`dispatch_rows` / :func:`combine_rows` / :func:`plan_route` (:mod:`moe_quant.ep.legs`): the four
  differentiable all-to-all legs (MXFP8 dispatch forward and combine backward, exact others).
* :func:`permute_received` (:mod:`moe_quant.ep.permute`): received rows, in (source rank, local expert)
  order, to the expert-major order the grouped GEMM takes.
* :class:`WireLog` (:mod:`moe_quant.ep.wire`): the bytes each leg hands to ``all_to_all_single``.
* :mod:`moe_quant.ep.agree`: the settings every rank sends with its counts (ranks that disagree all raise).
* :mod:`moe_quant.ep.capacity`: the sync-free mode (fixed capacity, static sizes, no host read).
* :mod:`moe_quant.ep.blocks`: the point-to-point transport (``transport="p2p"``: each (rank, expert) block
  sent straight into the order it is used in, no permutation passes).
* :mod:`moe_quant.ep.pipeline`: the experts run range by range while the other ranges travel (``chunks``).
* :mod:`moe_quant.ep.titan`: torchtitan components (the dispatcher's ``Config``, a model converter);
  imports torchtitan only when used (its classes: :mod:`moe_quant.ep.titan_classes`).
"""

from .dispatcher import EPDispatchMetadata, MXFP8TokenDispatcher
from .legs import Route, Wire, combine_rows, dispatch_rows, plan_route
from .permute import permute_received
from .wire import WireLog, mxfp8_row_bytes

__all__ = [
    "EPDispatchMetadata",
    "MXFP8TokenDispatcher",
    "Route",
    "Wire",
    "WireLog",
    "combine_rows",
    "dispatch_rows",
    "mxfp8_row_bytes",
    "permute_received",
    "plan_route",
]
