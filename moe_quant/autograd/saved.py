"""Freeing an autograd Function's saved tensors as soon as its backward has read them for the last time.

Autograd holds what ``ctx.save_for_backward`` saved until the Function's backward returns, so a backward that
runs several GEMMs keeps every saved activation alive to its end, even those it is done with halfway (the
SwiGLU block's ``a`` and ``b``, read only by its dSwiGLU pass; a grouped GEMM's input ``A``, read only by its weight
gradient's first pass). :func:`free_saved` lets autograd drop its
reference once the backward has unpacked them (``ctx.saved_tensors``), through PyTorch's own saved-tensor hooks
(``SavedTensor.register_hooks``: the saved value is handed to a pack hook that keeps nothing), so that the memory
goes when the backward drops its own reference after the last read (its ``del``, or a list it empties).

Only where nothing could read them again: an eager backward (not traced by ``torch.compile`` or compiled
autograd, where the compiled backward frees its inputs after their last use itself) of a graph that is not
kept (``retain_graph`` / ``create_graph`` off: PyTorch's ``_get_current_graph_task_keep_graph``, which
``torch.utils.checkpoint`` consults alike), outside ``torch.func`` transforms (their saved tensors left to functorch,
whose levels wrap them). A tensor that saved-tensor hooks of the user's already hold
(``torch.utils.checkpoint``, ``torch.autograd.graph.save_on_cpu``) stays theirs: the copy the backward unpacked is
its own, freed by the caller's ``del`` anyway.
"""

from __future__ import annotations

import torch

_FREED = ("a saved tensor of moe_quant's SwiGLU expert block or MXFP8 grouped GEMM was freed after its backward read "
          "it (the graph was not retained): run backward with retain_graph=True to backpropagate through it twice")


def _keep_nothing(tensor: torch.Tensor) -> None:
    return None


def _freed(packed) -> torch.Tensor:
    raise RuntimeError(_FREED)


def free_saved(ctx, indices) -> None:
    """Let autograd drop the saved tensors at ``indices`` of ``ctx.save_for_backward``'s arguments now (see the
    module doc); a no-op where they may be read again or are not autograd's to drop."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._autograd._get_current_graph_task_keep_graph()):
        return
    raw = ctx._raw_saved_tensors
    for i in indices:
        try:
            raw[i].register_hooks(_keep_nothing, _freed)
        except RuntimeError:  # None saved, or the user's saved-tensor hooks hold it (theirs to free)
            pass


__all__ = ["free_saved"]
