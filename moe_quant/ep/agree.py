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
that and every other setting of the dispatcher. The handshake message is the header followed by the
sync-free settings (:data:`HANDSHAKE_FIELDS`: capacity factor, overflow, max tokens, which every rank
must share, as they fix the sizes of every later exchange), the transport and its chunks (they fix which
messages every later exchange posts), a digest of the experts' conversion settings (:func:`digest`: where the
dispatcher knows its experts, ``compared_experts``) and this rank's token count T, from which
the sync-free mode takes its token bound (:func:`token_bound`).
"""

from __future__ import annotations

import hashlib
import struct

import torch

# problem bits of the code field
NEGATIVE, BAD_SUM, MISMATCH, BAD_ARGS = 1, 2, 4, 8
FIELDS = ("code", "hidden size", "num_experts", "top_k", "dtype", "wire", "scale mode")
SIZE = len(FIELDS)
# the one-time handshake: the header, the sync-free settings, the transport and its chunks, the experts' settings
# digest, and this rank's token count (-1: unknown)
HANDSHAKE_FIELDS = FIELDS + ("capacity factor", "overflow", "max tokens", "transport", "chunks", "experts", "tokens")

_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
_WIRES = ("mxfp8", "bf16")
_MODES = ("rceil", "floor")
_OVERFLOW = ("error", "drop")
_TRANSPORTS = ("all_to_all", "p2p")


def header(*, hidden: int, num_experts: int, top_k: int, dtype, wire, mode) -> list:
    """The settings fields of a header (code left 0), as ints."""
    dtype_id = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0
    return [0, int(hidden), int(num_experts), int(top_k), dtype_id, _WIRES.index(str(wire.value)) + 1,
            _MODES.index(str(mode.value)) + 1]


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def digest(settings: dict | None) -> int:
    """A 56-bit digest of the experts' settings (the same on every process for equal settings), 0 for None."""
    if settings is None:
        return 0
    return 1 + int.from_bytes(hashlib.blake2b(repr(list(settings.items())).encode(), digest_size=7).digest(), "little")


def handshake_row(settings: list, *, capacity_factor, overflow: str, max_tokens, tokens, transport="all_to_all",
                  chunks: int = 1, experts: int = 0) -> list:
    """The handshake message of one rank: ``settings`` (:func:`header`), then the capacity factor (its
    float64 bits, 0: synced mode), overflow, max tokens (0: none given), the transport and its chunks
    (ranks on different transports would wait for each other's messages forever), the :func:`digest` of the
    experts' settings and this rank's token count T (-1: not known yet, e.g. a handshake before the first
    dispatch)."""
    return list(settings) + [0 if capacity_factor is None else _float_bits(capacity_factor),
                             _OVERFLOW.index(overflow) + 1, 0 if max_tokens is None else int(max_tokens),
                             _TRANSPORTS.index(str(getattr(transport, "value", transport))) + 1, int(chunks),
                             int(experts), -1 if tokens is None else int(tokens)]


def token_bound(rows: list) -> int | None:
    """The token bound the sync-free mode fixes from a handshake's rows (every rank computes the same):
    the explicit max tokens where given, else the largest T of the ranks; None where some rank did not
    know its T yet or every rank had T = 0 (nothing to fix it from)."""
    max_tokens = rows[0][HANDSHAKE_FIELDS.index("max tokens")]
    if max_tokens > 0:
        return max_tokens
    tokens = [row[HANDSHAKE_FIELDS.index("tokens")] for row in rows]
    return max(tokens) if min(tokens) >= 0 and max(tokens) > 0 else None


def _show(field: str, value: int):
    if field == "dtype":
        return str(_DTYPES[value - 1]) if 0 < value <= len(_DTYPES) else "unsupported"
    if field == "wire":
        return repr(_WIRES[value - 1])
    if field == "scale mode":
        return repr(_MODES[value - 1])
    if field == "capacity factor":
        return "None (synced mode)" if value == 0 else struct.unpack("<d", struct.pack("<q", value))[0]
    if field == "overflow":
        return repr(_OVERFLOW[value - 1])
    if field == "transport":
        return repr(_TRANSPORTS[value - 1])
    if field == "max tokens":
        return None if value == 0 else value
    return value


def problems(bits: int) -> list:
    return [what for bit, what in ((NEGATIVE, "a negative count"), (BAD_SUM, "counts that do not sum to the "
            "number of routed rows (T * top_k)"), (MISMATCH, "counts that do not match topk_expert_ids_TK "
            "(or ids outside [0, num_experts))")) if bits & bit]


def diagnose(headers: list, *, fields: tuple = FIELDS, skip: tuple = ()) -> str | None:
    """``headers[r]``: rank r's header (``fields``: its layout, :data:`FIELDS` or :data:`HANDSHAKE_FIELDS`).
    The message every rank raises, or None when all agree and none reported a problem. Disagreement on a
    setting comes first (it explains any other problem)."""
    for i, field in enumerate(fields[1:], start=1):
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


__all__ = ["header", "digest", "handshake_row", "token_bound", "diagnose", "problems", "FIELDS", "HANDSHAKE_FIELDS", "SIZE",
           "NEGATIVE", "BAD_SUM", "MISMATCH", "BAD_ARGS"]
