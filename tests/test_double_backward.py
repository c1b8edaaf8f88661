"""Second-order gradients through mxfp8_grouped_mm raise a clear error; first-order use of
create_graph=True (and torch.func.grad, which runs backward with create_graph=True) is unchanged."""

import pytest
import torch
from torchao.quantization import quantize_

from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm
from moe_quant.moe import MoE

MESSAGE = r"mxfp8_grouped_mm \(MXFP8 grouped GEMM\) does not support double backward"


def _problem(scale=1e-3):
    """Weights around ``scale`` (1e-3: where the unscaled fp8 cast flushes to zero)."""
    torch.manual_seed(0)
    A = torch.randn(96, 64, requires_grad=True)
    W = (torch.randn(3, 32, 64) * scale).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor([40, 40, 96], dtype=torch.int32)
    return A, W, offs


def _loss(out):
    return out.float().square().sum()


@pytest.mark.parametrize("wrt", ["A", "W"])
def test_hessian_vector_product_raises(wrt):
    A, W, offs = _problem()
    gA, gW = torch.autograd.grad(_loss(mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)), (A, W), create_graph=True)
    assert gA.requires_grad and gW.requires_grad
    v = torch.randn_like(gA)
    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.autograd.grad((gA * v).sum(), A if wrt == "A" else W)
    with pytest.raises(RuntimeError, match=MESSAGE):  # through dW as well
        (gW.float() * 2).sum().backward()


def test_double_backward_raises_with_constant_grad_out():
    """out.sum(): grad_out needs no grad, but dA depends on W and dW on A (saved tensors)."""
    A, W, offs = _problem(scale=0.05)
    (gA,) = torch.autograd.grad(mxfp8_grouped_mm(A, W.transpose(-2, -1), offs).float().sum(), A, create_graph=True)
    assert gA.requires_grad
    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.autograd.grad(gA.square().sum(), W)


def test_gradient_penalty_on_a_converted_block_raises():
    torch.manual_seed(0)
    model = MoE(64, 96, 4, 2)
    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    x = torch.randn(24, 64)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(_loss(model(x)), params, create_graph=True)
    penalty = sum(g.float().square().sum() for g in grads)
    with pytest.raises(RuntimeError, match=MESSAGE):
        penalty.backward()


def test_grad_of_grad_raises_under_torch_func():
    A, W, offs = _problem(scale=0.05)
    W_t = W.detach().transpose(-2, -1)

    def first(a):
        return torch.func.grad(lambda t: _loss(mxfp8_grouped_mm(t, W_t, offs)))(a).sum()

    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.func.grad(first)(A.detach())


def test_first_order_create_graph_is_unchanged_and_other_branches_stay_twice_differentiable():
    A, W, offs = _problem(scale=0.05)
    side = torch.randn(8, requires_grad=True)

    def loss():
        return _loss(mxfp8_grouped_mm(A, W.transpose(-2, -1), offs)) + side.pow(3).sum()

    gA, gW, gs = torch.autograd.grad(loss(), (A, W, side), create_graph=True)
    rA, rW, rs = torch.autograd.grad(loss(), (A, W, side))
    assert torch.equal(gA, rA) and torch.equal(gW, rW) and torch.equal(gs, rs)
    # a second-order gradient that does not pass through the MXFP8 op: d/dside sum(3 side^2) = 6 side
    (h,) = torch.autograd.grad(gs.sum(), side)
    assert torch.allclose(h, 6 * side.detach())
