"""Pure-PyTorch operand quantizers for the three grouped GEMMs (docs/design.md section 4).

The oracle every kernel is tested against byte for byte, and the implementation on
devices without the CuTe-DSL kernels. No host synchronization; static shapes.

Scales are returned as ``torch.float8_e8m0fnu``; data as ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import layouts
from . import validation as v
from .numerics import BLOCK_SIZE, ScaleMode, dequantize_blocks, fake_quantize_blocks, quantize_blocks

E8M0 = torch.float8_e8m0fnu


def to_mxfp8(x: torch.Tensor, scale_mode: ScaleMode | str = ScaleMode.RCEIL):
    """Quantize along the last dim in blocks of 32: ``(data e4m3, scales e8m0 (..., K/32))``.

    ``x``: a bf16, fp16 or fp32 tensor of at least one dim whose last dim is a multiple of 32.
    Same convention as torchao's ``to_mx`` (which returns them in the other order).
    """
    mode = ScaleMode.parse(scale_mode, "scale_mode")
    v.check_to_mxfp8_args(x)
    data, scale = quantize_blocks(x, mode)
    return data, scale.view(E8M0)


def from_mxfp8(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantize ``(data, scales)`` from :func:`to_mxfp8`.

    ``data``: ``float8_e4m3fn`` ``(..., K)`` with K a multiple of 32; ``scales``: ``float8_e8m0fnu``
    (or its ``uint8`` bytes) of shape exactly ``(..., K/32)`` on the same device (plain layout,
    no broadcasting); ``out_dtype``: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
    """
    v.check_from_mxfp8_args(data, scales, out_dtype)
    return dequantize_blocks(data, scales, out_dtype)


# ----------------------------------------------------------------------------- rowwise (fwd A, dgrad grad_out)


def quantize_rowwise(x: torch.Tensor, mode: ScaleMode, offs: torch.Tensor | None = None):
    """``x (M, K)`` -> ``(data (M, K), scales)``; scales plain ``(M, K/32)`` or, with ``offs``,
    the M-groups blocked buffer ``(M + 128 G, 4 ceil(K/128))``."""
    data, scale = quantize_blocks(x, mode)
    if offs is not None:
        scale = layouts.to_blocked_m_groups(scale, offs)
    return data, scale.view(E8M0)


def fake_quantize_rowwise(x: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16):
    """What an MXFP8 GEMM sees of a rowwise (1x32) operand, as ``out_dtype``."""
    return fake_quantize_blocks(x, mode, out_dtype)


# ----------------------------------------------------------------------------- colwise with K groups (wgrad)


def pad_token_groups(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x (M, R)`` copied group by group to 32-aligned starts, zeros between:
    ``(round_up(M, 32) + 32 G, R)``. Rows past the last offset are dropped."""
    m = x.shape[0]
    total = layouts.k_groups_padded_len(m, offs.numel())
    if offs.numel() == 0:  # static shapes: nothing to copy
        return x.new_zeros(total, x.shape[1])
    # each row to its padded position (rows past the last offset to one trash row past the end): a
    # scatter, so that M = 0 needs no branch when M is only known at run time (torch.compile)
    starts, sizes, pstarts, _ = layouts.group_bounds(offs, m, layouts.K_GROUP_ALIGN)
    r = torch.arange(m, device=x.device)
    g = layouts.group_of(r, starts + sizes)
    gc = g.clamp(max=offs.numel() - 1)
    dest = torch.where(g < offs.numel(), pstarts[gc] + r - starts[gc], total)
    out = x.new_zeros(total + 1, x.shape[1]).index_copy_(0, dest, x)
    return out[:total]


def unpad_token_groups(xp: torch.Tensor, offs: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pad_token_groups`: ``(m, R)``, rows past the last offset zero."""
    if offs.numel() == 0:  # (M = 0 needs no branch: nothing is gathered)
        return xp.new_zeros(m, xp.shape[1])
    starts, sizes, pstarts, _ = layouts.group_bounds(offs, m, layouts.K_GROUP_ALIGN)
    t = torch.arange(m, device=xp.device)
    g = layouts.group_of(t, starts + sizes)
    gc = g.clamp(max=offs.numel() - 1)
    valid = g < offs.numel()
    src = torch.where(valid, pstarts[gc] + t - starts[gc], 0)
    return torch.where(valid.unsqueeze(1), xp[src], 0).to(xp.dtype)


def quantize_colwise_k_groups(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    """wgrad operand: ``x (M, R)`` quantized in 32x1 blocks along tokens, per group.

    Returns ``(data_t (R, Mp) e4m3, scales (Rp, ceil(M/32) + 4 G) e8m0 K-groups blocked,
    padded_offs int32 (G,))`` with ``Mp = round_up(M, 32) + 32 G``; each group's tokens start
    at a multiple of 32 and the gaps are zero, so no block mixes two groups.
    """
    m = x.shape[0]
    data_t, scale, padded_offs = quantize_colwise_k_groups_plain(x, offs, mode)
    return data_t, layouts.to_blocked_k_groups(scale, offs, m), padded_offs


def quantize_colwise_k_groups_plain(x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode):
    """:func:`quantize_colwise_k_groups` with the scales plain: ``(data_t (R, Mp), scales (R, Mp/32) e8m0,
    padded_offs)``, scale column j that of padded tokens ``[32 j, 32 j + 32)`` (zero outside groups)."""
    data_t, scale = quantize_blocks(pad_token_groups(x, offs).t(), mode)
    return data_t, scale.view(E8M0), layouts.padded_group_offsets(offs, x.shape[0])


def fake_quantize_colwise_k_groups(
    x: torch.Tensor, offs: torch.Tensor, mode: ScaleMode, out_dtype: torch.dtype = torch.bfloat16
):
    """What the wgrad MXFP8 GEMM sees of ``x (M, R)``, in the layout of
    :func:`quantize_colwise_k_groups`: ``(values_t (R, Mp) out_dtype, padded_offs int32 (G,))``."""
    xp_t = pad_token_groups(x, offs).t()
    return fake_quantize_blocks(xp_t, mode, out_dtype), layouts.padded_group_offsets(offs, x.shape[0])


# ----------------------------------------------------------------------------- SwiGLU of the expert block


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``h = silu(a) * b`` exactly as PyTorch evaluates ``F.silu(a) * b`` on ``a``'s device: ``silu(a)``
    rounded to ``a``'s dtype, then the product rounded again. On CUDA this is PyTorch's silu kernel,
    which the fused ``swiglu`` kernel reproduces instruction for instruction (kernels/block/NOTES.md)."""
    return F.silu(a) * b


def dswiglu(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_a, grad_b)`` of :func:`swiglu`, exactly as autograd computes them for ``F.silu(a) * b``:
    ``grad_b = grad_h * silu(a)``, ``grad_a = silu_backward(grad_h * b, a)`` (each rounded to the dtype)."""
    return torch.ops.aten.silu_backward(grad_h * b, a), grad_h * F.silu(a)


# ----------------------------------------------------------------------------- 3D expert weights


def quantize_3d(w: torch.Tensor, mode: ScaleMode, along: str):
    """Expert weights ``w (E, N, K)`` quantized along K (fwd) or along N (dgrad).

    along="k": ``data (E, N, K)``, scales ``(E, blocked N x K/32)``.
    along="n": ``data (E, K, N)`` (N contiguous), scales ``(E, blocked K x N/32)``.
    """
    if along not in ("k", "n"):
        raise ValueError(f"along must be 'k' or 'n', got {along!r}")
    src = w if along == "k" else w.transpose(-2, -1)
    data, scale = quantize_blocks(src.contiguous(), mode)
    return data, layouts.to_blocked_3d(scale).view(E8M0)


def fake_quantize_3d(w: torch.Tensor, mode: ScaleMode, along_dim: int, out_dtype: torch.dtype = torch.bfloat16):
    """What the GEMM sees of a 3D weight quantized in blocks of 32 along ``along_dim`` (-1 or -2);
    same shape and dim order as ``w``."""
    if along_dim in (-1, w.ndim - 1):
        return fake_quantize_blocks(w, mode, out_dtype)
    if along_dim in (-2, w.ndim - 2):
        return fake_quantize_blocks(w.transpose(-2, -1), mode, out_dtype).transpose(-2, -1)
    raise ValueError(f"along_dim must be -1 or -2, got {along_dim}")


__all__ = [
    "BLOCK_SIZE",
    "to_mxfp8",
    "from_mxfp8",
    "quantize_rowwise",
    "fake_quantize_rowwise",
    "pad_token_groups",
    "unpad_token_groups",
    "quantize_colwise_k_groups",
    "quantize_colwise_k_groups_plain",
    "fake_quantize_colwise_k_groups",
    "quantize_3d",
    "fake_quantize_3d",
    "swiglu",
    "dswiglu",
]
