"""Argument checks for the public API: clear Python errors before any kernel runs.

Value checks on ``offs`` (monotone, within M) read the tensor, so they run only where
that costs no device-host synchronization (``offs`` on the CPU) or when asked for;
kernels and the reference sanitize offsets themselves, so bad values never cause an
out-of-bounds write.
"""

from __future__ import annotations

import torch

from .numerics import BLOCK_SIZE

_A_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def check_tensor(name: str, t, *, dtypes, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_block_multiple(name: str, dim_name: str, size: int) -> None:
    if size % BLOCK_SIZE != 0:
        raise ValueError(f"{name}: {dim_name} = {size} must be a multiple of {BLOCK_SIZE} (the MX block size)")


def check_offsets(offs, *, n_groups: int | None, total: int, device: torch.device, validate: bool | None = None) -> None:
    """``offs``: int32, 1-D, ``n_groups`` long, on ``device``; values checked where cheap (see module doc)."""
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a torch.Tensor of int32 group end offsets, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must have dtype torch.int32, got {offs.dtype}")
    if offs.ndim != 1:
        raise ValueError(f"offs must be 1-D (one end offset per group), got shape {tuple(offs.shape)}")
    if n_groups is not None and offs.numel() != n_groups:
        raise ValueError(f"offs must have one entry per expert ({n_groups}), got {offs.numel()}")
    if offs.device != device:
        raise ValueError(f"offs must be on the same device as the input ({device}), got {offs.device}")
    if validate is None:
        validate = offs.device.type == "cpu"
    if validate and not _is_compiling() and offs.numel() > 0:
        o = offs.cpu().to(torch.int64)
        if bool((o < 0).any()):
            raise ValueError(f"offs must be non-negative, got {o.tolist()}")
        if bool((o[1:] < o[:-1]).any()):
            raise ValueError(f"offs must be non-decreasing cumulative group ends, got {o.tolist()}")
        if int(o[-1]) > total:
            raise ValueError(f"offs[-1] = {int(o[-1])} is past the number of rows M = {total}")


def check_grouped_mm_args(A, W_t, offs, out_dtype, validate_offsets: bool | None) -> None:
    """Inputs of ``mxfp8_grouped_mm``: A (M, K), W_t (E, K, N), offs (E,) int32."""
    check_tensor("A", A, dtypes=_A_DTYPES, ndim=2)
    check_tensor("W_t", W_t, dtypes=(torch.bfloat16,), ndim=3)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    m, k = A.shape
    e, k_w, n = W_t.shape
    if k_w != k:
        raise ValueError(
            f"W_t must be (E, K, N) with K = A.shape[1] = {k} (the contraction dim), got shape {tuple(W_t.shape)}"
        )
    check_block_multiple("A", "K (A.shape[1])", k)
    check_block_multiple("W_t", "N (W_t.shape[2])", n)
    if W_t.device != A.device:
        raise ValueError(f"W_t must be on the same device as A ({A.device}), got {W_t.device}")
    check_offsets(offs, n_groups=e, total=m, device=A.device, validate=validate_offsets)
