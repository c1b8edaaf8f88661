"""The token permutation shared by the reference MoE block and the EP dispatcher (moe_quant.routing): the
combine computes what torchtitan's LocalTokenDispatcher computes (scores applied in fp32), keeps for
backward what its gradients need, not a copy of the expert outputs, and sums exactly as ``index_add`` does."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_quant.routing import sort_tokens_by_expert, unsort_tokens


def _routing(t, k, e, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    scores = torch.rand(t, k, generator=g).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, scores, ids


def _index_add_combine(routed_out, scores_sorted, token_idx, x_TD):
    """The combine as first written: the plain index_add formula (keeps its source for backward), the scores
    applied in fp32 as torchtitan applies them."""
    routed_out = (routed_out.float() * scores_sorted.float().unsqueeze(-1)).to(routed_out.dtype)
    return torch.zeros_like(x_TD, dtype=routed_out.dtype).index_add(0, token_idx, routed_out).to(x_TD.dtype)


@settings(deadline=None, max_examples=40)
@given(t=st.integers(1, 40), k=st.integers(1, 6), d=st.sampled_from([1, 8, 33]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_combine_equals_index_add_bit_for_bit(t, k, d, dtype, seed):
    """Forward and both gradients equal the index_add formula's, every bit (CPU: both sum a token's rows in
    sorted order)."""
    x, scores, ids = _routing(t, k, 8, d, dtype, seed)
    grad = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    outs = []
    for combine in (unsort_tokens, _index_add_combine):
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores, ids)
        routed = (x_sorted.float() * 1.5 - 0.25).to(dtype).requires_grad_()
        out = combine(routed, scores_sorted, token_idx, x)
        outs.append((out, *torch.autograd.grad(out, (routed, scores), grad)))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_combine_saves_no_copy_of_the_expert_outputs():
    """What the combine keeps for backward: the scaled expert outputs (T*K, D) are not among it (the scale's
    gradient needs the unscaled outputs, the sum only the token indices). Precondition: the plain index_add
    formula keeps both, which is what cost a (T*K, D) tensor per MoE layer until backward."""
    t, k, d = 64, 6, 128
    x, scores, ids = _routing(t, k, 16, d, torch.float32, 0)
    x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores, ids)
    routed = x_sorted.clone().requires_grad_()

    def saved_rows(combine):
        storages = {}

        def pack(tensor):
            if tensor.dim() == 2 and tuple(tensor.shape) == (t * k, d) and tensor.dtype.is_floating_point:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            combine(routed, scores_sorted, token_idx, x)
        return len(storages)

    assert saved_rows(_index_add_combine) == 2  # precondition: the index_add formula keeps its source too
    assert saved_rows(unsort_tokens) == 1  # the unscaled outputs, for the scores' gradient


@pytest.mark.parametrize("k", [1, 3])
def test_combine_under_vmap_and_compile(k):
    """The combine runs under torch.func.vmap and compiles fullgraph like the rest of the block."""
    x, scores, ids = _routing(12, k, 4, 16, torch.float32, 3)
    x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores, ids)
    want = unsort_tokens(x_sorted, scores_sorted, token_idx, x)
    batched = torch.func.vmap(lambda r: unsort_tokens(r, scores_sorted, token_idx, x))(x_sorted.unsqueeze(0))
    assert torch.equal(batched[0], want)
    compiled = torch.compile(unsort_tokens, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x_sorted, scores_sorted, token_idx, x), want)


def _titan_local_dispatcher(e, k):
    token_dispatcher = pytest.importorskip("torchtitan.models.common.token_dispatcher",
                                           reason="torchtitan not importable")
    cls = token_dispatcher.LocalTokenDispatcher
    return cls(cls.Config(num_experts=e, top_k=k))


@settings(deadline=None, max_examples=40)
@given(t=st.integers(1, 40), k=st.integers(1, 6), d=st.sampled_from([1, 8, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_sort_and_combine_equal_torchtitans_local_dispatcher(t, k, d, dtype, seed):
    """moe_quant.routing (the reference MoE's and the EP dispatcher's permutation) against torchtitan 0.3.0's
    LocalTokenDispatcher: the sorted rows, and the combine's output and the gradients of the expert outputs
    and of the routing scores (fp32 scores, as torchtitan's router makes them), every bit. Before the fix
    the scores were applied in the activations' dtype: a fifth of bf16 outputs and every score gradient
    differed."""
    e = 8
    disp = _titan_local_dispatcher(e, k)
    x, _, ids = _routing(t, k, e, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.rand(t, k, generator=g).requires_grad_()
    grad = torch.randn(t, d, generator=g).to(dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    ours, theirs = [], []
    for res, which in ((ours, "moe_quant"), (theirs, "torchtitan")):
        xs = x.clone().requires_grad_()
        if which == "moe_quant":
            x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(xs, scores, ids)
        else:
            x_sorted, _, meta = disp.dispatch(xs, scores, ids, counts)
        routed = (x_sorted.float() * 1.5 - 0.25).to(dtype)  # an "expert": differentiable, row by row
        out = unsort_tokens(routed, scores_sorted, token_idx, xs) if which == "moe_quant" else \
            disp.combine(routed, meta, xs)
        res += [x_sorted.detach(), out.detach(), *torch.autograd.grad(out, (xs, scores), grad)]
    for name, a, b in zip(("sorted rows", "output", "input grad", "score grad"), ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_combine_saves_the_expert_outputs_in_their_own_dtype():
    """The fp32 score product keeps the bf16 expert outputs for the score gradient, not an fp32 copy of them
    (which autograd would keep for torchtitan's formula: twice the bytes per MoE layer until backward)."""
    t, k, d = 32, 2, 64
    x, scores, ids = _routing(t, k, 8, d, torch.bfloat16, 0)
    x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores.float(), ids)
    routed = x_sorted.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        unsort_tokens(routed, scores_sorted, token_idx, x)
        (routed.float() * scores_sorted.reshape(-1, 1)).to(routed.dtype)  # torchtitan's formula, for contrast
    rows = [s for s in saved if s.dim() == 2 and tuple(s.shape) == (t * k, d) and s.is_floating_point()]
    assert [s.dtype for s in rows] == [torch.bfloat16, torch.float32], [s.dtype for s in rows]


def test_combine_writes_no_fp32_copy_of_the_expert_outputs():
    """Neither pass of the score product converts the bf16 expert outputs to an fp32 tensor (the multiplies
    widen each element as they read it): on the GPU such a copy is a (T*K, D) fp32 write and read per MoE
    layer in forward and again in backward. The expert outputs are read by a multiply in each pass
    (precondition: the log sees them); the combine's values are pinned by the tests above."""
    from torch.utils._python_dispatch import TorchDispatchMode

    t, k, d = 16, 2, 32
    x, scores, ids = _routing(t, k, 8, d, torch.bfloat16, 0)
    x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores.float().detach().requires_grad_(), ids)
    routed = x_sorted.clone().requires_grad_()
    ptr = routed.data_ptr()
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            reads_rows = any(isinstance(a, torch.Tensor) and a.data_ptr() == ptr for a in args)
            if reads_rows:
                seen.append((func.__name__, out.dtype if isinstance(out, torch.Tensor) else None))
            return out

    with Log():
        out = unsort_tokens(routed, scores_sorted, token_idx, x)
        out.backward(torch.ones_like(out))
    copies = [(name, dtype) for name, dtype in seen if name.startswith(("_to_copy", "to", "copy"))]
    assert copies == [], copies
    assert len([name for name, _ in seen if name.startswith("mul")]) == 2, seen  # forward's and backward's


def _atomic_scatter_add(monkeypatch):
    """``Tensor.scatter_add`` as CUDA's atomics may run it: each source row added in the rows' dtype (rounded at
    every add), in reverse order (the CPU kernel accumulates in row order, in fp32 for bf16 rows)."""
    plain = torch.Tensor.scatter_add

    def scatter_add(self, dim, index, src):
        dest, rows = index[:, 0].flip(0), src.flip(0)
        order = torch.argsort(dest, stable=True)
        dest, rows = dest[order], rows[order]
        first = torch.searchsorted(dest, dest)  # each row's rank among the rows of its destination
        rank = torch.arange(dest.numel()) - first
        out = self.clone()
        for r in range(int(rank.max()) + 1 if rank.numel() else 0):  # one add per destination per round
            sel = rank == r
            out.index_add_(0, dest[sel], rows[sel])
        return out

    monkeypatch.setattr(torch.Tensor, "scatter_add", scatter_add)
    return plain


@settings(deadline=None, max_examples=25)
@given(t=st.integers(1, 30), k=st.integers(3, 8), seed=st.integers(0, 2**16))
def test_topk_sum_does_not_depend_on_the_order_of_the_adds(t, k, seed):
    """The reference block's (and moe_quant's EP dispatcher's) sum of a token's top-k rows has one order on every
    run: the rows in sorted (expert) order one after the other, accumulated in fp32, rounded once to the rows' dtype
    (the bits of the CPU's ``scatter_add``) (issue 55: ``Tensor.scatter_add`` on CUDA adds in no fixed order, so for top-k > 2 the
    reference's bits varied from run to run). Emulated on the CPU: a ``scatter_add`` that adds in another order
    does not change the combine."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        x, scores, ids = _routing(t, k, 8, 16, torch.bfloat16, seed)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores.float().detach(), ids)
        routed = (x_sorted.float() * 1.5 - 0.25).to(torch.bfloat16)
        want = unsort_tokens(routed, scores_sorted, token_idx, x)
        assert torch.equal(want, _index_add_combine(routed, scores_sorted, token_idx, x))  # the CPU order
        _atomic_scatter_add(monkeypatch)
        assert torch.equal(unsort_tokens(routed, scores_sorted, token_idx, x), want)


def test_another_order_of_the_adds_changes_the_bits(monkeypatch):
    """Precondition of the test above: for bf16 rows and top-k > 2 the order of the adds matters."""
    x, scores, ids = _routing(64, 6, 8, 64, torch.bfloat16, 0)
    x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(x, scores.float().detach(), ids)
    index = token_idx.unsqueeze(-1).expand(-1, 64)
    out = torch.zeros_like(x)
    plain = _atomic_scatter_add(monkeypatch)
    assert not torch.equal(plain(out, 0, index, x_sorted), out.scatter_add(0, index, x_sorted))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_sum_on_cuda_is_the_cpus_every_run(dtype):
    """On CUDA the combine of a top-8 routing (DeepSeek-V3's top-k) gives the CPU's bits, run after run: the output
    and the rows' gradient (``Tensor.scatter_add``'s atomics did not). The scores' gradient is a sum over D (a
    reduction kernel, whose order is the device's): the same bits run after run on CUDA, within rounding of the
    CPU's."""
    t, k, d = 4096, 8, 256
    x, scores, ids = _routing(t, k, 64, d, dtype, 0)
    scores = scores.float().detach()
    grad = torch.randn(t, d, generator=torch.Generator().manual_seed(1)).to(dtype)

    def combine(device):
        xs, ss, g = x.to(device), scores.to(device).requires_grad_(), grad.to(device)
        x_sorted, token_idx, scores_sorted = sort_tokens_by_expert(xs, ss, ids.to(device))
        routed = (x_sorted.float() * 1.5 - 0.25).to(dtype).requires_grad_()
        out = unsort_tokens(routed, scores_sorted, token_idx, xs)
        return [out.detach().cpu()] + [v.cpu() for v in torch.autograd.grad(out, (routed, ss), g)]

    want = combine("cpu")
    first = combine("cuda")
    torch.testing.assert_close(first[2], want[2], rtol=1e-5, atol=1e-5)
    for _ in range(5):
        got = combine("cuda")
        for name, a, b in zip(("out", "routed.grad"), got, want):
            assert torch.equal(a, b), name
        assert torch.equal(got[2], first[2]), "scores.grad run to run"
