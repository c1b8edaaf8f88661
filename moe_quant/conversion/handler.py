"""The torchao ``quantize_`` handler: :func:`convert` a matched expert module in place, :func:`unconvert` it.

Converting sets the module's class to its converted subclass (:mod:`.classes`) and stores the config
on the module (``module._mxfp8_config``). Nothing else changes: the parameters stay the same
``nn.Parameter`` objects (a parameter tied between modules stays tied, an optimizer built before
keeps training it, weak references to it stay valid), and so do ``state_dict`` keys and values.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from .._torchao import register_quantize_module_handler
from .classes import base_class, converted_class, is_converted
from .config import MXFP8MoEConfig

logger = logging.getLogger("moe_quant.conversion")


def _has_expert_weights(module: nn.Module) -> bool:
    return any(p.ndim == 3 and p.is_floating_point() for p in module.parameters())


def convert(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    """Convert ``module`` (an expert module) in place and return it; see :class:`MXFP8MoEConfig`.

    A module already converted takes ``config`` (re-configuration). A module without 3-D
    floating-point parameters is left alone with a warning (once per class); a module class
    conversion does not know raises ``TypeError``.
    """
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"config must be an MXFP8MoEConfig, got {type(config).__name__}")
    if parameter_name is not None:
        raise ValueError(
            f"MXFP8MoEConfig converts whole expert modules, not single parameters (parameter_name="
            f"{parameter_name!r}): match the experts module itself (its fqn or an isinstance filter)"
        )
    if is_converted(module):
        if module._mxfp8_config != config:
            logger.info("re-configured %s: %s -> %s", base_class(module).__name__, module._mxfp8_config, config)
            module._mxfp8_config = config
        return module
    if not _has_expert_weights(module):
        _warn_nothing_converted(module)
        return module
    module.__class__ = converted_class(type(module))
    module._mxfp8_config = config
    logger.info("converted %s to MXFP8 (%s)", type(module).__mro__[1].__name__, config)
    return module


def unconvert(module: nn.Module) -> nn.Module:
    """Undo the conversion of ``module`` and of its submodules in place; returns ``module``. The
    parameters are untouched (ties, optimizers and weak references keep working)."""
    for mod in module.modules():
        if is_converted(mod):
            mod.__class__ = base_class(mod)
            mod.__dict__.pop("_mxfp8_config", None)
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
        "MXFP8MoEConfig matched %s, which has no 3-D floating-point parameter (stacked expert "
        "weights); nothing converted. Check quantize_'s filter_fn: a name filter such as "
        "'\"experts\" in fqn' also matches shared experts; an isinstance filter "
        "(lambda mod, fqn: isinstance(mod, GroupedExperts)) matches only the routed experts. "
        "(Logged once per module class.)",
        cls.__name__,
    )


@register_quantize_module_handler(MXFP8MoEConfig)
def _mxfp8_moe_transform(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    return convert(module, config, parameter_name)
