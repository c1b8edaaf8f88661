"""The SwiGLU expert block's fwd+bwd peak, in live bytes, as the GPU's kernels would see it (issue 54), measured on the
CPU by ``benchmarks.block_peak`` (the allocator's events under ``torch.profiler``, each quantization pass's
temporaries left out, since a kernel writes none): the per-GEMM path and the fused block each peak at the sum of
tensors docs/limitations.md ("Memory under torch.compile") gives, eager and compiled.

``X``: an (M, D) bf16 tensor; ``Hh``: an (M, H) one; ``W``: one (E, D, H) bf16 weight; the step as
``benchmarks.bench_block`` runs it (x a routed copy only the block holds, y held through the backward)."""

import pytest
import torch

from benchmarks import block_peak

D, H, E, ROWS = 256, 160, 4, 128  # uniform groups of 128 rows
M = E * ROWS
X, Hh, W = 2 * M * D, 2 * M * H, 2 * E * D * H
MP = M + 32 * E  # rows of a colwise K-groups form: each group padded (static shape: M + 32 E)
COL_H = 2 * H * MP  # grad_a's or grad_b's colwise form, bf16 values
X_KEPT = (D + D // 32) * MP  # x's colwise form kept by the fused block: fp8 and e8m0 scales
SMALL = 256  # offsets, padded offsets, scalars


def peak(variant: str, compiled: bool) -> block_peak.Peak:
    fn = block_peak.VARIANTS[variant]
    if compiled:
        torch._dynamo.reset()
        fn = block_peak.compiled(fn, "aot_eager")
    return block_peak.step_peak(fn, M, D, H, E)


@pytest.mark.parametrize("compiled", [False, True])
def test_per_gemm_block_peaks_at_its_last_dgrad_without_x(compiled):
    """Three ``mxfp8_grouped_mm`` calls and silu (``swiglu_experts_unfused``) peak at w1's dgrad GEMM: y, w3's dx, w1's
    GEMM's output gradient's rowwise form, w1's dequantized dgrad operand, dx from w1, the three weight gradients,
    and eager that output gradient itself (autograd holds it until the GEMM's backward returns; compiled, the graph
    frees it once its rowwise form is made): ``3 X + 2 Hh + 4 W`` eager, ``3 X + Hh + 4 W`` compiled. x is freed
    before that GEMM (and before w1's wgrad GEMM) since A's wgrad operand is made first and is A's last reader.
    Before (main, 2026-12-03): x lived to the end of the GEMM's backward (eager ``4 X + 2 Hh + 4 W``; compiled
    ``4 X + 2 Hh + 3 W`` and both colwise operands at w1's wgrad, then ``3 X + 2 Hh + 4 W``), and silu's backward ran
    after w3's GEMM's (``3 X + 4 Hh + 3 W`` there)."""
    got = peak("unfused", compiled)
    want = 3 * X + (1 if compiled else 2) * Hh + 4 * W
    assert want <= got.bytes <= want + SMALL, (got.bytes, want, got.stage)
    assert "aten::_grouped_mm" in got.stage[-1]
    # precondition: the model leaves out the reference quantizers' temporaries (fp32 copies), none of them on a GPU
    assert got.temporaries > 0


SECOND_DX_FP8 = 3 * X + X_KEPT + 2 * W + Hh + 2 * (H + H // 32) * MP  # the second dx GEMM, colwise forms in fp8
LAST_WGRAD = 2 * X + 2 * D * MP + 2 * H * MP + 3 * W  # y, dx, 3 weight gradients, x's and grad_b's bf16 colwise forms


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_block_holds_the_gradients_colwise_forms_in_fp8_through_dx(compiled):
    """The fused block with ``dswiglu_cols_fp8`` (``fused-fp8cols``) holds grad_a's and grad_b's colwise forms in fp8 and scales
    through its dx GEMMs, ``(H + H/32) Mp`` each instead of ``2 H Mp``: its second dx GEMM holds y, both dx products,
    x's kept fp8 form, dW2, w3's dequantized dgrad operand, grad_b's rowwise form and those (``3 X + X_kept + 2 W + Hh
    + 2 (H + H/32) Mp``), and it peaks (at this shape, a quarter of the rows padding) at its last weight gradient's
    GEMM, which the fp8 forms leave as it is: y, dx, the three weight gradients, x's and grad_b's bf16 colwise
    operands. Without it (the default, the next test) the second dx GEMM holds both forms in bf16, its peak."""
    assert SECOND_DX_FP8 < LAST_WGRAD < 3 * X + X_KEPT + 2 * W + Hh + 2 * COL_H
    got = peak("fused-fp8cols", compiled)
    assert LAST_WGRAD <= got.bytes <= LAST_WGRAD + SMALL, (got.bytes, LAST_WGRAD, got.stage)
    assert "aten::_grouped_mm" in got.stage[-1], got.stage
    assert any(SECOND_DX_FP8 <= b <= SECOND_DX_FP8 + SMALL for _, b, _ in got.stages), got.stages


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_block_peaks_at_its_second_dx_gemm(compiled):
    """With ``dswiglu_cols_fp8=False`` (the default) the fused block peaks at its second dx GEMM: y, the first
    dx product and the second, x's kept fp8 form, dW2, w3's dequantized dgrad operand, grad_b's rowwise form and both
    colwise forms in bf16 (``3 X + X_kept + 2 W + Hh + 2 cols``), below the bf16 block's eager peak at this shape
    (``4 X + Hh + 3 W``: x, y, both dx products, grad_a and the three weight gradients)."""
    got = peak("fused", compiled)
    want = 3 * X + X_KEPT + 2 * W + Hh + 2 * COL_H
    assert want <= got.bytes <= want + SMALL, (got.bytes, want, got.stage)
    assert "aten::_grouped_mm" in got.stage[-1], got.stage
    bf16 = peak("bf16", False)
    assert 4 * X + Hh + 3 * W <= bf16.bytes <= 4 * X + Hh + 3 * W + SMALL
    assert got.bytes < bf16.bytes


def test_weigh_counts_each_allocation_as_it_says():
    """``step_peak(weigh=...)`` replays the same timeline with each allocation's bytes as ``weigh`` gives them: three
    times every size is three times the peak (``scripts/probes/fp8_dswiglu_forms_probe.py`` weighs the colwise forms
    at another shape's padding with it)."""
    fn = block_peak.VARIANTS["bf16"]
    plain = block_peak.step_peak(fn, M, D, H, E)
    assert plain.bytes > 0
    assert block_peak.step_peak(fn, M, D, H, E, weigh=lambda size, stage: 3 * size).bytes == 3 * plain.bytes


def _probe():
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "probes"))
    return importlib.import_module("fp8_dswiglu_forms_probe")


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_dswiglu_forms_lower_the_fused_peak_with_the_same_bits(compiled):
    """The probe's measurement (issue 54): dSwiGLU writing grad_a's and grad_b's forms in fp8 and scales, each
    dequantized just before its GEMM (compiled: by its own op), gives the same dx, dW1, dW3, dW2 (``check_bits``
    raises otherwise), and the second dx GEMM then holds both colwise forms in fp8 and scales, ``(H + H/32) Mp``
    each instead of ``2 H Mp``; the colwise forms alone in fp8 (``fp8-colwise``) give the same. At this shape
    (a quarter of the rows padding) the block then peaks at its last weight gradient's GEMM, which the fp8 forms
    leave as it is: y, dx, the three weight gradients, x's and grad_b's bf16 colwise operands. (The probe patches the
    block with ``dswiglu_cols_fp8=False``, the default; its "fp8-colwise" is what the switch does.)"""
    probe = _probe()
    probe.check_bits(M, D, H, E, ["compiled" if compiled else "eager"], "aot_eager", in_op=False)
    second_dx, last_wgrad = SECOND_DX_FP8, LAST_WGRAD
    for which in ("fp8-forms", "fp8-colwise"):
        with probe.patched(which):
            got = peak("fused", compiled)  # the probe patches the block as it is by default (its "today")
        assert last_wgrad <= got.bytes <= last_wgrad + SMALL, (which, got.bytes, last_wgrad, got.stage)
        assert any(second_dx <= b <= second_dx + SMALL for _, b, _ in got.stages), (which, got.stages)
