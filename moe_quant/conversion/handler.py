"""The torchao ``quantize_`` handler: :func:`convert` a matched expert module in place, :func:`unconvert` it.

Converting makes the module's own class its converted subclass (:mod:`.classes`), under any class PyTorch
layered over it (:mod:`.layers`: a parametrization, FSDP2), and stores the config on the module
(``module._mxfp8_config``). Nothing else changes: the parameters stay the same ``nn.Parameter`` objects (a
parameter tied between modules stays tied, an optimizer built before keeps training it, weak references to
it stay valid), and so do ``state_dict`` keys and values.

A matched module without 3-D floating-point parameters of its own is a container: the experts modules inside
it are converted (torchtitan's ``RoutedExperts`` around its ``GroupedExperts``, matched by a name filter such
as ``"experts" in fqn``); a container with none (torchtitan's ``shared_experts``) is left alone with a warning.

Experts written as an ``nn.ModuleList`` / ``nn.ModuleDict`` of per-expert modules (each an ``nn.Linear``, or a
module whose parameters all belong to ``nn.Linear`` layers, such as a SwiGLU MLP) convert Linear by Linear
(:mod:`.linear`). A Linear converts only where the user matched it: matched itself, or inside such a list that was
matched or lies inside a matched container. A dense Linear elsewhere (a router, attention, a shared expert outside
the list) does not; ``quantize_`` without a ``filter_fn`` (torchao's default filter, every ``nn.Linear``) raises.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from torch import nn

from . import layers, ranks
from .._torchao import default_filter_match, register_quantize_module_handler
from .classes import base_class, converted_class, is_converted
from .config import MXFP8MoEConfig
from .hf import restore_experts_implementation
from .own_forward import own_parameters

logger = logging.getLogger("moe_quant.conversion")


def _own_expert_weights(module: nn.Module) -> bool:
    """3-D floating-point parameters of the module itself (or of its ``ParameterList`` / ``ParameterDict``)."""
    return any(p.ndim == 3 and p.is_floating_point() for p in own_parameters(module))


def _linear_only(module: nn.Module) -> bool:
    """``module`` is an ``nn.Linear``, or holds some and every parameter of it belongs to one of them."""
    if isinstance(module, nn.Linear):
        return True
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    in_linears = {id(p) for m in linears for p in m.parameters()}
    return bool(linears) and all(id(p) in in_linears for p in module.parameters())


def per_expert_list(module: nn.Module) -> bool:
    """``module`` is experts as a list of per-expert modules: a non-empty ``nn.ModuleList`` / ``nn.ModuleDict`` whose
    every item is an ``nn.Linear`` or a module whose parameters all belong to ``nn.Linear`` layers."""
    return (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0
            and all(_linear_only(m) for m in module.children()))


def _experts_modules(module: nn.Module, matched: bool = True) -> list:
    """The outermost modules under ``module`` (itself included) that hold expert weights, or are converted; the
    Linear layers of a per-expert list; ``module`` itself if it is the ``nn.Linear`` the user matched."""
    if is_converted(module) or _own_expert_weights(module) or (matched and isinstance(module, nn.Linear)):
        return [module]
    if per_expert_list(module):
        return [m for m in module.modules() if isinstance(m, nn.Linear)]
    return [m for child in module.children() for m in _experts_modules(child, matched=False)]


def experts_candidates(model: nn.Module) -> list:
    """``(fqn, module)`` of the modules of ``model`` a match would convert: those holding stacked expert weights
    (3-D floating-point parameters of their own, PyTorch's own layers left out) and the per-expert lists."""
    return [(fqn, m) for fqn, m in model.named_modules()
            if (_own_expert_weights(m) and not type(m).__module__.startswith("torch.nn.")) or per_expert_list(m)]


def convert(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    """Convert ``module`` (an expert module, or a container of expert modules) in place and return it; see
    :class:`MXFP8MoEConfig`.

    A module already converted takes ``config`` (re-configuration). A container converts the expert modules
    inside it (the outermost modules with 3-D floating-point parameters of their own); one without any is left
    alone with a warning (once per class). A module class conversion cannot convert raises ``TypeError``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"config must be an MXFP8MoEConfig, got {type(config).__name__}")
    if parameter_name is not None:
        raise ValueError(
            f"MXFP8MoEConfig converts whole expert modules, not single parameters (parameter_name="
            f"{parameter_name!r}): match the experts module itself (its fqn or an isinstance filter)"
        )
    targets = _experts_modules(module)
    if not targets:
        _warn_nothing_converted(module)
        return module
    for m in targets:
        if not is_converted(m) and "forward" in m.__dict__:  # accelerate's hooks: it runs, not the class's forward
            raise TypeError(f"cannot convert {type(m).__name__}: the module has an instance attribute 'forward' "
                            f"(a hook library's wrapper?), which runs instead of its class's forward, so conversion "
                            f"would change nothing; convert before wrapping the module's forward")
    own = {m: layers.split(type(m)) for m in targets}
    classes = {m: converted_class(o) for m, (_, o) in own.items()}  # every TypeError before any module changes
    for m in targets:
        if is_converted(m):
            if m._mxfp8_config != config:
                logger.info("re-configured %s: %s -> %s", base_class(m).__name__, m._mxfp8_config, config)
                m._mxfp8_config = config
            continue
        m.__class__ = layers.rebuild(own[m][0], classes[m])
        m._mxfp8_config = config
        logger.info("converted %s to MXFP8 (%s)", own[m][1].__name__, config)
    return module


def unconvert(module: nn.Module) -> nn.Module:
    """Undo the conversion of ``module`` and of its submodules in place; returns ``module``. The parameters
    are untouched (ties, optimizers and weak references keep working); classes PyTorch layered over a
    converted module stay. A transformers model running the ``"moe_quant_mxfp8"`` experts implementation gets
    transformers' default one back."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    restore_experts_implementation(module)  # first: it may refuse
    for mod in module.modules():
        above, own = layers.split(type(mod))
        base = own.__dict__.get("_mxfp8_base")
        if base is not None:
            mod.__class__ = layers.rebuild(above, base)
            mod.__dict__.pop("_mxfp8_config", None)
            mod.__dict__.pop(ranks.EXTRA, None)
    return module


# module classes already warned about: a filter such as ``"experts" in fqn`` matches torchtitan's
# ``shared_experts`` (a FeedForward) in every layer; one warning per class says it all.
_WARNED_NOTHING_CONVERTED: set = set()


def _warn_nothing_converted(module: nn.Module) -> None:
    cls = type(module)
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _WARNED_NOTHING_CONVERTED:
        logger.debug("MXFP8MoEConfig matched %s; nothing converted", key)
        return
    _WARNED_NOTHING_CONVERTED.add(key)
    logger.warning(
        "MXFP8MoEConfig matched %s, which holds no 3-D floating-point parameter (stacked expert "
        "weights) and no per-expert list (nn.ModuleList of nn.Linear experts or of MLPs made of them), itself or in "
        "a submodule; nothing converted. Check quantize_'s filter_fn: a name filter "
        "such as '\"experts\" in fqn' also matches shared experts; an isinstance filter "
        "(lambda mod, fqn: isinstance(mod, GroupedExperts)) matches only the routed experts. "
        "(Logged once per module class.)",
        cls.__name__,
    )


@register_quantize_module_handler(MXFP8MoEConfig)
def _mxfp8_moe_transform(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    fqn = default_filter_match(sys._getframe(1))
    if fqn is not None:  # before any module changes: the first match raises
        raise ValueError(
            f"quantize_(model, MXFP8MoEConfig()) without filter_fn: torchao's default filter matches every nn.Linear "
            f"(here {fqn or '<model>'!r}), and MXFP8MoEConfig converts only the experts you name. Pass filter_fn, e.g. "
            f"filter_fn=lambda mod, fqn: isinstance(mod, MyExperts) for your experts class, or "
            f"moe_quant.convert(model, filter_fn=...), which also says what it converted; per-expert nn.Linear "
            f"experts: match their container, e.g. filter_fn=lambda mod, fqn: fqn.endswith('.experts') "
            f"(docs/own_moe.md)")
    return convert(module, config, parameter_name)
