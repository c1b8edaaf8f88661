"""reuse_quantized_weights: inside the scope each expert weight is quantized once for all micro-batches;
results equal quantizing every time, bit for bit, whatever happens to the weights between uses that a version
counter sees; on exit a weight whose operands were reused and that then changed raises."""

import contextlib
import copy
import threading

import pytest
import torch
from conftest import spy_on
from torchao.quantization import quantize_

import moe_quant.autograd.grouped_mm as gm
from moe_quant import reuse
from moe_quant import MXFP8MoEConfig, mxfp8_grouped_mm, reuse_quantized_weights
from moe_quant.moe import GroupedExperts, TinyMoEModel

EXPERTS = lambda mod, fqn: isinstance(mod, GroupedExperts)  # noqa: E731


def model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = TinyMoEModel(32, 64, 64, 4, 2, 2, 16).to(dtype)
    quantize_(m, MXFP8MoEConfig(), filter_fn=EXPERTS)
    return m


def micro_batches(n=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(48, 32, generator=g).to(dtype) for _ in range(n)]


@pytest.fixture
def weight_quantizations(monkeypatch):
    """How often a weight operand is made (a quantization of a 3-D weight: the emulated GEMM's bf16 operand, or the
    fp8 one a reuse scope keeps)."""
    calls = spy_on(monkeypatch, gm.q, "fake_3d")
    monkeypatch.setattr(gm.q, "scaled_3d", lambda *a, _real=gm.q.scaled_3d, **k: calls.append(a) or _real(*a, **k))
    return calls


def accumulate(m, xs, reuse, hold=reuse.DEFAULT_HOLD):
    if reuse:
        with reuse_quantized_weights(m, hold=hold) as scope:
            for x in xs:
                m(x).float().pow(2).mean().backward()
        return scope
    for x in xs:
        m(x).float().pow(2).mean().backward()
    return None


# each optimizer with one of the holds (every hold with two of them)
@pytest.mark.parametrize("opt, hold", [("sgd", "bf16-fwd"), ("adamw_forloop", "fp8"), ("adamw_foreach", "bf16"),
                                       ("adamw_fused", "bf16-fwd"), ("sgd", "fp8"), ("adamw_fused", "bf16")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_master"])
def test_gradient_accumulation_with_optimizer_steps_equals_no_reuse(opt, hold, dtype, weight_quantizations):
    ref, m = model(dtype), model(dtype)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adamw_forloop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
        "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    }[opt]
    opt_ref, opt_m = make(ref.parameters()), make(m.parameters())
    for step in range(2):
        xs = micro_batches(3, dtype)
        n0 = len(weight_quantizations)
        accumulate(ref, xs, reuse=False)
        n_plain = len(weight_quantizations) - n0
        scope = accumulate(m, xs, reuse=True, hold=hold)
        n_reuse = len(weight_quantizations) - n0 - n_plain
        if hold == "bf16-fwd":  # the forward operands once per step, the dgrad ones (half of them) per micro-batch
            assert n_reuse * 3 == n_plain // 2 + 3 * n_plain // 2 and n_plain > 0
        else:
            assert n_reuse * 3 == n_plain > 0  # once per step, not once per micro-batch
        assert scope.hits > 0 and not scope.served  # operands freed on exit
        for (n, p), q in zip(ref.named_parameters(), m.parameters()):
            assert torch.equal(p.grad, q.grad), (step, n)
        opt_ref.step()
        opt_m.step()
        opt_ref.zero_grad()
        opt_m.zero_grad()
        for p, q in zip(ref.parameters(), m.parameters()):
            assert torch.equal(p, q)


def run(m, x):
    """One micro-batch: the output and the input gradient (its dgrad reads the served weight operands)."""
    x = x.clone().requires_grad_()
    out = m(x)
    out.float().pow(2).mean().backward()
    return out, x.grad


def fresh(m, x):
    """``run`` on a copy of ``m`` as it is now: new parameters, which no scope serves."""
    return run(copy.deepcopy(m), x)


def same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want))


def scaled(m, factor=0.5):
    """A copy of ``m`` with every parameter scaled (an EMA's weights, for the tests: other values)."""
    other = copy.deepcopy(m)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(factor)
    return other


def _swap_data(m, other):
    saved = [p.data for p in m.parameters()]
    for p, q in zip(m.parameters(), other.parameters()):
        p.data = q.data

    def undo():
        for p, d in zip(m.parameters(), saved):
            p.data = d
    return undo


def _swap_set(m, other):
    saved = [p.detach() for p in m.parameters()]
    for p, q in zip(m.parameters(), other.parameters()):
        p.set_(q.detach())

    def undo():
        for p, d in zip(m.parameters(), saved):
            p.set_(d)
    return undo


def _swap_copy(m, other):
    saved = [p.detach().clone() for p in m.parameters()]
    for p, q in zip(m.parameters(), other.parameters()):
        p.copy_(q)

    def undo():
        for p, d in zip(m.parameters(), saved):
            p.copy_(d)
    return undo


def _swap_vector(m, other):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    saved = parameters_to_vector(m.parameters())
    vector_to_parameters(parameters_to_vector(other.parameters()), m.parameters())
    return lambda: vector_to_parameters(saved, m.parameters())


def _swap_state_dict(m, other):
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(other.state_dict())
    return lambda: m.load_state_dict(saved)


def _swap_tensors(m, other):
    pairs = list(zip(m.parameters(), other.parameters()))
    for p, q in pairs:
        torch.utils.swap_tensors(p, q)

    def undo():
        for p, q in pairs:
            torch.utils.swap_tensors(p, q)
    return undo


def _swap_parameters(m, other):
    names = [n for n, _ in m.named_parameters()]
    saved = dict(m.named_parameters())

    def put(params):
        for n in names:
            owner, _, leaf = n.rpartition(".")
            setattr(m.get_submodule(owner), leaf, params[n])

    put(dict(other.named_parameters()))
    return lambda: put(saved)


SWAPS = {"data": _swap_data, "set_": _swap_set, "copy_": _swap_copy, "vector_to_parameters": _swap_vector,
         "load_state_dict": _swap_state_dict, "swap_tensors": _swap_tensors, "new_parameters": _swap_parameters}


@pytest.mark.parametrize("swap", list(SWAPS))
def test_weights_swapped_in_and_back_inside_the_scope_are_served_their_own_operands(swap):
    """Issue 32 item 5: EMA evaluation inside the scope. Every forward computes with the weights it
    holds then, bit for bit (the swapped-in ones quantized anew, the training ones served again after
    the swap back); the bytes of every reused weight are unchanged on exit, so no error."""
    m = model()
    xs = micro_batches(3)
    ema = scaled(m)
    want_ema = fresh(ema, xs[1])
    want = [fresh(m, x) for x in xs]
    assert not torch.equal(want_ema[0], fresh(m, xs[1])[0])  # a stale operand would show
    with reuse_quantized_weights(m) as scope:
        assert same(run(m, xs[0]), want[0]) and same(run(m, xs[1]), want[1])
        assert scope.hits > 0  # the training weights' operands were reused before the swap
        with torch.no_grad():
            undo = SWAPS[swap](m, ema)
        assert same(run(m, xs[1]), want_ema)
        with torch.no_grad():
            undo()
        assert same(run(m, xs[2]), want[2])


COUNTED = {  # writes the version counter of the weight sees
    "optimizer_step": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).step(),
    "state_dict": lambda m: m.state_dict()["layers.1.moe.experts.w2"].add_(1),
    "copy_into_a_view": lambda m: m.layers[0].moe.experts.w1[1].copy_(m.layers[0].moe.experts.w1[0]),
    "data_assignment": lambda m: setattr(m.layers[0].moe.experts.w3, "data", m.layers[0].moe.experts.w3.data * 2),
}


@pytest.mark.parametrize("after_reuse", [False, True], ids=["before_reuse", "after_reuse"])
@pytest.mark.parametrize("write", list(COUNTED))
def test_a_write_the_version_counter_sees_is_seen_at_the_next_use(write, after_reuse):
    """The next use quantizes again (results equal quantizing every time). On exit: no error where no
    operand of the changed bytes was reused before the change; an error where one was (an unseen write
    before the change could not be told apart) -- except new storage, whose old bytes are unchanged."""
    m = model()
    xs = micro_batches(3)
    raises = after_reuse and write != "data_assignment"
    with pytest.raises(RuntimeError, match="by an in-place write its version counter saw") if raises else contextlib.nullcontext():
        with reuse_quantized_weights(m) as scope:
            for x in xs[:1 + after_reuse]:
                run(m, x)
            assert (scope.hits > 0) == after_reuse
            before = fresh(m, xs[2])
            with torch.no_grad():
                COUNTED[write](m)
            now = fresh(m, xs[2])
            assert not torch.equal(before[0], now[0])  # the write changed the result
            assert same(run(m, xs[2]), now)


UNSEEN = {  # writes through an alias with its own version counter
    "data": lambda m: m.layers[0].moe.experts.w1.data.mul_(2),
    "numpy": lambda m: m.layers[1].moe.experts.w2.detach().view(torch.int16).numpy().__iadd__(1),
}


@pytest.mark.parametrize("write", list(UNSEEN))
def test_a_write_no_version_counter_sees_raises_on_exit(write):
    m = model()
    xs = micro_batches(2)
    with pytest.raises(RuntimeError, match=r"1 weight\(s\) it served changed inside the scope after their quantized "
                                           r"operands had been reused: through a write no version counter saw"):
        with reuse_quantized_weights(m):
            run(m, xs[0])
            with torch.no_grad():
                UNSEEN[write](m)
            run(m, xs[1])  # the documented limitation: stale operands, named on exit


def test_an_exception_inside_the_scope_propagates_unchanged():
    m = model()
    with pytest.raises(KeyError, match="mine"):
        with reuse_quantized_weights(m):
            m(micro_batches(1)[0])
            m.layers[0].moe.experts.w1.data.mul_(2)  # would fail the check; the user's error wins
            raise KeyError("mine")


def test_func_and_inference_mode_are_not_served():
    m = model()
    x = micro_batches(1)[0]
    with reuse_quantized_weights(m) as scope:
        with torch.inference_mode():
            m(x)
            m(x)
        params = dict(m.named_parameters())
        torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).float().sum())(
            {n: p.detach() for n, p in params.items()})
    assert scope.hits == 0 and scope.misses == 0


def test_compile_is_not_served():
    m = model()
    x = micro_batches(1)[0]
    compiled = torch.compile(copy.deepcopy(m), backend="aot_eager", fullgraph=True)
    with reuse_quantized_weights(compiled) as scope:
        compiled(x).float().sum().backward()
        compiled(x).float().sum().backward()
    assert scope.hits == 0


def direct_problem():
    g = torch.Generator().manual_seed(2)
    return torch.randn(80, 96, generator=g).bfloat16(), torch.tensor([17, 17, 50, 80], dtype=torch.int32)


def gemm(a, w, offs):
    return mxfp8_grouped_mm(a, w.transpose(-2, -1), offs)


def test_direct_calls_on_weight_views():
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16, requires_grad=True)
    a, offs = direct_problem()
    ref = gemm(a, w, offs)
    with reuse_quantized_weights([w]) as scope:
        outs = [gemm(a, w, offs) for _ in range(3)]
        mxfp8_grouped_mm(a, w[:2].transpose(-2, -1), offs[:2].clamp(max=50))  # another view: its own operand
    assert all(torch.equal(o, ref) for o in outs)
    assert scope.hits == 2 and scope.misses == 2


def test_weights_that_are_views_of_one_buffer_are_served():
    """Issue 32 item 13: their root is the buffer, which is what a GEMM's view of them resolves to."""
    torch.manual_seed(0)
    buf = torch.randn(2, 4, 64, 96, dtype=torch.bfloat16)
    a, offs = direct_problem()
    want = [gemm(a, buf[i].clone(), offs) for i in range(2)]
    with reuse_quantized_weights([buf[0], buf[1]]) as scope:
        for _ in range(3):
            assert all(torch.equal(gemm(a, buf[i], offs), want[i]) for i in range(2))
    assert scope.misses == 2 and scope.hits == 4


def test_a_write_through_the_buffer_of_view_weights_is_seen_at_the_next_use():
    """A parameter made from a view shares the buffer's storage and version counter (it is no view): a write
    through the buffer is seen by both weights' next use."""
    torch.manual_seed(0)
    buf = torch.randn(2, 4, 64, 96, dtype=torch.bfloat16)
    w0 = torch.nn.Parameter(buf[0])
    a, offs = direct_problem()
    with reuse_quantized_weights([w0, buf[1]]) as scope:
        before = [gemm(a, w0, offs), gemm(a, buf[1], offs)]
        with torch.no_grad():
            buf.mul_(2)
        now = [gemm(a, w0, offs), gemm(a, buf[1], offs)]
        assert scope.misses == 4 and scope.hits == 0
    assert not any(torch.equal(b, n) for b, n in zip(before, now))
    assert torch.equal(now[0], gemm(a, buf[0].clone(), offs)) and torch.equal(now[1], gemm(a, buf[1].clone(), offs))


def on_threads(*fns):
    """Run each of ``fns`` on its own thread; re-raise the first error one raised."""
    errors = []

    def body(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised on the calling thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_a_thread_that_did_not_enter_the_scope_is_not_served():
    """Issue 32 item 6: another thread writes the weight (through ``.data``: no version counter sees it)
    while this thread's scope is open, and computes with it: from its bytes, never this scope's operands."""
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16)
    a, offs = direct_problem()
    entered, done = threading.Event(), threading.Event()
    other = {}

    def writer():
        assert entered.wait(300)
        w.data.mul_(2)
        other["got"], other["want"] = gemm(a, w, offs), gemm(a, w.clone(), offs)
        done.set()

    def owner():
        with pytest.raises(RuntimeError, match="changed inside the scope"):  # this scope reused w, then it changed
            with reuse_quantized_weights([w]) as scope:
                before = gemm(a, w, offs), gemm(a, w, offs)
                entered.set()
                assert done.wait(300)
                other["counts"] = scope.hits, scope.misses
        other["before"] = before

    on_threads(owner, writer)
    assert not torch.equal(other["before"][0], other["want"])  # the write changed the result
    assert torch.equal(other["got"], other["want"])
    assert other["counts"] == (1, 1)  # the writer's calls were not this scope's


def test_the_backward_of_a_forward_inside_the_scope_is_served_on_another_thread():
    """On CUDA the autograd engine runs backward on its device threads: a forward's scopes travel to its
    backward (here: backward called from another thread, which the CPU engine runs it on)."""
    m = model()
    xs = micro_batches(2)
    want = fresh(m, xs[1])
    with reuse_quantized_weights(m, hold="fp8") as scope:  # both operands held: the dgrad ones served too
        run(m, xs[0])
        x = xs[1].clone().requires_grad_()
        out = m(x)
        assert scope.hits == 6  # the forward operands of w1, w3, w2 in two layers
        on_threads(lambda: out.float().pow(2).mean().backward())
        assert scope.hits == 12  # and their dgrad operands
    assert same((out, x.grad), want)


def test_scopes_on_two_threads_at_once_serve_their_own_thread():
    m = model()
    xs = micro_batches(3)
    want = [fresh(m, x) for x in xs]
    both_open = threading.Barrier(2, timeout=300)
    got = {}

    def worker(i):
        with reuse_quantized_weights(m, hold="fp8") as scope:
            both_open.wait()
            outs = [run(m, x) for x in xs]
            both_open.wait()
        got[i] = outs, scope.hits, scope.misses

    on_threads(lambda: worker(0), lambda: worker(1))
    for outs, hits, misses in got.values():
        assert all(same(o, w) for o, w in zip(outs, want))
        assert (hits, misses) == (24, 12)


def test_nested_scopes_the_innermost_that_holds_the_weight_serves():
    m = model()
    xs = micro_batches(3)
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16)
    a, offs = direct_problem()
    with reuse_quantized_weights(m, hold="fp8") as outer:  # both operands held (bf16-fwd: the next test)
        run(m, xs[0])
        with reuse_quantized_weights([w], hold="fp8") as inner:
            run(m, xs[1])  # the outer scope holds m's weights
            gemm(a, w, offs), gemm(a, w, offs)
            with reuse_quantized_weights(m, hold="fp8") as innermost:
                run(m, xs[2])
        assert (outer.hits, outer.misses) == (12, 12)
        assert (inner.hits, inner.misses) == (1, 1) and (innermost.hits, innermost.misses) == (0, 12)
        with torch.inference_mode(), reuse_quantized_weights([w]):  # where nothing is served: the outer stays
            gemm(a, w, offs)
        assert same(run(m, xs[2]), fresh(m, xs[2]))
    assert (outer.hits, outer.misses) == (24, 12)


def test_a_bf16_fwd_scope_makes_the_dgrad_operand_at_each_use_never_from_an_outer_scope(weight_quantizations):
    """``hold="bf16-fwd"`` (the default): the forward operands are served, the dgrad operands made at each backward,
    also on another thread (the engine's device thread on CUDA), and never taken from an outer scope that holds
    them: the innermost scope that holds the weight decides. The same bits as without a scope."""
    m = model()
    xs = micro_batches(3)
    want = [fresh(m, x) for x in xs]
    with reuse_quantized_weights(m, hold="fp8") as outer:
        got0 = run(m, xs[0])  # the outer scope makes both operands of w1, w3, w2 in two layers
        with reuse_quantized_weights(m) as inner:
            assert inner.hold == "bf16-fwd"
            n0 = len(weight_quantizations)
            got1 = run(m, xs[1])
            x = xs[2].clone().requires_grad_()
            out = m(x)  # the forward operands served
            n1 = len(weight_quantizations)
            on_threads(lambda: out.float().pow(2).mean().backward())
            n2 = len(weight_quantizations)
        assert (inner.hits, inner.misses) == (6, 6)  # the forward operands: made once, served once
        assert n1 - n0 == 12 and n2 - n1 == 6  # the dgrad operands: made at each backward
        assert (outer.hits, outer.misses) == (0, 12)  # nothing taken from the outer scope
    assert same(got0, want[0]) and same(got1, want[1]) and same((out, x.grad), want[2])


def test_a_compiled_forward_inside_the_scope_is_not_served_and_sees_writes():
    m = model()
    xs = micro_batches(2)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)  # the same parameters
    # on exit: w1's operands were reused, then w1 written (through its version counter)
    with pytest.raises(RuntimeError, match=r"by an in-place write its version counter saw .*, shapes \(4, 64, 64\)"):
        with reuse_quantized_weights(m) as scope:
            run(m, xs[0]), run(m, xs[0])
            counts = scope.hits, scope.misses
            assert same(run(compiled, xs[1]), fresh(m, xs[1]))
            with torch.no_grad():
                m.layers[0].moe.experts.w1.mul_(2)
            assert same(run(compiled, xs[1]), fresh(m, xs[1]))
            assert (scope.hits, scope.misses) == counts
            assert same(run(m, xs[1]), fresh(m, xs[1]))


def test_a_weight_whose_storage_is_freed_inside_the_scope_is_named_on_exit():
    """FSDP2 frees unsharded weights with ``untyped_storage().resize_(0)``: the exit check names such a
    weight instead of reading freed bytes."""
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16)
    a, offs = direct_problem()
    with pytest.raises(RuntimeError, match=r"through a write no version counter saw .*, shapes \(4, 64, 96\)"):
        with reuse_quantized_weights([w]):
            gemm(a, w, offs), gemm(a, w, offs)
            w.untyped_storage().resize_(0)


@pytest.mark.parametrize("bad", [3, torch.zeros(2), [torch.zeros(2), "w"]])
def test_bad_argument(bad):
    with pytest.raises(TypeError, match="model must be"):
        with reuse_quantized_weights(bad):
            pass


def test_exit_fingerprints_each_reused_weight_again_and_names_only_the_changed_one(monkeypatch):
    import moe_quant.reuse as reuse

    calls = spy_on(monkeypatch, reuse, "fingerprint")
    m = model()
    with pytest.raises(RuntimeError, match=r"reuse_quantized_weights: 1 weight\(s\) it served changed"):
        with reuse_quantized_weights(m) as scope:
            for x in micro_batches(2):
                m(x).float().sum().backward()
            served = len(scope.served)
            assert len(calls) == served  # at first use only
            with torch.no_grad():
                m.layers[1].moe.experts.w2.data.add_(1)  # one weight, through an alias: only the bytes tell
    assert served == 6 and len(calls) == 2 * served  # w1, w3, w2 of two layers: once more each on exit


def test_exit_reads_no_weight_whose_operands_were_not_reused(monkeypatch):
    import moe_quant.reuse as reuse

    calls = spy_on(monkeypatch, reuse, "fingerprint")
    m = model()
    with reuse_quantized_weights(m) as scope:
        run(m, micro_batches(1)[0])
        assert scope.hits == 0 and len(calls) == len(scope.served) == 6  # at first use
        with torch.no_grad():
            m.layers[1].moe.experts.w2.data.add_(1)  # nothing made from the old bytes is used again
    assert len(calls) == 6


@pytest.mark.parametrize("hold", ["bf16-fwd", "fp8", "bf16"])
def test_the_scope_holds_each_weight_operand_once_in_the_form_it_says(hold, weight_quantizations):
    """What a scope holds (emulated GEMM), per weight: its forward operand alone as the bf16 values the GEMM reads
    (2 E N K bytes, ``hold="bf16-fwd"``, the default); its forward and dgrad operands, each once, as fp8 data and plain
    e8m0 scales (E N K + E N K / 32 bytes each, ``hold="fp8"``) or as the dequantized bf16 operands (2 E N K bytes
    each, ``hold="bf16"``); nothing else but the weight's own storage. Either way the gradients equal quantizing
    every time, bit for bit."""
    ref, m = model(), model()
    xs = micro_batches(3)
    accumulate(ref, xs, reuse=False)
    weights = {p.untyped_storage().data_ptr(): p for p in m.parameters() if p.dim() == 3}
    with reuse_quantized_weights(m, hold=hold) as scope:
        for x in xs:
            m(x).float().pow(2).mean().backward()
        assert scope.hits > 0 and len(scope.served) == len(weights)  # each weight view once
        for source in scope.served.values():
            w = weights[source.view.untyped_storage().data_ptr()]
            assert source.view.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # a view, no copy
            gemms = ["fwd"] if hold == "bf16-fwd" else ["dgrad", "fwd"]
            assert sorted(k[1] for k in source.operands) == gemms, source.operands.keys()
            n = w.numel()
            for kind, op in source.operands.items():
                tensors = op if isinstance(op, tuple) else (op,)
                held = sum(t.untyped_storage().nbytes() for t in tensors)
                if hold == "fp8":
                    assert [t.dtype for t in tensors] == [torch.float8_e4m3fn, torch.float8_e8m0fnu], kind
                    assert held == n + n // 32, (kind, held, n)
                else:
                    assert tensors[0].dtype == torch.bfloat16 and held == 2 * n, (kind, held, n)
    for p, q in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_hold_is_checked():
    with pytest.raises(ValueError, match="hold must be one of"):
        with reuse_quantized_weights(model(), hold="fp16"):
            pass
