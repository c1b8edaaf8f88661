"""What the fused SwiGLU block keeps for its backward, eager and under ``torch.compile(fullgraph=True)``: every
tensor the autograd graph saves (a ``saved_tensors_hooks`` pack hook), the weights left out, in bytes a routed row.

    python scripts/probes/compiled_saved_probe.py [--backend inductor|aot_eager] [--path fused|unfused]

CPU or GPU (the device of the default tensor type: CPU). Eager keeps a, b and x's colwise fp8 form and scales (the
block's ``ctx.save_for_backward``). Compiled, AOTAutograd's partitioner decided instead until the block became
custom ops under compile (``moe_quant/autograd/swiglu_block_ops.py``): on 2026-12-02 (torch 2.13, CPU) it kept x in
bf16, a third (M, H) bf16 tensor and three weight-sized bf16 tensors (the weights' dequantized backward operands,
made in the forward), 3977 bytes a row against eager's 1098 at D 256, H 192, E 4; with the custom ops both keep
the same storages, 1098 bytes a row (inductor and aot_eager; ``tests/test_compile_saved.py`` pins it).

``--path unfused``: the same block as three ``mxfp8_grouped_mm`` calls, PyTorch's silu and mul. Eager keeps x, a,
silu(a), b and h (2048 bytes a row). Compiled it kept 3968 on 2026-12-02 (x, three (M, H) tensors and the three
weights' dequantized dgrad operands, made in the forward), until the per-GEMM path became custom ops under compile
as well (``moe_quant/autograd/grouped_mm_ops.py``): 1664 bytes a row (inductor and aot_eager), each GEMM keeping
what it keeps eager, the compiler recomputing one of the four (M, H) tensors. Run it from the repository root with
``PYTHONPATH=.`` to probe the checkout rather than an installed copy.
"""

from __future__ import annotations

import argparse
import math

import torch

from moe_quant import mxfp8_swiglu_experts, swiglu_experts_unfused

PATHS = {"fused": mxfp8_swiglu_experts, "unfused": swiglu_experts_unfused}  # unfused: three mxfp8_grouped_mm


def saved_rows(fn, x0, ws, offs):
    """``[(shape, dtype, bytes)]`` of the distinct storages the autograd graph of ``fn`` saves, weights left out."""
    fn(x0.clone().requires_grad_(), *ws, offs).sum().backward()  # warm-up: compiled once
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x0.clone().requires_grad_(), *ws, offs)
    skip, rows = {w.untyped_storage().data_ptr() for w in ws}, []
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            skip.add(ptr)
            rows.append((tuple(t.shape), str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--path", default="fused", choices=list(PATHS),
                   help="fused: mxfp8_swiglu_experts; unfused: the per-GEMM path (swiglu_experts_unfused)")
    args = p.parse_args(argv)
    sizes, d, h = [256, 128, 0, 128], 256, 192
    g = torch.Generator().manual_seed(0)
    e, m = len(sizes), sum(sizes)
    x0 = torch.randn(m, d, generator=g).bfloat16()
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16().requires_grad_()
          for s in ((e, h, d), (e, h, d), (e, d, h))]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)

    def block(x, w1, w3, w2, offs):
        return PATHS[args.path](x * 1, w1, w3, w2, offs)  # x * 1: a routed copy only the block could keep

    for mode, fn in (("eager", block), ("compiled", torch.compile(block, fullgraph=True, backend=args.backend))):
        rows = saved_rows(fn, x0, ws, offs)
        print(f"{mode:9s} {sum(r[2] for r in rows) / m:7.1f} bytes a row: {rows}")


if __name__ == "__main__":
    main()
