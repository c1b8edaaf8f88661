"""``moe_quant.convert(model, config, filter_fn=...)``: convert a model's routed experts and say what converted.

torchao's ``quantize_`` says nothing when its filter matches nothing, or matches only modules that hold no experts:
the model then trains in bf16. :func:`convert` runs ``quantize_`` with the user's filter, returns the modules it
converted by name, and raises ``ValueError`` when there are none, naming what the filter matched and the modules
that hold experts. ``quantize_`` itself stays usable; its handler is :func:`moe_quant.conversion.handler.convert`.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .._torchao import quantize_
from .classes import SUPPORTED, is_converted
from .config import MXFP8MoEConfig
from .handler import experts_candidates, per_expert_list

_SHOWN = 4  # modules named in an error message


def convert(model: nn.Module, config: Optional[MXFP8MoEConfig] = None, *,
            filter_fn: Callable[[nn.Module, str], bool]) -> dict[str, nn.Module]:
    """Convert the experts modules of ``model`` that ``filter_fn(module, fqn)`` matches, in place, through torchao's
    ``quantize_``; returns the converted modules by fully qualified name (``""`` for ``model`` itself), in
    ``model.named_modules()`` order.

    ``config``: an :class:`MXFP8MoEConfig` (default: ``MXFP8MoEConfig()``). ``filter_fn`` is ``quantize_``'s: match
    the routed-experts module (``lambda mod, fqn: isinstance(mod, MyExperts)``), a container of them (its experts
    modules convert), or per-expert ``nn.Linear`` layers (docs/own_moe.md). Modules converted already take
    ``config`` and are returned too.

    Raises ``ValueError`` when nothing converted: the filter matched no module, or only modules holding no experts
    (the message names them, and the modules of ``model`` that hold experts); ``TypeError`` for bad arguments or a
    matched module conversion cannot convert (before any module changes).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    config = MXFP8MoEConfig() if config is None else config
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"config must be an MXFP8MoEConfig or None, got {type(config).__name__}")
    if not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable (module, fqn) -> bool, got {type(filter_fn).__name__}")
    matched: list[tuple[str, nn.Module]] = []

    def recording_filter(module: nn.Module, fqn: str) -> bool:
        hit = filter_fn(module, fqn)
        if hit:
            matched.append((fqn, module))
        return hit

    quantize_(model, config, filter_fn=recording_filter)
    converted = {name: m for fqn, mod in matched for name, m in mod.named_modules(prefix=fqn) if is_converted(m)}
    if not converted:
        raise ValueError(_nothing_converted(model, matched))
    order = {m: i for i, m in enumerate(model.modules())}
    return dict(sorted(converted.items(), key=lambda item: order[item[1]]))


def _names(pairs) -> str:
    shown = [f"{fqn or '<model>'!r} ({type(m).__name__})" for fqn, m in pairs[:_SHOWN]]
    return ", ".join(shown) + (f" and {len(pairs) - _SHOWN} more" if len(pairs) > _SHOWN else "")


def _nothing_converted(model: nn.Module, matched: list) -> str:
    if matched:
        what = f"filter_fn matched {_names(matched)}, holding no experts module moe_quant converts"
    else:
        what = "filter_fn matched no module"
    candidates = experts_candidates(model)
    if candidates:
        fqn, first = candidates[0]
        example = (f"fqn.split('.')[-1] == {fqn.split('.')[-1]!r}" if per_expert_list(first)  # a ModuleList
                   else f"isinstance(mod, {type(first).__name__})")
        hint = (f"Modules of the model that hold experts: {_names(candidates)}; match one, e.g. "
                f"filter_fn=lambda mod, fqn: {example}")
    else:
        hint = f"No module of the model holds experts moe_quant converts; supported are {SUPPORTED}"
    return f"moe_quant.convert: nothing converted, the model still runs its experts unconverted: {what}. {hint}."
