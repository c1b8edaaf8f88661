"""A converted weight stays one weight with the values it holds, whatever touches it: the quantized-weight
cache never serves an operand of an older value or of another view, ``.data =`` and ties behave as for a
plain parameter, copies and pickles are independent, and nothing keeps a replaced tensor alive."""

import copy
import gc
import io
import pickle
import types
import weakref
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from mx_strategies import offsets_from_sizes
from torch import nn
from torchao.quantization import quantize_

from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm, weight_cache
from moe_quant.conversion import MXFP8ExpertWeight
from moe_quant.moe import GroupedExperts, MoE

SIZES = [24, 0, 40, 32]
COUNTS = torch.tensor(SIZES)


def experts(cached: bool, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    m = GroupedExperts(64, 96, len(SIZES)).to(dtype)
    quantize_(m, MXFP8MoEConfig(cache_quantized_weights=cached), filter_fn=lambda mod, fqn: True)
    return m


def tokens(seed=1, dtype=torch.bfloat16):
    return torch.randn(sum(SIZES), 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().view(torch.int32)


def caches(m):
    return [p._weight_cache for p in m.parameters()]


def hits(m) -> int:
    return sum(c.hits for c in caches(m))


# ----------------------------------------------------------------------------- every kind of update


def _opt(kind):
    return {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
        "adamw_forloop": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True),
    }[kind]


def _update_no_grad(fn):
    def update(m):
        with torch.no_grad():
            fn(m)
    return update


def _load_state_dict(m):
    sd = {k: v * 1.5 for k, v in m.state_dict().items()}
    m.load_state_dict(sd)


def _write_state_dict_tensor(m):
    with torch.no_grad():
        m.state_dict()["w1"].mul_(-1)  # the plain tensor state_dict() hands out is the weight's storage


def _write_through_data(m):
    m.w1.data.mul_(3)


def _assign_data(m):
    m.w1.data = m.w1.detach().clone() * 2


UPDATES = {
    "copy_": _update_no_grad(lambda m: m.w1.copy_(torch.randn(m.w1.shape, generator=torch.Generator().manual_seed(2)))),
    "mul_": _update_no_grad(lambda m: m.w1.mul_(2)),
    "fill_": _update_no_grad(lambda m: m.w2.fill_(0.01)),
    "view_add_": _update_no_grad(lambda m: m.w1[1:3].add_(0.5)),
    "load_state_dict": _load_state_dict,
    "state_dict_tensor": _write_state_dict_tensor,
    "through_.data": _write_through_data,
    ".data_assign": _assign_data,
    "share_memory": lambda m: m.share_memory(),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_cache_sees_every_write_outside_autograd(update):
    cached, plain = experts(True), experts(False)
    x = tokens()
    before = cached(x, COUNTS)
    assert torch.equal(bits(before), bits(plain(x, COUNTS)))
    assert torch.equal(bits(cached(x, COUNTS)), bits(before)) and hits(cached) > 0  # the cache is in use
    w_before = [p.detach().clone() for p in cached.parameters()]
    for m in (cached, plain):
        UPDATES[update](m)
    changed = [not torch.equal(a, p.detach()) for a, p in zip(w_before, cached.parameters())]
    if update != "share_memory":
        assert any(changed), "precondition: the update changed a weight"
    after = cached(x, COUNTS)
    assert torch.equal(bits(after), bits(plain(x, COUNTS))), update
    if update != "share_memory":
        assert not torch.equal(bits(after), bits(before))


@pytest.mark.parametrize("opt", ["sgd", "adamw_forloop", "adamw_foreach", "adamw_fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_master"])
def test_gradient_accumulation_with_real_optimizer_steps_matches_uncached(opt, dtype):
    """Three optimizer steps of two micro-batches each: bit-identical to the uncached model, the weights
    really change every step, and the second micro-batch of each step reuses the quantized weights."""
    models = {c: experts(c, dtype) for c in (True, False)}
    opts = {c: _opt(opt)(list(m.parameters())) for c, m in models.items()}
    for step in range(3):
        w_before = [p.detach().clone() for p in models[True].parameters()]
        hits_before = hits(models[True])
        for c, m in models.items():
            opts[c].zero_grad()
            for micro in range(2):
                m(tokens(10 * step + micro, dtype), COUNTS).float().pow(2).mean().backward()
            opts[c].step()
        # micro-batch 2 reuses the fwd operands of w1, w2, w3 and the dgrad operand of w2 (x needs no grad)
        assert hits(models[True]) - hits_before == 4
        for (n, p), (_, q), w0 in zip(models[True].named_parameters(), models[False].named_parameters(), w_before):
            assert not torch.equal(p.detach(), w0), f"precondition: step {step} changed {n}"
            assert torch.equal(p.detach(), q.detach()), (step, n)
    x = tokens(99, dtype)
    assert torch.equal(bits(models[True](x, COUNTS)), bits(models[False](x, COUNTS)))


@pytest.mark.parametrize("make", ["deepcopy", "torch_load"])
def test_copies_have_their_own_cache(make):
    m = experts(True)
    x = tokens()
    out = m(x, COUNTS)
    if make == "deepcopy":
        c = copy.deepcopy(m)
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert all(a._weight_cache is not b._weight_cache for a, b in zip(m.parameters(), c.parameters()))
    assert all(len(cc) == 0 for cc in caches(c))
    assert torch.equal(bits(c(x, COUNTS)), bits(out))
    opt = torch.optim.AdamW(c.parameters(), lr=0.05)
    c(x, COUNTS).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(c.w1.detach(), m.w1.detach())  # precondition: the copy changed, the original not
    ref = experts(False)
    ref.load_state_dict(c.state_dict())
    assert torch.equal(bits(c(x, COUNTS)), bits(ref(x, COUNTS)))
    assert torch.equal(bits(m(x, COUNTS)), bits(out))


# ----------------------------------------------------------------------------- keys: exact view, own weight


def test_cache_key_is_the_exact_view():
    g = torch.Generator().manual_seed(3)
    W = (torch.randn(8, 64, 128, generator=g) / 11).bfloat16()
    A = torch.randn(64, 128, generator=g).bfloat16()
    offs = offsets_from_sizes([16, 16, 16, 16])
    cache = weight_cache.cache_for(W)
    for part in (W[:4], W[4:]):  # two slices of one weight, through one cache
        got = mxfp8_grouped_mm(A, part.transpose(-2, -1), offs, weight_cache=cache)
        assert torch.equal(bits(got), bits(mxfp8_grouped_mm(A, part.transpose(-2, -1), offs)))
    assert not torch.equal(W[:4], W[4:])  # precondition: the slices differ


def test_two_weights_viewing_one_buffer_get_their_own_operands():
    """Two expert blocks whose weights are views of one converted buffer (e.g. local slices of a stacked
    weight): each view's GEMM gets its own operands, through the one cache they share."""
    m = experts(True)
    W = m.w1  # (4, 96, 64)
    x = tokens()[:48]
    offs = torch.tensor([20, 48], dtype=torch.int32)
    halves = [W[:2], W[2:]]
    assert not torch.equal(halves[0].detach(), halves[1].detach())  # precondition: the views differ
    for _ in range(2):  # the second round from the cache
        for h in halves:
            got = torch._grouped_mm(x, h.transpose(-2, -1), offs=offs)
            ref = mxfp8_grouped_mm(x, h.detach()._data.transpose(-2, -1), offs)
            assert torch.equal(bits(got), bits(ref))
    assert W._weight_cache.hits == 2


def test_a_cache_of_another_weight_is_refused():
    g = torch.Generator().manual_seed(5)
    W1, W2 = (torch.randn(4, 64, 128, generator=g).bfloat16() for _ in range(2))
    A = torch.randn(32, 128, generator=g).bfloat16()
    offs = offsets_from_sizes([8, 8, 8, 8])
    with pytest.raises(ValueError, match="weight_cache belongs to another weight"):
        mxfp8_grouped_mm(A, W2.transpose(-2, -1), offs, weight_cache=weight_cache.cache_for(W1))


def test_fp32_weight_is_read_as_bf16_and_its_gradient_is_fp32():
    g = torch.Generator().manual_seed(6)
    W32 = (torch.randn(4, 64, 128, generator=g) / 11).requires_grad_()
    W16 = W32.detach().bfloat16().requires_grad_()
    A = torch.randn(32, 128, generator=g).bfloat16()
    offs = offsets_from_sizes([8, 0, 16, 8])
    go = torch.randn(32, 64, generator=g).bfloat16()
    cache = weight_cache.cache_for(W32)
    for _ in range(2):  # the second call from the cache
        W32.grad = W16.grad = None
        out32 = mxfp8_grouped_mm(A, W32.transpose(-2, -1), offs, weight_cache=cache)
        out16 = mxfp8_grouped_mm(A, W16.transpose(-2, -1), offs)
        out32.backward(go)
        out16.backward(go)
        assert torch.equal(bits(out32), bits(out16))
        assert W32.grad.dtype == torch.float32 and torch.equal(W32.grad, W16.grad.float())
    assert cache.hits == 1


def test_cache_for_a_parameter_caches():
    W = nn.Parameter((torch.randn(4, 64, 128) / 11).bfloat16())
    cache = weight_cache.cache_for(W)
    assert cache is not None and cache is weight_cache.cache_for(W.transpose(-2, -1))
    A = torch.randn(32, 128).bfloat16()
    offs = offsets_from_sizes([8, 8, 8, 8])
    first = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, weight_cache=cache)
    again = mxfp8_grouped_mm(A, W.transpose(-2, -1), offs, weight_cache=cache)
    assert cache.hits == 1 and torch.equal(bits(first), bits(again))
    m = experts(True)
    assert weight_cache.cache_for(m.w1) is m.w1._weight_cache is weight_cache.cache_for(m.w1.transpose(-2, -1))


# ----------------------------------------------------------------------------- .data =, ties


def test_data_assignment_replaces_the_values():
    m, ref = experts(True), experts(False, seed=7)
    x = tokens()
    m(x, COUNTS)
    for name in ("w1", "w2", "w3"):
        getattr(m, name).data = getattr(ref, name).detach().clone()
    assert isinstance(m.w1, MXFP8ExpertWeight) and isinstance(m.w1, nn.Parameter)
    assert torch.equal(bits(m(x, COUNTS)), bits(ref(x, COUNTS)))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_vector_to_parameters():
    m, ref = experts(True), experts(False, seed=8)
    x = tokens()
    m(x, COUNTS)
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(ref.parameters()), m.parameters())
    assert torch.equal(bits(m(x, COUNTS)), bits(ref(x, COUNTS)))


def test_data_assignment_of_another_shape_and_dtype_keeps_metadata_in_step():
    m = experts(True)
    new = torch.randn(2, 96, 64, dtype=torch.float32) / 8
    m.w1.data = new
    assert m.w1.shape == m.w1._data.shape == (2, 96, 64)
    assert m.w1.dtype == m.w1._data.dtype == torch.float32
    assert torch.equal(m.state_dict()["w1"], new)
    with pytest.raises(TypeError, match="data must be a floating-point"):
        m.w2.data = torch.zeros(4, 64, 96, dtype=torch.int32)


def test_quantize_keeps_a_tied_parameter_tied():
    torch.manual_seed(9)
    a, b = GroupedExperts(64, 96, 4).bfloat16(), GroupedExperts(64, 96, 4).bfloat16()
    b.w1 = a.w1
    model = nn.ModuleDict({"a": a, "b": b})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # built before the conversion
    n_params = len(list(model.parameters()))
    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    assert model.a.w1 is model.b.w1 and isinstance(model.a.w1, MXFP8ExpertWeight)
    assert len(list(model.parameters())) == n_params
    before = model.a.w1.detach().clone()
    x = tokens()
    (model.a(x, COUNTS).float().sum() + model.b(x, COUNTS).float().sum()).backward()
    opt.step()
    assert not torch.equal(model.a.w1.detach(), before)  # the optimizer built before conversion updated it
    assert all(isinstance(p, MXFP8ExpertWeight) for g in opt.param_groups for p in g["params"] if p.ndim == 3)


def test_tie_survives_when_the_swap_is_refused():
    torch.manual_seed(9)
    a, b = GroupedExperts(64, 96, 4).bfloat16(), GroupedExperts(64, 96, 4).bfloat16()
    b.w1 = a.w1
    keep = weakref.ref(a.w1)  # a weak reference makes torch.utils.swap_tensors refuse
    quantize_(nn.ModuleDict({"a": a, "b": b}), MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    gc.collect()
    assert keep() is None  # precondition: the parameter was replaced, not swapped
    assert a.w1 is b.w1 and isinstance(a.w1, MXFP8ExpertWeight)


# ----------------------------------------------------------------------------- memory, processes


def _tensors_reachable_from(root) -> list:
    seen, stack, found = set(), [root], []
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, weakref.ReferenceType, types.ModuleType, types.FunctionType,
                                           types.MethodType, types.BuiltinFunctionType)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        stack.extend(gc.get_referents(o))
    return found


@pytest.mark.parametrize("convert", ["float", "to_dtype", "to_empty"])
def test_conversions_do_not_keep_the_old_tensor_alive(convert):
    m = experts(True)
    m(tokens(), COUNTS)
    old = m.w1._data.untyped_storage()  # held here, so its address cannot be reused meanwhile
    assert any(t.untyped_storage().data_ptr() == old.data_ptr() for t in _tensors_reachable_from(m) if
               not isinstance(t, MXFP8ExpertWeight))  # precondition: the search finds the weight's storage
    {"float": lambda: m.float(), "to_dtype": lambda: m.to(torch.float32),
     "to_empty": lambda: m.to_empty(device="cpu")}[convert]()
    assert isinstance(m.w1, MXFP8ExpertWeight) and m.w1.dtype == (torch.bfloat16 if convert == "to_empty" else torch.float32)
    held = [t for t in _tensors_reachable_from(m) if not isinstance(t, MXFP8ExpertWeight)
            and t.untyped_storage().data_ptr() == old.data_ptr()]
    assert not held, "the converted model still holds the pre-conversion tensor"


@pytest.mark.parametrize("new_cfg", [dict(cache_quantized_weights=False), dict(cache_quantized_weights=True, scale_mode="floor")])
def test_requantize_frees_the_cached_operands(new_cfg):
    m = experts(True)
    x = tokens().requires_grad_()
    m(x, COUNTS).float().sum().backward()
    assert all(len(c) == 2 for c in caches(m))  # precondition: fwd and dgrad operands cached
    quantize_(m, MXFP8MoEConfig(**new_cfg), filter_fn=lambda mod, fqn: True)
    assert all(len(c) == 0 for c in caches(m))
    ref = experts(False)
    quantize_(ref, MXFP8MoEConfig(**new_cfg), filter_fn=lambda mod, fqn: True)
    assert torch.equal(bits(m(x, COUNTS)), bits(ref(x, COUNTS)))


def test_torch_func_bypasses_the_cache():
    m, ref = experts(True), experts(False)
    x = tokens()
    params = dict(m.named_parameters())

    def loss(p):
        return torch.func.functional_call(m, p, (x, COUNTS)).float().pow(2).mean()

    g = torch.func.grad(loss)(params)
    assert all(len(c) == 0 for c in caches(m))  # nothing computed under the transform was kept
    assert torch.equal(bits(m(x, COUNTS)), bits(ref(x, COUNTS)))
    ref(x, COUNTS).float().pow(2).mean().backward()
    for n, p in ref.named_parameters():  # the transform's elementwise bf16 roundings may differ by an ulp
        torch.testing.assert_close(g[n], p.grad, rtol=0.05, atol=1e-7)


def test_stale_entries_are_dropped_at_the_next_use():
    m = experts(True)
    x = tokens()
    m(x, COUNTS)
    with torch.no_grad():
        m.w1.mul_(2)
    assert len(m.w1._weight_cache) == 0  # the write dropped them
    m(x, COUNTS)
    assert len(m.w1._weight_cache) == 1


def _child_sums(q, out):
    w = q.get()
    out.put((type(w).__name__, float(w.detach().float().sum()), w.is_shared()))


def test_share_memory_and_a_multiprocessing_queue():
    m = experts(True)
    m.share_memory()
    assert m.w1.is_shared() and isinstance(m.w1, MXFP8ExpertWeight)
    loaded = ForkingPickler.loads(ForkingPickler.dumps(m.w1))
    assert isinstance(loaded, MXFP8ExpertWeight) and isinstance(loaded, nn.Parameter)
    assert torch.equal(loaded.detach(), m.w1.detach()) and loaded.config == m.w1.config
    ctx = torch.multiprocessing.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child_sums, args=(q, out))
    p.start()
    q.put(m.w1)
    name, total, shared = out.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert name == "MXFP8ExpertWeight" and shared
    assert total == pytest.approx(float(m.w1.detach().float().sum()), rel=1e-6)


def test_pickle_round_trip_keeps_parameter_and_config():
    m = experts(True)
    w = pickle.loads(pickle.dumps(m.w1))
    assert isinstance(w, MXFP8ExpertWeight) and isinstance(w, nn.Parameter) and w.requires_grad
    assert torch.equal(w.detach(), m.w1.detach()) and w.config == m.w1.config
    assert w._weight_cache is not m.w1._weight_cache


def test_demo_task_with_cache_matches_uncached():
    """The issue's end-to-end symptom: a small MoE trained with two micro-batches per step lands on the
    same weights with and without the cache."""
    torch.manual_seed(0)
    base = MoE(dim=64, hidden_dim=96, num_experts=4, top_k=2).bfloat16()
    runs = {}
    for cached in (False, True):
        m = copy.deepcopy(base)
        quantize_(m, MXFP8MoEConfig(cache_quantized_weights=cached), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            for _ in range(2):
                m(torch.randn(2, 16, 64, generator=g).bfloat16()).float().pow(2).mean().backward()
            opt.step()
        runs[cached] = m
    assert not torch.equal(runs[True].experts.w1.detach(), base.experts.w1.detach())
    for (n, p), (_, q) in zip(runs[True].named_parameters(), runs[False].named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n
