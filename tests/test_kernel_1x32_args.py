"""CPU checks of the 1x32 kernel ops: argument errors before any launch, fake (meta) shapes."""

import pytest
import torch

from moe_quant import layouts
from moe_quant.kernels import compile_cache, ops
from moe_quant.numerics import ScaleMode


def test_bad_x():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.quantize_1x32([[1.0]], ScaleMode.RCEIL)
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        ops.quantize_1x32(torch.zeros(4, 32, dtype=torch.float16), ScaleMode.RCEIL)
    with pytest.raises(ValueError, match="2D"):
        ops.quantize_1x32(torch.zeros(2, 4, 32), ScaleMode.RCEIL)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize_1x32(torch.zeros(4, 48), ScaleMode.RCEIL)
    with pytest.raises(ValueError, match="contiguous"):
        ops.fake_quantize_1x32(torch.zeros(64, 64).t(), ScaleMode.RCEIL)
    with pytest.raises(ValueError, match="CUDA"):
        ops.quantize_1x32(torch.zeros(4, 64), ScaleMode.RCEIL)
    with pytest.raises(ValueError, match="scale_mode|mode"):
        ops.quantize_1x32(torch.zeros(4, 64), "nearest")


def test_bad_offs_and_options():
    x = torch.zeros(4, 64)
    with pytest.raises(TypeError, match="offs must be int32"):
        ops.quantize_1x32(x, ScaleMode.RCEIL, torch.tensor([4]))
    with pytest.raises(ValueError, match="offs must be 1D"):
        ops.quantize_1x32(x, ScaleMode.RCEIL, torch.tensor([[4]], dtype=torch.int32))
    with pytest.raises(TypeError, match="offs must be a torch.Tensor"):
        ops.quantize_1x32(x, ScaleMode.RCEIL, [4])
    with pytest.raises(ValueError, match="scale_layout"):
        ops.quantize_1x32(x.to("meta"), ScaleMode.RCEIL, None, scale_layout="swizzled")
    with pytest.raises(TypeError, match="out_dtype"):
        ops.fake_quantize_1x32(x, ScaleMode.RCEIL, torch.float16)


@pytest.mark.parametrize("m,k,g", [(0, 32, 3), (300, 224, 4), (1, 7168, 8)])
def test_meta_shapes(m, k, g):
    x = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(g, device="meta", dtype=torch.int32)
    d, s = torch.ops.moe_quant.quantize_1x32(x, "rceil", offs, "blocked")
    assert d.shape == (m, k) and d.dtype == torch.float8_e4m3fn
    assert tuple(s.shape) == layouts.m_groups_blocked_shape(m, k // 32, g) and s.dtype == torch.float8_e8m0fnu
    _, s = torch.ops.moe_quant.quantize_1x32(x, "floor", None, "blocked")
    assert tuple(s.shape) == layouts.blocked_shape(m, k // 32)
    _, s = torch.ops.moe_quant.quantize_1x32(x, "floor", None, "plain")
    assert tuple(s.shape) == (m, k // 32)
    f = torch.ops.moe_quant.fake_quantize_1x32(x, "rceil", torch.float32)
    assert f.shape == (m, k) and f.dtype == torch.float32


def test_kernel_inputs_get_row_major_strides_also_without_elements():
    """A zero-element tensor counts as contiguous whatever its strides (the argument checks pass it),
    but the compiled kernels check strides: what they are handed is row-major."""
    expanded = torch.zeros((), dtype=torch.bfloat16).expand(0, 64)
    assert expanded.is_contiguous() and expanded.stride() == (0, 0)
    assert compile_cache.aligned(expanded).stride() == (64, 1)
    x = torch.randn(4, 64)
    assert compile_cache.aligned(x) is x


def test_aligned_copies_exactly_what_the_kernels_cannot_read():
    """The fast path of ``aligned`` (contiguous, 16-byte aligned, not empty: ``t`` itself) against the plain
    computation: a misaligned view and a transposed view are copied to row-major, aligned tensors with the same
    values; an aligned contiguous view is passed as it is."""
    base = torch.randn(8 * 64 + 8).bfloat16()
    misaligned = base[1:1 + 8 * 64].view(8, 64)
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16
    for t in (misaligned, torch.randn(64, 8).bfloat16().t()):
        got = compile_cache.aligned(t)
        assert got is not t and got.data_ptr() % 16 == 0 and got.stride() == (64, 1) and torch.equal(got, t)
    view = base[8:8 + 8 * 64].view(8, 64)  # 16 bytes in: aligned
    assert compile_cache.aligned(view) is view
