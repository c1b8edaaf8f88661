"""The fused SwiGLU block's fwd+bwd peak if dSwiGLU wrote grad_a's and grad_b's forms in fp8 and scales instead of
the emulated GEMM's bf16 values, each form dequantized to bf16 only inside the stage whose GEMM reads it (freed when
that GEMM returns), as x's kept colwise form is already (:func:`moe_quant.block_quantize.colwise_operand`).

    python scripts/probes/fp8_dswiglu_forms_probe.py [--d 512] [--h 352] [--experts 4] [--rows 384]
        [--scale-to 2048,1408,64,98304] [--modes eager,compiled] [--backend inductor|aot_eager] [--top 12]
        [--stages] [--in-op]

CPU, ``benchmarks.block_peak``'s model of the GPU's allocations (its default shape is DeepSeek-V3 16B's experts
divided by 256; ``--d 896 --h 256 --experts 4 --rows 192 --scale-to 7168,2048,64,98304`` is DeepSeek-V3's divided by
1024). Nothing in ``moe_quant`` changes: the probe patches, for the emulated GEMM the CPU runs,

* ``block_quantize.dswiglu``: grad_a and grad_b (the reference) quantized to fp8 data and plain e8m0 scales, rowwise
  ``(data (M, H), scales (M, H/32))`` (rows past the last group zero, as the bf16 form) and colwise
  ``(data_t (H, Mp), scales (H, Mp/32), poffs)`` (:func:`moe_quant.quantize.colwise_k_groups_plain`, the form the
  block keeps of x); ``fp8-colwise``: the colwise forms alone, the rowwise forms bf16 as today;
* the dgrad and wgrad stages (:class:`moe_quant.autograd.swiglu_block.BackwardStages` eager): each fp8 form
  dequantized (:func:`moe_quant.quantize.dequantize_rows`, one pass) into the bf16 form today's stage reads, the fp8
  one dropped then, and today's stage run on it. Compiled (``swiglu_block_ops._OpStages``), each form dequantized by
  an op of its own (``moe_quant_probe::dequantize_form``, ordered after the previous GEMM's output by an input it
  does not read) before the GEMM's op, which reads the bf16 form as today; ``--in-op``: inside the GEMM's op instead
  (the fp8 form, an input of that op, then lives through the GEMM). The bf16 values are the fp8 values times their
  scales, so every gradient is the same bits: checked (``torch.equal`` of dx, dW1, dW3, dW2 against the unpatched
  eager block, eager and compiled) before any peak is printed.

Results (2026-12-03, torch 2.13): docs/lab/performance_log.md, "fp8 dSwiGLU forms and the fused block's peak".
Built since as the block's switch ``dswiglu_cols_fp8`` (the colwise forms alone in fp8, the ``cols_fp8`` dswiglu kernel
variants; off by default: on one H200 it cost the block's step 2.5-4%); the probe patches the block with the switch off
(its "today").

Each peak is printed as block_peak scales it (``xF``: every byte times the shape's factor) and ``padded``: each
allocation of a colwise form, ``(R, Mp)`` with ``Mp = M + 32 E`` padded rows, weighed at the GPU shape's padding
(2% of the rows at 1536 rows an expert against 8% at 384: the plain factor overstates them), so that the peak's
stage is the GPU's (today's fused block: 2.794 GiB, the H200's 2.79). The kernel's fp8 output (``fake=False``) has
the scaled GEMM's blocked scales, which pad each group's scale rows to 128: under 1 MB more at these shapes than the
plain scales here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_block, block_peak  # noqa: E402
from moe_quant import block_quantize as bq  # noqa: E402
from moe_quant import cli, reference  # noqa: E402
from moe_quant import quantize as q  # noqa: E402
from moe_quant.autograd import swiglu_block as sb  # noqa: E402
from moe_quant.autograd import swiglu_block_ops as sbo  # noqa: E402

# the stage functions the patches wrap, as imported (before any patch)
DGRAD, WGRAD, COLWISE_OPERAND = sb.backward_dgrad, sb.backward_wgrad, bq.colwise_operand
# profiler ranges whose outputs are colwise forms (rows Mp): weighed at the GPU shape's padding
COLWISE_RANGES = ("kernel:fake_colwise_k_groups", "kernel:colwise_k_groups_plain", "kernel:colwise_operand",
                  "kernel:dequantize_colwise")
PATCHES = ("today", "fp8-forms", "fp8-colwise")
# the block the patches apply to: its colwise forms of grad_a and grad_b in bf16 ("today"), dswiglu_cols_fp8 off (the
# default); "fp8-colwise" patches in what the switch does
BLOCK = bench_block.VARIANTS["fused"]


def _fp8_rowwise(t, mode, offs):
    data, scales = q.rowwise(t, mode, None)  # plain scales (M, R/32)
    return bq.rows_in_groups(data, offs), scales


def _bf16_rowwise(t, mode, offs):
    return (bq.rows_in_groups(q.fake_quantize_rowwise(t, mode), offs),)


def fp8_dswiglu(rows_fp8: bool):
    """``block_quantize.dswiglu`` on the emulated GEMM writing the colwise forms (and the rowwise ones where
    ``rows_fp8``) in fp8 and plain scales."""

    def dswiglu(grad_h, a, b, mode, offs, fake, cols_fp8=False):
        assert fake, "the probe patches the emulated GEMM's forms"
        grads = reference.dswiglu(grad_h, a, b)
        row = _fp8_rowwise if rows_fp8 else _bf16_rowwise
        return tuple((row(g, mode, offs), tuple(q.colwise_k_groups_plain(g, offs, mode))) for g in grads)

    return dswiglu


def _dequantize_rowwise(form):
    with torch.profiler.record_function("kernel:dequantize_rowwise"):
        data, scales = form
        return (q.dequantize_rows(data, scales, torch.bfloat16),)


def _dequantize_colwise(form):
    with torch.profiler.record_function("kernel:dequantize_colwise"):
        return COLWISE_OPERAND(form, True)


def _bf16_forms(forms: list, dequantize) -> list:
    """``forms`` (emptied) dequantized one by one, each fp8 form dropped once its bf16 one exists."""
    fp8, out = list(forms), []
    forms.clear()
    while fp8:
        out.append(dequantize(fp8.pop(0)))
    return out


def dgrad(rows, w, offs, mode, backend, scopes, x_dtype, acc):
    return DGRAD(_bf16_forms(rows, _dequantize_rowwise), w, offs, mode, backend, scopes, x_dtype, acc)


def wgrad(cols, x_col, offs, backend, w_dtype):
    return WGRAD(_bf16_forms(cols, _dequantize_colwise), x_col, offs, backend, w_dtype)


# ----------------------------------------------------------------------------- compiled: the dequantization as its
# own op (an op's inputs live until it returns, so an fp8 form read inside the GEMM's op would live beside its bf16
# values through the GEMM)


def _dequantize_form(form: list[torch.Tensor], after: list[torch.Tensor], colwise: bool) -> torch.Tensor:
    """The bf16 values of an fp8 form's ``(data, scales)``; ``after``: read by nothing (the op runs after those
    exist, as ``swiglu_block_ops._OpStages``' ``after``)."""
    with torch.profiler.record_function("kernel:dequantize_colwise" if colwise else "kernel:dequantize_rowwise"):
        return q.dequantize_rows(form[0], form[1], torch.bfloat16)


_dequantize_op = torch.library.custom_op("moe_quant_probe::dequantize_form", _dequantize_form, mutates_args=())
_dequantize_op.register_fake(_dequantize_form)
OPS_DSWIGLU, OPS_DGRAD, OPS_WGRAD = sbo._OpStages.dswiglu, sbo._OpStages.dgrad, sbo._OpStages.wgrad


def ops_stages(rows_fp8: bool):
    """``_OpStages``' dswiglu, dgrad and wgrad with the fp8 forms: dSwiGLU's op output unflattened by their arity,
    each form dequantized by its own op just before the GEMM's op (ordered after the previous GEMM's output), which
    then reads bf16 forms as today."""
    arity = (2 if rows_fp8 else 1, 3)

    def dswiglu(self, *args):
        self.probe_dw = None
        with mock.patch.object(sbo, "_arity", lambda fake, cols_fp8=False: arity):
            return OPS_DSWIGLU(self, *args)

    def dgrad(self, rows, w, offs, mode, backend, scopes, x_dtype, acc):
        if rows_fp8:
            fp8 = list(rows)
            rows.clear()
            rows = []
            while fp8:
                rows.append((_dequantize_op(list(fp8.pop(0)), self._after(), False),))
        return OPS_DGRAD(self, rows, w, offs, mode, backend, scopes, x_dtype, acc)

    def wgrad(self, cols, x_col, offs, backend, w_dtype):
        fp8 = list(cols)
        cols.clear()
        after = [x_col[0]] + ([self.probe_dw] if self.probe_dw is not None else [])
        bf16 = []
        while fp8:
            data_t, scales, poffs = fp8.pop(0)
            bf16.append((_dequantize_op([data_t, scales], after, True), poffs))
        self.probe_dw = OPS_WGRAD(self, bf16, x_col, offs, backend, w_dtype)
        return self.probe_dw

    return dswiglu, dgrad, wgrad


@contextlib.contextmanager
def patched(which: str, in_op: bool = False):
    """Within it the fused block runs ``which`` (:data:`PATCHES`), eager and compiled; ``in_op``: compiled, each
    form dequantized inside the op of the GEMM that reads it (else by its own op before)."""
    with contextlib.ExitStack() as stack:
        # x's operand in its own range, so that its bf16 values count as a colwise form (padded rows)
        stack.enter_context(mock.patch.object(bq, "colwise_operand", _in_range("kernel:colwise_operand",
                                                                              COLWISE_OPERAND)))
        if which != "today":
            rows_fp8 = which == "fp8-forms"
            stack.enter_context(mock.patch.object(bq, "dswiglu", fp8_dswiglu(rows_fp8)))
            stack.enter_context(mock.patch.object(sb.BackwardStages, "wgrad", staticmethod(wgrad)))
            if rows_fp8:
                stack.enter_context(mock.patch.object(sb.BackwardStages, "dgrad", staticmethod(dgrad)))
            if in_op:
                stack.enter_context(mock.patch.object(sbo, "backward_wgrad", wgrad))
                # tensors a form has across the ops: (rowwise, colwise); the emulated GEMM's are (1, 2)
                stack.enter_context(mock.patch.object(sbo, "_arity",
                                                      lambda fake, cols_fp8=False: (2 if rows_fp8 else 1, 3)))
                if rows_fp8:
                    stack.enter_context(mock.patch.object(sbo, "backward_dgrad", dgrad))
            else:
                for name, fn in zip(("dswiglu", "dgrad", "wgrad"), ops_stages(rows_fp8)):
                    stack.enter_context(mock.patch.object(sbo._OpStages, name, fn))
        yield


def _in_range(label, fn):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper


def _fresh_compiled(fn, backend):
    torch._dynamo.reset()
    return block_peak.compiled(fn, backend)


def grads(fn, m, d, h, e) -> list:
    """dx, dW1, dW3, dW2 of one step of ``fn`` (x routed, as measured)."""
    x, w1, w3, w2, offs, gy, _ = bench_block.make_inputs(m, d, h, e, "cpu")
    with block_peak.as_on_gpu():
        fn(bench_block.Routed.apply(x), w1, w3, w2, offs).backward(gy)
    return [t.grad for t in (x, w1, w3, w2)]


def check_bits(m, d, h, e, modes, backend, in_op: bool) -> None:
    """Raise unless every patch gives today's eager gradients bit for bit, in every mode."""
    with patched("today"):
        want = grads(BLOCK, m, d, h, e)
    assert all(g is not None and g.abs().sum() > 0 for g in want), "a gradient is missing or zero"
    for which in PATCHES:
        for mode in modes:
            with patched(which, in_op):
                fn = BLOCK if mode == "eager" else _fresh_compiled(BLOCK, backend)
                got = grads(fn, m, d, h, e)
            for name, g, w in zip(("dx", "dW1", "dW3", "dW2"), got, want):
                if not torch.equal(g, w):
                    raise AssertionError(f"{which} {mode}: {name} differs from today's eager block")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=cli.positive_int, default=512)
    p.add_argument("--h", type=cli.positive_int, default=352)
    p.add_argument("--experts", type=cli.positive_int, default=4)
    p.add_argument("--rows", type=cli.positive_int, default=384, help="rows an expert (a multiple of 32)")
    p.add_argument("--scale-to", type=cli.positive_int_list, default=[2048, 1408, 64, 98304], help="D,H,E,M")
    p.add_argument("--modes", type=cli.comma_choices("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--top", type=cli.non_negative_int, default=12)
    p.add_argument("--stages", action="store_true", help="the most bytes alive in each backward stage, by kernel")
    p.add_argument("--in-op", action="store_true",
                   help="compiled: dequantize each form inside the op of the GEMM that reads it, not by its own op")
    args = p.parse_args(argv)
    d, h, e = args.d, args.h, args.experts
    m = e * args.rows
    sd, sh, se, sm = args.scale_to
    ours, theirs = block_peak.sizes(m, d, h, e), block_peak.sizes(sm, sd, sh, se)
    factor = theirs["X"] / ours["X"]
    if not all(abs(theirs[k] / ours[k] / factor - 1) < 1e-9 for k in ours):
        p.error(f"--scale-to {sd},{sh},{se},{sm} is not D {d}, H {h}, E {e}, M {m} scaled by one factor")
    pad = ((sm + 32 * se) / sm) / ((m + 32 * e) / m)  # the GPU's colwise rows per row, over the CPU's

    def weigh(size, stage):
        return size * factor * (pad if any(s in COLWISE_RANGES for s in stage) else 1)

    torch._inductor.config.fx_graph_cache = False  # the patches change the ops' outputs: trace afresh
    check_bits(m, d, h, e, args.modes, args.backend, args.in_op)
    print(f"D {d}, H {h}, E {e}, M {m} x{factor:g} = D {sd}, H {sh}, E {se}, M {sm}; dx, dW1, dW3, dW2 bit-identical "
          f"to today's block in every variant and mode ({', '.join(args.modes)})")
    runs = [("bf16", None)] + [("fused", which) for which in PATCHES]
    for mode in args.modes:
        for name, which in runs:
            fn = bench_block.bf16_block if which is None else BLOCK
            with patched(which or "today", args.in_op):
                fn = fn if mode == "eager" else _fresh_compiled(fn, args.backend)
                plain = block_peak.step_peak(fn, m, d, h, e)
                pk = block_peak.step_peak(fn, m, d, h, e, weigh=weigh)
            label = name if which is None else f"{name} {which}"
            print(f"{label:18} {mode:8} x{factor:g} {plain.bytes * factor / 2**30:.3f} GiB, padded "
                  f"{pk.bytes / 2**30:.3f} GiB  at: {' > '.join(pk.stage[-3:])}")
            for stage, b, _ in pk.stages if args.stages else []:
                print(f"    stage {stage:60} max {b / 2**30:.3f} GiB")
            for size, where in pk.alive[:args.top]:
                print(f"    {size / 2**30:7.3f} GiB ({size / theirs['X']:.2f} X, {size / theirs['Hh']:.2f} Hh, "
                      f"{size / theirs['W']:.2f} W)  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
