"""Torch op over the byte-fingerprint kernel (``kernel.py``); the definition, the reference and the entry
point that picks kernel or reference are :mod:`moe_quant.fingerprint`. Same conventions as
:mod:`moe_quant.kernels.quantize_1x32.ops` (custom op with a fake implementation, direct call in eager mode).

The kernel reads 16-byte vectors from a 16-byte aligned address. :func:`pieces` splits a tensor's bytes so
that every launch starts on one and on a word boundary of the tensor: a tensor whose first byte is 8-byte
aligned is read in place (its first word alone through a 16-byte staging copy when it sits 8 bytes off a
16-byte boundary); any other start puts every word across an 8-byte boundary, and the bytes go through an
aligned staging buffer :data:`STAGE_BYTES` at a time (memory-bounded, one copy and one launch per piece).
"""

from __future__ import annotations

import torch

from .. import compile_cache as cc
from .config import CTAS_PER_SM, MAX_LAUNCH_BYTES, VEC, Variant

STAGE_BYTES = 1 << 26  # bytes per staged piece (a multiple of 16)


def pieces(address: int, n: int) -> list[tuple[int, int, bool]]:
    """How :func:`fingerprint_bytes` reads ``n`` bytes at ``address``: ``(start, length, staged)`` per launch,
    in order. Every ``start`` is a multiple of 8 (the piece's first word is word ``start // 8``), every piece
    but the last a whole number of words; ``staged`` pieces are copied to a 16-byte aligned buffer first,
    the others start at a 16-byte aligned address."""
    head = -address % VEC  # bytes before the first 16-byte boundary
    if head % 8:  # the words straddle 8-byte boundaries: none can be read in place
        stage = min(STAGE_BYTES, MAX_LAUNCH_BYTES)
        return [(s, min(stage, n - s), True) for s in range(0, n, stage)]
    out = [(0, min(head, n), True)] if head and n else []  # one word before the boundary (or all of a short tensor)
    return out + [(s, min(MAX_LAUNCH_BYTES, n - s), False) for s in range(head, n, MAX_LAUNCH_BYTES)]


def aligned_empty(n: int, device) -> torch.Tensor:
    """``n`` uninitialized bytes at a 16-byte aligned address."""
    raw = torch.empty(n + VEC - 1, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % VEC
    return raw[skip:skip + n]


def accumulate(b: torch.Tensor, launch) -> None:
    """``launch(piece, first_word)`` for each of :func:`pieces` of the flat uint8 tensor ``b``: ``piece`` a uint8
    tensor at a 16-byte aligned address (the staged ones copied into one reused buffer, in stream order)."""
    plan = pieces(b.data_ptr(), b.numel())
    staged = [length for _, length, st in plan if st]
    buf = aligned_empty(max(staged), b.device) if staged else None
    for start, length, st in plan:
        piece = b[start:start + length]
        if st:
            piece = buf[:length].copy_(piece)
        launch(piece, start // 8)


def _impl(b: torch.Tensor, variant: Variant, ctas_per_sm: int = CTAS_PER_SM) -> torch.Tensor:
    out = torch.zeros((), dtype=torch.int64, device=b.device)
    if b.numel():
        kernel = cc.kernel_for(("fp", variant), lambda: variant, b.device)
        ctas = ctas_per_sm * cc.sm_count(b.device)
        acc = out.view(1)
        accumulate(b, lambda piece, first_word: cc.launch(kernel, piece, acc, first_word, ctas))
    return out


@torch.library.custom_op("moe_quant::fingerprint", mutates_args=(), device_types="cuda")
def _fingerprint_op(b: torch.Tensor) -> torch.Tensor:
    return _impl(b, Variant())


@_fingerprint_op.register_fake
def _(b):
    return b.new_empty((), dtype=torch.int64)


def fingerprint_bytes(b: torch.Tensor, variant: Variant | None = None, ctas_per_sm: int = CTAS_PER_SM) -> torch.Tensor:
    """The fingerprint (:mod:`moe_quant.fingerprint`) of the flat uint8 CUDA tensor ``b`` (stride 1, any address,
    any length) as an int64 tensor of one element, by the kernel; no host synchronization. Equal to
    :func:`moe_quant.fingerprint.reference_words_sum` of ``b``. ``variant`` and ``ctas_per_sm``: A/B candidates
    (benchmarks/bench_fingerprint.py)."""
    if variant is None and ctas_per_sm == CTAS_PER_SM and cc.via_dispatcher(b):
        return torch.ops.moe_quant.fingerprint(b)
    return _impl(b, variant or Variant(), ctas_per_sm)
