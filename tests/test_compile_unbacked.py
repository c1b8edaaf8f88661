"""torch.compile(fullgraph=True) where the row count is read from device data (an unbacked SymInt), as
under expert parallelism: ``mxfp8_grouped_mm`` and converted experts fed ``x[keep]``, M = 0 included.
Compiled equals eager bit for bit (output and every gradient), one graph, no recompile as M changes."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torchao.quantization import quantize_

import moe_quant.quantize
from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm
from moe_quant.conversion import is_converted
from moe_quant.moe import GroupedExperts

E, K, N, ROWS = 4, 64, 96, 40


def _keeps():
    g = torch.Generator().manual_seed(0)
    return [torch.rand(ROWS, generator=g) > 0.5, torch.zeros(ROWS, dtype=torch.bool)]  # some rows; none (M = 0)


def _bits(t):
    return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous().view(torch.int32)


def _run(fn, x, w, keep, g_seed=1):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, keep)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def _gmm(x, w, keep):
    a = x[keep]
    m = a.shape[0]
    offs = (torch.arange(1, E + 1) * m // E).to(torch.int32)  # from m: data-dependent too
    return mxfp8_grouped_mm(a, w.transpose(-2, -1), offs)


@pytest.fixture
def calls(monkeypatch):
    """Counts the emulated GEMMs' rowwise quantizations (precondition: the MXFP8 path ran, not a fallback)."""
    seen = []
    real = moe_quant.quantize.fake_rowwise

    def spy(*args, **kwargs):
        if not torch.compiler.is_compiling():  # counted in eager (a traced side effect is not allowed)
            seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_quant.quantize, "fake_rowwise", spy)
    return seen


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_grouped_mm_of_data_dependent_rows_compiles_and_equals_eager(backend, calls):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(ROWS, K).to(torch.bfloat16)
    w = torch.randn(E, N, K).to(torch.bfloat16)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_gmm, backend=counter, fullgraph=True)
    for keep in _keeps():
        eager = _run(_gmm, x, w, keep)
        assert calls, "the MXFP8 path did not run"
        got = _run(compiled, x, w, keep)
        assert got[0].shape[0] == int(keep.sum())
        for a, b in zip(eager, got):
            assert a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    assert counter.frame_count == 1  # one graph for M > 0 and M = 0: the row count is not specialized
    assert got[2].abs().sum() == 0  # M = 0: no rows, zero weight gradient
    plain = torch._grouped_mm(x[_keeps()[0]], w.transpose(-2, -1), offs=(torch.arange(1, E + 1) * int(
        _keeps()[0].sum()) // E).to(torch.int32))
    assert not torch.equal(compiled(x, w, _keeps()[0]), plain)  # MXFP8 numerics, not the plain op


def test_converted_experts_fed_data_dependent_rows_compile(calls):
    torch._dynamo.reset()
    torch.manual_seed(0)
    experts = GroupedExperts(K, N, E).to(torch.bfloat16)
    holder = torch.nn.Module()
    holder.experts = experts
    quantize_(holder, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: fqn == "experts")
    assert is_converted(experts) and type(experts.w1) is torch.nn.Parameter
    ids = torch.arange(ROWS) * E // ROWS  # rows sorted by expert

    def f(x, keep):
        counts = torch.zeros(E, dtype=torch.int64).scatter_add(0, ids[keep], torch.ones_like(ids[keep]))
        return experts(x[keep], counts)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    x0 = torch.randn(ROWS, K).to(torch.bfloat16)
    for keep in _keeps():
        results = []
        for fn in (f, compiled):
            for w in (experts.w1, experts.w2, experts.w3):
                w.grad = None
            x = x0.clone().requires_grad_()
            out = fn(x, keep)
            out.backward(torch.ones_like(out))
            results.append([out.detach(), x.grad] + [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)])
        for a, b in zip(*results):
            assert torch.equal(_bits(a), _bits(b))
    assert calls and counter.frame_count == 1
