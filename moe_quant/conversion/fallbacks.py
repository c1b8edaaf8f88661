"""Fallback accounting: expert GEMMs of converted modules that MXFP8 could not serve.

Each such GEMM runs the plain op, is counted here by reason and logged once per reason
(``logging.WARNING``), or raises ``ValueError`` when the module's config says
``allow_fallback=False``.
"""

from __future__ import annotations

import collections
import logging

import torch

logger = logging.getLogger("moe_quant.conversion")

_FALLBACKS: collections.Counter = collections.Counter()


def fallback_counts() -> dict[str, int]:
    """GEMMs of converted modules that ran the plain op, by reason.

    Eager calls are counted one by one; under ``torch.compile`` the count grows while the graph is
    traced (once per tracing pass), not on each call of the compiled graph.
    """
    return dict(_FALLBACKS)


def reset_fallback_counts() -> None:
    _FALLBACKS.clear()


@torch._dynamo.assume_constant_result
def _note(reason: str) -> bool:
    # Runs in Python even while dynamo traces (once per trace), so it never breaks a graph.
    if reason not in _FALLBACKS:
        logger.warning("mxfp8 grouped_mm fallback to the plain op: %s (logged once per reason)", reason)
    _FALLBACKS[reason] += 1
    return True


def fallback(reason: str, allow_fallback: bool) -> None:
    """Count ``reason`` (the plain op runs next), or raise when fallbacks are not allowed."""
    if not allow_fallback:
        raise ValueError(f"MXFP8 grouped_mm cannot serve this call ({reason}) and allow_fallback=False")
    _note(reason)
