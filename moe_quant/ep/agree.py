"""What every EP rank sends with its token counts, so that ranks which disagree all raise the same error.

Each rank's counts message carries a header: a problem code (bits below) and the call's settings
(hidden size, num_experts, top_k, activation dtype, wire, scale mode). Every rank sends the same header
to every peer, so after the counts exchange every rank holds every rank's header and
:func:`diagnose` returns the same message on all of them: the first setting on which ranks differ
(naming the ranks and their values), or the ranks whose own arguments were invalid. A rank whose
arguments are invalid still takes part in the exchange (with zero counts and a problem bit), then
raises its own error; no rank sends or returns token data.

``num_experts`` fixes the size of the counts message, so ranks that disagree on it cannot share the
counts exchange itself: :class:`moe_quant.ep.MXFP8TokenDispatcher` runs a fixed-size
:func:`header` exchange once per process group before its first dispatch (a handshake), which catches
that and every other setting of the dispatcher.
"""

from __future__ import annotations

import torch

# problem bits of the code field
NEGATIVE, BAD_SUM, MISMATCH, BAD_ARGS = 1, 2, 4, 8
FIELDS = ("code", "hidden size", "num_experts", "top_k", "dtype", "wire", "scale mode")
SIZE = len(FIELDS)

_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
_WIRES = ("mxfp8", "bf16")
_MODES = ("rceil", "floor")


def header(*, hidden: int, num_experts: int, top_k: int, dtype, wire, mode) -> list:
    """The settings fields of a header (code left 0), as ints."""
    dtype_id = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0
    return [0, int(hidden), int(num_experts), int(top_k), dtype_id, _WIRES.index(str(wire.value)) + 1,
            _MODES.index(str(mode.value)) + 1]


def _show(field: str, value: int):
    if field == "dtype":
        return str(_DTYPES[value - 1]) if 0 < value <= len(_DTYPES) else "unsupported"
    if field == "wire":
        return repr(_WIRES[value - 1])
    if field == "scale mode":
        return repr(_MODES[value - 1])
    return value


def problems(bits: int) -> list:
    return [what for bit, what in ((NEGATIVE, "a negative count"), (BAD_SUM, "counts that do not sum to the "
            "number of routed rows (T * top_k)"), (MISMATCH, "counts that do not match topk_expert_ids_TK "
            "(or ids outside [0, num_experts))")) if bits & bit]


def diagnose(headers: list, *, skip: tuple = ()) -> str | None:
    """``headers[r]``: rank r's header. The message every rank raises, or None when all agree and none
    reported a problem. Disagreement on a setting comes first (it explains any other problem)."""
    for i, field in enumerate(FIELDS[1:], start=1):
        if field in skip:
            continue
        values = [h[i] for h in headers]
        if len(set(values)) > 1:
            groups = {}
            for r, val in enumerate(values):
                groups.setdefault(val, []).append(r)
            parts = "; ".join(f"rank(s) {ranks}: {_show(field, val)}" for val, ranks in groups.items())
            return (f"EP ranks disagree on {field} ({parts}); every rank of the EP group must call dispatch "
                    f"with the same {field}. No tokens were exchanged")
    bad_args = [r for r, h in enumerate(headers) if h[0] & BAD_ARGS]
    if bad_args:
        return (f"dispatch arguments are invalid on rank(s) {bad_args} of the EP group (see the error raised "
                f"there); no tokens were exchanged")
    return None


__all__ = ["header", "diagnose", "problems", "FIELDS", "SIZE", "NEGATIVE", "BAD_SUM", "MISMATCH", "BAD_ARGS"]
