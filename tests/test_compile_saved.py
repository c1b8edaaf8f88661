"""What the SwiGLU expert block keeps for its backward under ``torch.compile(fullgraph=True)``: exactly what it
keeps eager (a and b in bf16, x's colwise fp8 form, scales and padded offsets), not what AOTAutograd's partitioner
would choose from the traced joint graph (x in bf16 and the weights' dequantized backward operands: issue 54)."""

import math

import pytest
import torch

from moe_quant import mxfp8_swiglu_experts, mxfp8_swiglu_experts_w13

SIZES, D, H = [256, 128, 0, 128], 256, 192


def inputs(concat: bool, train_weights: bool):
    g = torch.Generator().manual_seed(0)
    e, m = len(SIZES), sum(SIZES)
    x = torch.randn(m, D, generator=g).bfloat16()
    shapes = ((e, 2 * H, D), (e, D, H)) if concat else ((e, H, D), (e, H, D), (e, D, H))
    ws = [(torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16().requires_grad_(train_weights)
          for s in shapes]
    return x, ws, torch.tensor(SIZES).cumsum(0).to(torch.int32)


def block_of(concat: bool):
    block = mxfp8_swiglu_experts_w13 if concat else mxfp8_swiglu_experts

    def fn(x, *ws_offs):
        return block(x * 1, *ws_offs)  # x * 1: a routed copy, which only the block could keep

    return fn


def saved_storages(fn, x0, ws, offs) -> list:
    """Sorted ``(shape, dtype, bytes)`` of the distinct storages autograd saves for ``fn``'s backward (a pack
    hook sees every one), the weights left out; after one warm-up step (compiled then)."""
    fn(x0.clone().requires_grad_(), *ws, offs).sum().backward()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(x0.clone().requires_grad_(), *ws, offs)
    seen, rows = {w.untyped_storage().data_ptr() for w in ws}, []
    for t in saved:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            rows.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
    y.sum().backward()
    return sorted(rows, key=str)


@pytest.mark.parametrize("compile_backend,concat,train_weights", [
    ("aot_eager", False, True), ("inductor", False, True), ("aot_eager", True, True), ("inductor", True, True),
    ("aot_eager", False, False),  # frozen weights: no x form kept
])
def test_compiled_block_saves_what_eager_saves(compile_backend, concat, train_weights):
    x0, ws, offs = inputs(concat, train_weights)
    m = x0.shape[0]
    eager = saved_storages(block_of(concat), x0, ws, offs)
    # precondition: eager keeps a and b (bf16) and, where a weight is trained, x's colwise fp8 form and scales
    assert sum(r[2] for r in eager if r[1] == torch.bfloat16) == 2 * m * H * 2
    assert any(r[1] == torch.float8_e4m3fn for r in eager) == train_weights
    assert not any(r[0] == (m, D) for r in eager)  # no x
    torch._dynamo.reset()
    compiled = saved_storages(torch.compile(block_of(concat), fullgraph=True, backend=compile_backend), x0, ws, offs)
    assert compiled == eager
