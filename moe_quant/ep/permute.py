"""Received MXFP8 rows, in (source rank, local expert) order, to expert-major order.

After the dispatch all-to-all a rank holds, for each source rank ``r`` and local expert ``e``,
``counts[r, e]`` rows, ordered r-major, then e, then arrival order. The grouped GEMM wants them
expert-major: for each expert e, for each rank r, that block's rows in order. This module holds
the semantics (:func:`reference_permute_received`, pure PyTorch, no host synchronization) and the
entry point :func:`permute_received`, which runs the CuTe-DSL kernel on SM90+ (``R * E`` up to
``kernels.permute.config.MAX_BLOCKS`` = 1024 blocks) and the reference elsewhere; both are byte-identical (``tests/test_permute.py``, ``tests/test_kernel_permute_gpu.py``).

Counts are sanitized on the device, never read on the host: a negative count is 0 and the running
total (in r-major order) is clamped to M, so block (r, e) holds rows
``[min(S, M), min(S + c, M))`` of the input, ``S`` the sum of the sanitized counts before it.
Output rows past the sanitized total ``T = offs[-1]`` are zero (fp8 0x00, scale byte 0, dequantized
+0.0); the blocked scale buffer holds exactly what ``to_blocked_m_groups`` writes for ``offs``
(zero padding, nothing for rows past ``T``).
"""

from __future__ import annotations

import torch

from .. import backends, layouts
from .. import validation as v
from ..numerics import BLOCK_SIZE, dequantize_blocks
from ..quantize import dequantize_rows  # noqa: F401  (its home: rows already in order, one (rank, expert) block)

E8M0 = torch.float8_e8m0fnu
OUT_KINDS = ("dequant", "blocked", "plain")
OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_permute_received_args(data, scales, counts, out, out_dtype) -> None:
    """Clear TypeError/ValueError naming the argument, before any kernel runs (no device reads)."""
    v.check_tensor("data", data, dtypes=(torch.float8_e4m3fn,), ndim=2)
    v.check_block_multiple("data", "K (data.shape[1])", data.shape[1])
    v.check_tensor("scales", scales, dtypes=v.SCALE_DTYPES, ndim=2)
    v.check_shape("scales", scales, (data.shape[0], data.shape[1] // BLOCK_SIZE), "(M, K // 32): one e8m0 byte per 32 elements of data, row-major")
    v.check_same_device("scales", scales, "data", data)
    v.check_tensor("counts", counts, dtypes=(torch.int32,), ndim=2)
    v.check_same_device("counts", counts, "data", data)
    if not isinstance(out, str) or out not in OUT_KINDS:
        raise ValueError(f"out must be one of {OUT_KINDS}, got {out!r}")
    v.check_dtype_choice("out_dtype", out_dtype, OUT_DTYPES)


def _source_rows(counts: torch.Tensor, total: int):
    """For each output row: the input row it comes from (0 where none) and whether it has one."""
    src_starts, sizes, dst_starts, offs = layouts.received_group_table(counts, total)
    t = torch.arange(total, device=counts.device)
    if sizes.numel() == 0:
        return t * 0, t < 0, offs
    dst_s = dst_starts.t().reshape(-1)  # expert-major block order: non-decreasing
    dst_e = dst_s + sizes.t().reshape(-1)
    b = layouts.group_of(t, dst_e).clamp(max=dst_e.numel() - 1)
    valid = t < dst_e[-1]
    src = torch.where(valid, src_starts.t().reshape(-1)[b] + t - dst_s[b], 0)
    return src, valid, offs


def _gather_rows(x: torch.Tensor, src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    rows = x.view(torch.uint8)[src]
    return torch.where(valid.unsqueeze(1), rows, 0).view(x.dtype)


def reference_permute_received(data, scales, counts, *, out="dequant", out_dtype=torch.bfloat16):
    """The semantics of :func:`permute_received` in pure PyTorch (arguments checked by the caller)."""
    m = data.shape[0]
    src, valid, offs = _source_rows(counts, m)
    data_p = _gather_rows(data, src, valid)
    scales_p = _gather_rows(scales.view(torch.uint8), src, valid)
    if out == "dequant":
        return dequantize_blocks(data_p, scales_p, out_dtype), offs
    if out == "blocked":
        return data_p, layouts.to_blocked_m_groups(scales_p, offs).view(E8M0), offs
    return data_p, scales_p.view(E8M0), offs


def permute_received(data, scales, counts, *, out="dequant", out_dtype=torch.bfloat16):
    """Rows received by an all-to-all, in (source rank, local expert) order, to expert-major order.

    ``data``: ``(M, K)`` ``float8_e4m3fn``, K a multiple of 32 (1x32 blocks along K).
    ``scales``: ``(M, K // 32)`` e8m0 bytes (``uint8`` or ``float8_e8m0fnu``), row-major (plain).
    ``counts``: ``(R, E)`` int32 on ``data``'s device: rows received from rank r for local expert e,
    ordered r-major, then e, then arrival order. Sanitized on the device (see the module doc).

    ``out="dequant"``: ``(x (M, K) out_dtype, offs (E,) int32)``, x the dequantized rows in expert-major
    order (bit-identical to ``from_mxfp8`` of the permuted rows), offs the experts' cumulative group ends.
    ``out="blocked"``: ``(data_p (M, K) fp8, scales float8_e8m0fnu M-groups blocked for offs, offs)``:
    what ``quantize_rowwise(x, mode, offs)`` returns for the scaled GEMM, every byte incl. padding.
    ``out="plain"``: ``(data_p, scales_p (M, K // 32) float8_e8m0fnu, offs)``.
    ``out_dtype``: ``torch.bfloat16`` or ``torch.float32`` (used by ``"dequant"``).
    """
    check_permute_received_args(data, scales, counts, out, out_dtype)
    if backends.use_quant_kernels(data):
        from ..kernels.permute import ops as ops_permute

        if ops_permute.serves(counts):
            return ops_permute.permute_mxfp8(data.contiguous(), scales.contiguous(), counts.contiguous(), out, out_dtype)
    return reference_permute_received(data, scales, counts, out=out, out_dtype=out_dtype)


