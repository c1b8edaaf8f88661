"""What the expert-parallel all-to-alls send, and how many bytes.

Every leg sends rows as raw bytes (``uint8``), which every backend moves (gloo has no float8 or, on
some builds, bfloat16). An MXFP8 row is packed as its K e4m3 bytes followed by its K/32 e8m0 scale
bytes: one buffer of ``K + K/32`` bytes per token, one ``all_to_all_single`` per leg. A
:class:`WireLog` records the bytes of every tensor handed to ``all_to_all_single`` in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import torch
import torch.distributed as dist

from ..numerics import BLOCK_SIZE

_E4M3 = torch.float8_e4m3fn


def mxfp8_row_bytes(hidden: int) -> int:
    """Bytes of one token of ``hidden`` elements in MXFP8 on the wire: data plus one scale byte per 32."""
    return hidden + hidden // BLOCK_SIZE


def pack_mxfp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data (M, K)`` e4m3 and plain ``scales (M, K/32)`` -> one ``(M, K + K/32)`` uint8 buffer."""
    return torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def unpack_mxfp8(buf: torch.Tensor, hidden: int):
    """Inverse of :func:`pack_mxfp8`: ``(data (M, K) e4m3, scales (M, K/32) uint8)``, views of ``buf``."""
    return buf[:, :hidden].view(_E4M3), buf[:, hidden:]


@dataclasses.dataclass
class WireRecord:
    leg: str  # "dispatch", "dispatch backward", "combine", "combine backward", "counts"
    rows: int  # rows this rank handed to all_to_all_single
    bytes: int  # bytes of that tensor

    @property
    def bytes_per_row(self) -> float:
        return self.bytes / self.rows if self.rows else 0.0


class WireLog(contextlib.AbstractContextManager):
    """Records every all-to-all of the EP legs in this process while active (``with WireLog() as log``)."""

    _active = threading.local()

    def __init__(self):
        self.records: list[WireRecord] = []

    def __enter__(self):
        self._prev = getattr(WireLog._active, "log", None)
        WireLog._active.log = self
        return self

    def __exit__(self, *exc):
        WireLog._active.log = self._prev
        return False

    def by_leg(self, leg: str) -> tuple[int, int]:
        """``(rows, bytes)`` summed over the records of ``leg``."""
        recs = [r for r in self.records if r.leg == leg]
        return sum(r.rows for r in recs), sum(r.bytes for r in recs)

    @classmethod
    def _record(cls, leg: str, t: torch.Tensor) -> None:
        log = getattr(cls._active, "log", None)
        if log is not None:
            log.records.append(WireRecord(leg, t.shape[0], t.numel() * t.element_size()))


def all_to_all_rows(t: torch.Tensor, output_splits: list[int], input_splits: list[int], group, leg: str):
    """``all_to_all_single`` of the rows of ``t (M, ...)`` (any dtype, sent as bytes) with row splits."""
    t = t.contiguous()
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    as_bytes = t.view(torch.uint8).reshape(t.shape[0], row_bytes)
    out = as_bytes.new_empty((sum(output_splits), as_bytes.shape[1]))
    WireLog._record(leg, as_bytes)
    dist.all_to_all_single(out, as_bytes, output_splits, input_splits, group=group)
    return out.view(t.dtype).reshape(out.shape[0], *t.shape[1:])


__all__ = ["mxfp8_row_bytes", "pack_mxfp8", "unpack_mxfp8", "WireLog", "WireRecord", "all_to_all_rows"]
