"""What the expert-parallel legs send, and how many bytes.

Every leg sends rows as raw bytes (``uint8``), which every backend moves (gloo has no float8 or, on
some builds, bfloat16). An MXFP8 leg sends its rows' K e4m3 bytes and their K/32 e8m0 scale bytes as two
exchanges with the same row splits (:func:`all_to_all_mxfp8`): ``K + K/32`` bytes per token, and neither
the sender nor the receiver copies them into or out of a packed buffer (the quantize kernel's outputs go
to the wire as they are, and the receiver's permutation reads contiguous rows). A :class:`WireLog`
records the bytes of every leg in this process (one record per leg, data and scales together; the
point-to-point transport, :mod:`moe_quant.ep.blocks`, sends the same bytes as slices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import torch
import torch.distributed as dist

from .. import quantize as q
from ..numerics import BLOCK_SIZE, ScaleMode

_E4M3 = torch.float8_e4m3fn


def quantize_rows(rows: torch.Tensor, mode: ScaleMode, cast: torch.dtype | None = None):
    """What an MXFP8 leg sends of ``rows (N, D)``: ``(data, scales)``, the 1x32 MXFP8 form of ``rows`` rounded to
    ``cast`` where that is narrower (the dispatcher's ``experts_dtype``: the dtype the experts quantize them in; fp32
    rows into experts that cast to bf16 are quantized as their bf16 rounding, as the experts would), else of the rows
    themselves. The receiver dequantizes into the rows' own dtype."""
    if cast is not None and cast.itemsize < rows.dtype.itemsize:
        rows = rows.to(cast)
    return q.quantize_rowwise(rows, mode)


def mxfp8_row_bytes(hidden: int) -> int:
    """Bytes of one token of ``hidden`` elements in MXFP8 on the wire: data plus one scale byte per 32."""
    return hidden + hidden // BLOCK_SIZE


@dataclasses.dataclass
class WireRecord:
    leg: str  # "dispatch", "dispatch backward", "combine", "combine backward", "counts"
    rows: int  # rows this rank handed to all_to_all_single
    bytes: int  # bytes of that tensor

    @property
    def bytes_per_row(self) -> float:
        return self.bytes / self.rows if self.rows else 0.0


class WireLog(contextlib.AbstractContextManager):
    """Records every all-to-all of the EP legs in this process while active (``with WireLog() as log``), from
    every thread: on CUDA the backward legs run on autograd's device threads, not the one that entered."""

    _log: "WireLog | None" = None  # the active log, process-wide
    _lock = threading.Lock()

    def __init__(self):
        self.records: list[WireRecord] = []

    def __enter__(self):
        with WireLog._lock:
            self._prev = WireLog._log
            WireLog._log = self
        return self

    def __exit__(self, *exc):
        with WireLog._lock:
            WireLog._log = self._prev
        return False

    def by_leg(self, leg: str) -> tuple[int, int]:
        """``(rows, bytes)`` summed over the records of ``leg``."""
        recs = [r for r in self.records if r.leg == leg]
        return sum(r.rows for r in recs), sum(r.bytes for r in recs)

    @classmethod
    def record_rows(cls, leg: str, rows: int, nbytes: int) -> None:
        """Record that ``leg`` handed ``rows`` rows of ``nbytes`` bytes in all to the transport."""
        log = WireLog._log
        if log is not None:
            log.records.append(WireRecord(leg, rows, nbytes))


PROFILE_PREFIX = "moe_quant.ep::"


def leg_range(leg: str):
    """A ``torch.profiler`` range named ``moe_quant.ep::<leg>`` around a leg's collective (its kernels carry
    it: ``benchmarks/bench_ep.py`` times each leg from it); nothing while tracing."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(PROFILE_PREFIX + leg)


def row_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t (M, ...)`` (contiguous, any dtype) as ``(M, row bytes)`` uint8: what every leg hands a backend."""
    return t.view(torch.uint8).reshape(t.shape[0], math.prod(t.shape[1:]) * t.element_size())


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def row_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows along dim 0, 2-D or more) viewed as integers: the widest type whose size divides its rows'
    bytes, its row strides and its offset (so the view is legal), at least its own element size (a 1-byte
    float becomes uint8, which every copy kernel takes; while compiling or where the last dimension is strided,
    the integer type of its own size); the bits are unchanged (``.view(t.dtype)`` undoes it).

    For the legs' row copies: PyTorch's ``index_copy_`` along dim 0 runs a thread per element, so an fp8 row of
    D bytes is D element copies; as 8-byte words it is D / 8, moved 4.6x faster (bf16 rows 2.6x) on an H200
    (``scripts/probes/row_copy_probe.py``, docs/lab/ep_log.md)."""
    if t.dim() < 2:
        return t
    item = t.dtype.itemsize
    # traced (dynamo cannot trace storage_offset(), torch 2.11 and 2.13 under fullgraph; Inductor writes its own
    # copy kernel), or rows that are not contiguous: no wider word, the integer type of the element's own size
    if not torch.compiler.is_compiling() and t.stride(-1) == 1:
        for dtype in _WORDS:  # widest first
            if dtype.itemsize <= item:
                break
            if all((s * item) % dtype.itemsize == 0 for s in (t.shape[-1], t.storage_offset(), *t.stride()[:-1])):
                return t.view(dtype)
    same = next(d for d in _WORDS if d.itemsize == item)  # legal for any layout
    return t.view(same) if t.dtype != same else t


def _exchange(parts: list, output_splits: list[int], input_splits: list[int], group, leg: str) -> list:
    """One leg: an ``all_to_all_single`` of each ``(M, row bytes)`` uint8 part with the same row splits, recorded
    as one leg of all the parts' bytes. Returns the received parts."""
    n_out = sum(output_splits)
    outs = [p.new_empty((n_out, p.shape[1])) for p in parts]
    WireLog.record_rows(leg, parts[0].shape[0], sum(p.numel() for p in parts))
    with leg_range(leg):
        for out, p in zip(outs, parts):
            dist.all_to_all_single(out, p, output_splits, input_splits, group=group)
    return outs


def all_to_all_rows(t: torch.Tensor, output_splits: list[int], input_splits: list[int], group, leg: str):
    """``all_to_all_single`` of the rows of ``t (M, ...)`` (any dtype, sent as bytes) with row splits."""
    t = t.contiguous()
    (out,) = _exchange([row_bytes_view(t)], output_splits, input_splits, group, leg)
    return out.view(t.dtype).reshape(out.shape[0], *t.shape[1:])


def all_to_all_mxfp8(data: torch.Tensor, scales: torch.Tensor, output_splits: list[int], input_splits: list[int],
                     group, leg: str):
    """MXFP8 rows over one leg: ``data (M, K)`` e4m3 and plain ``scales (M, K/32)`` (e8m0 bytes) in two
    ``all_to_all_single`` of the same row splits, recorded as one leg of ``K + K/32`` bytes per row.
    Returns ``(data (M', K) e4m3, scales (M', K/32) uint8)``, both contiguous (no packed buffer: packing
    cost a copy of every row on each side, 1.0 ms of a 30 ms EP = 4 step on H200s,
    docs/lab/ep_log.md)."""
    if scales.shape[0] != data.shape[0]:
        raise ValueError(f"scales must have one row per data row: data {tuple(data.shape)}, scales {tuple(scales.shape)}")
    d_out, s_out = _exchange([row_bytes_view(data.contiguous()), row_bytes_view(scales.contiguous())],
                             output_splits, input_splits, group, leg)
    return d_out.view(_E4M3), s_out


__all__ = ["mxfp8_row_bytes", "all_to_all_mxfp8", "WireLog", "WireRecord", "all_to_all_rows", "leg_range",
           "row_bytes_view", "PROFILE_PREFIX"]
