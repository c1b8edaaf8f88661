"""Converted weights under ``torch.func`` transforms (``grad``, ``vmap``, ``functional_call``).

Inside a transform, PyTorch wraps tensors in its own wrappers (``grad``'s tracking tensors,
``vmap``'s batched tensors). A wrapper around an :class:`~moe_quant.conversion.MXFP8ExpertWeight`
is a plain ``torch.Tensor`` to Python: the weight's ``__torch_function__`` is not consulted, and a
grouped-mm call reaches the weight only below the transform's autograd, which has already recorded
the bf16 derivative. That happens to every weight a transform touches: the parameters given to
``torch.func.functional_call`` under ``grad``, and any view (``w.transpose(-2, -1)``) of a weight
taken inside ``grad``.

So each module with converted parameters gets a forward pre-hook that, only while a transform is
active (and never under ``torch.compile``), enters :class:`_ConvertedGroupedMM` for the module's
forward: a torch-function mode that sends grouped-mm calls whose operand is a converted weight
under transform wrappers to the MXFP8 path. The MXFP8 autograd functions have ``torch.func``
rules, so the transform differentiates (and batches) the MXFP8 GEMMs themselves.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_functorch = torch._C._functorch


def under_transforms(t):
    """``t`` without its ``torch.func`` wrappers (every ``grad`` / ``vmap`` level); ``t`` itself if none."""
    while isinstance(t, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


class _ConvertedGroupedMM(TorchFunctionMode):
    """Grouped-mm calls on converted weights (wrapped by ``torch.func`` or not) run MXFP8."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from . import conversion  # conversion imports this module

        kwargs = kwargs or {}
        if func in conversion._GROUPED_MM_FUNCS:
            mat_a, mat_b = conversion._bind(args, kwargs)[:2]
            if conversion._converted(mat_a) is not None or conversion._converted(mat_b) is not None:
                return conversion._grouped_mm(func, args, kwargs)
        return func(*args, **kwargs)


def enter_mode_pre_hook(module, args) -> None:
    """Forward pre-hook of a module with converted parameters (see the module doc)."""
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return
    mode = _ConvertedGroupedMM()
    mode.__enter__()
    module.__dict__.setdefault("_mxfp8_func_modes", []).append(mode)


def exit_mode_hook(module, args, output) -> None:
    """Forward hook (``always_call=True``): leaves the mode ``enter_mode_pre_hook`` entered, if any."""
    if torch.compiler.is_compiling():
        return
    modes = module.__dict__.get("_mxfp8_func_modes")
    if modes:
        modes.pop().__exit__(None, None, None)
