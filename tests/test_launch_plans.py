"""The quantize ops' eager launch path on CPU tensors, compiling and launching stubbed (issue 57, host time): the
per-shape plans (``compile_cache.plan``) against the plain computation (the ops' fake implementations, the variant
built from the arguments), and what one call costs in Python calls into moe_quant and in torch ops."""

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moe_quant.kernels import compile_cache as cc
from moe_quant.numerics import ScaleMode
from moe_quant.kernels.permute import config as config_permute
from moe_quant.kernels.permute import ops as ops_permute
from moe_quant.kernels.quantize_1x32 import config as config_1x32
from moe_quant.kernels.quantize_1x32 import ops as ops_1x32
from moe_quant.kernels.quantize_32x1 import config as config_32x1
from moe_quant.kernels.quantize_32x1 import ops as ops_32x1

NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn"}


class Kernel:
    """A compiled kernel's stand-in: its ``call`` (what the ops launch) records ``(variant, tensors)``."""

    def __init__(self, variant, log):
        self.variant, self.log = variant, log

    def call(self, *tensors):
        self.log.append((self.variant, tensors))


class Stubs:
    """Each launch records ``(variant, tensors)``: ``get_kernel`` returns a :class:`Kernel` of the variant."""

    def __init__(self, monkeypatch):
        self.log = []
        monkeypatch.setattr(cc, "_FAST", {})
        monkeypatch.setattr(cc, "arch", lambda device: "sm_90a")
        monkeypatch.setattr(cc, "get_kernel", lambda variant, arch: Kernel(variant, self.log))
        for mod, names in ((ops_1x32, ["_PLANS"]), (ops_32x1, ["_K_GROUPS_PLANS", "_3D_PLANS"]),
                           (ops_permute, ["_PLANS"])):
            for name in names:
                monkeypatch.setattr(mod, name, {})
        monkeypatch.setattr(cc, "CPU_STUBS", True)  # the public functions' CUDA test takes these CPU tensors

    def launched(self):
        """The variant and tensors of the call just made (None if it launched nothing); the log is emptied."""
        got = self.log[-1] if self.log else None
        self.log.clear()
        return got


@pytest.fixture
def stubs(monkeypatch):
    return Stubs(monkeypatch)


def fresh_stubs():
    """``Stubs`` with empty plans, undone on exit (one per hypothesis example)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with pytest.MonkeyPatch.context() as mp:
            yield Stubs(mp)

    return ctx()


def same_form(got, want):
    """Outputs of the same shapes and dtypes (``want``: the fake implementation's, on the meta device)."""
    got, want = [t for t in got if t is not None], [t for t in want if t is not None]
    assert [(tuple(t.shape), t.dtype) for t in got] == [(tuple(t.shape), t.dtype) for t in want]


def meta(t):
    return None if t is None else t.to("meta")


def launched_as_planned(stubs, got, want, launches, variant):
    """The call's outputs have the fake implementation's forms (``want``), it launched iff ``launches``, and the
    kernel of ``variant``: the tensors it launched with (None if it launched nothing)."""
    same_form(got, want)
    launched = stubs.launched()
    assert (launched is not None) == launches
    if not launches:
        return None
    kernel, tensors = launched
    assert kernel == variant
    return tensors


# small domains, so that calls of one example share shapes and differ in one argument (what a plan key must hold)
MS = st.sampled_from([0, 1, 64, 130])
DTYPES = st.sampled_from([torch.bfloat16, torch.float32])
MODES = st.sampled_from(["rceil", "floor"])


@given(st.lists(st.tuples(MS, st.sampled_from([32, 64]), st.sampled_from([None, 0, 2, 3]),
                          st.sampled_from(["blocked", "plain", "fake-bf16", "fake-fp32"]), DTYPES, MODES,
                          st.booleans()),
                min_size=1, max_size=12))
def test_1x32_plans_equal_the_plain_computation(calls):
    with fresh_stubs() as stubs:
        _1x32_calls(stubs, calls)


def _1x32_calls(stubs, calls):
    for m, k, g, what, dtype, mode, as_bf16 in calls:
        x = torch.zeros(m, k, dtype=dtype)
        offs = None if g is None else torch.full((g,), m, dtype=torch.int32)
        as_bf16_eff = as_bf16 and dtype == torch.float32
        if what.startswith("fake"):
            out_dtype = torch.bfloat16 if what == "fake-bf16" else torch.float32
            got = (ops_1x32._fake_impl(x, mode, out_dtype, as_bf16),)
            want = (torch.ops.moe_quant.fake_quantize_1x32(meta(x), mode, out_dtype, as_bf16),)
            variant = config_1x32.Variant(NAMES[dtype], mode, "fake", NAMES[out_dtype], as_bf16=as_bf16_eff)
            launches = m * k > 0
        else:
            got = ops_1x32._quantize_impl(x, mode, offs, what, as_bf16)
            want = torch.ops.moe_quant.quantize_1x32(meta(x), mode, meta(offs), what, as_bf16)
            kind = "mgroups" if offs is not None else what
            variant = config_1x32.Variant(NAMES[dtype], mode, kind, "float8_e4m3fn", as_bf16=as_bf16_eff)
            launches = m * k > 0 or got[1].numel() > 0
        tensors = launched_as_planned(stubs, got, want, launches, variant)
        if tensors is not None:
            assert tensors[0].shape == x.shape and tensors[0].dtype == x.dtype and tensors[1] is got[0]
            if len(got) == 2:  # the scales as returned: e8m0, what the kernel is compiled for (no view between)
                assert tensors[2] is got[1] and got[1].dtype == torch.float8_e8m0fnu and tensors[3] is offs


@given(st.lists(st.tuples(MS, st.sampled_from([0, 32, 64]), st.sampled_from([0, 1, 3]),
                          st.sampled_from([torch.float8_e4m3fn, torch.bfloat16, torch.float32]), DTYPES, MODES,
                          st.booleans(), st.booleans()),
                min_size=1, max_size=12))
def test_32x1_plans_equal_the_plain_computation(calls):
    with fresh_stubs() as stubs:
        _32x1_calls(stubs, calls)


def _32x1_calls(stubs, calls):
    for m, r, g, out_dtype, dtype, mode, three_d, as_bf16 in calls:
        fp8 = out_dtype == torch.float8_e4m3fn
        if three_d:  # w (E, N, K): E = g + 1, N = r, K = 32 (m // 32 + 1)
            w = torch.zeros(g + 1, r, 32 * (m // 32 + 1), dtype=dtype)
            got = ops_32x1._quantize_32x1_3d_impl(w, mode, out_dtype, as_bf16)
            want = (torch.ops.moe_quant.quantize_32x1_3d(meta(w), mode, as_bf16) if fp8 else
                    (torch.ops.moe_quant.fake_quantize_32x1_3d(meta(w), mode, out_dtype, as_bf16), None))
            variant = config_32x1.Variant(NAMES[dtype], mode, "uniform", NAMES[out_dtype],
                                          as_bf16=as_bf16 and dtype == torch.float32)
            launches, first = w.numel() > 0, w
        else:
            x = torch.zeros(m, r, dtype=dtype)
            offs = torch.full((g,), m, dtype=torch.int32)
            got = ops_32x1._quantize_32x1_k_groups_impl(x, mode, offs, out_dtype)
            want = (torch.ops.moe_quant.quantize_32x1_k_groups(meta(x), mode, meta(offs)) if fp8 else
                    torch.ops.moe_quant.fake_quantize_32x1_k_groups(meta(x), mode, meta(offs), out_dtype))
            variant = config_32x1.Variant(NAMES[dtype], mode, "kgroups", NAMES[out_dtype])
            launches, first = got[0].numel() > 0, x
        tensors = launched_as_planned(stubs, got, want, launches, variant)
        if tensors is not None:
            assert tensors[0].dtype == first.dtype and tensors[0].numel() == first.numel() and tensors[1] is got[0]
            assert tensors[2] is got[1] and (got[1] is None or got[1].dtype == torch.float8_e8m0fnu)
            assert (tensors[2] is None) == (not fp8)


@given(st.lists(st.tuples(MS, st.sampled_from([0, 32, 64]), st.sampled_from([(1, 1), (2, 3), (1, 2)]),
                          st.sampled_from(["blocked", "plain", "dequant-bf16", "dequant-fp32"]), st.booleans()),
                min_size=1, max_size=12))
def test_permute_plans_equal_the_plain_computation(calls):
    with fresh_stubs() as stubs:
        _permute_calls(stubs, calls)


def _permute_calls(stubs, calls):
    for m, k, (ranks, experts), what, scale_bytes in calls:
        data = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
        scales = torch.zeros(m, k // 32, dtype=torch.uint8 if scale_bytes else torch.float8_e8m0fnu)
        counts = torch.zeros(ranks, experts, dtype=torch.int32)
        out, out_dtype = (what, torch.bfloat16) if not what.startswith("dequant") else (
            "dequant", torch.bfloat16 if what == "dequant-bf16" else torch.float32)
        got = ops_permute.permute_mxfp8(data, scales, counts, out, out_dtype)
        want = torch.ops.moe_quant.permute_mxfp8(meta(data), meta(scales), meta(counts), out, out_dtype)
        variant = config_permute.Variant(out, NAMES[out_dtype] if out == "dequant" else "float8_e4m3fn")
        tensors = launched_as_planned(stubs, got, want, m * k > 0, variant)
        if tensors is not None:
            # the dtypes the kernel is compiled for: e4m3 / e8m0 in (byte scales viewed), out as returned
            assert tensors[0] is data and tensors[1].data_ptr() == scales.data_ptr()
            assert tensors[1].dtype == torch.float8_e8m0fnu and tensors[3] is got[0]
            assert tensors[4] is (None if out == "dequant" else got[1])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is not torch.ops.aten.detach:  # what a view shows under a dispatch mode
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def cost(fn):
    """``(Python calls into moe_quant, torch ops)`` of one warm call of ``fn``."""
    fn()
    calls = []

    def profile(frame, event, arg):
        if event == "call" and "moe_quant" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    with _Ops() as mode:
        fn()
    return calls, mode.ops


# (Python calls into moe_quant, torch ops) one call may cost: one allocation per output (no view: the kernels take
# e4m3 / e8m0 tensors as they are returned), the public checks of the hot path (one function: x and offs, each read
# once), one plan lookup (the plan holds the kernel) and the kernel's own call (no launch helper between)
BUDGETS = {
    "quantize_1x32": (5, ["empty", "empty"]),
    "quantize_32x1_k_groups": (5, ["empty", "empty", "empty"]),
    "permute_mxfp8": (5, ["empty", "empty", "empty"]),
    "run_quantize_1x32": (4, ["empty", "empty"]),
}


def one_call(name: str):
    """A warm-able call of the op ``name`` on small CPU tensors."""
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32)
    data = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(256, 8, dtype=torch.float8_e8m0fnu)
    counts = torch.tensor([[60, 40], [100, 56]], dtype=torch.int32)
    return {
        "quantize_1x32": lambda: ops_1x32.quantize_1x32(x, "rceil", offs),
        "quantize_32x1_k_groups": lambda: ops_32x1.quantize_32x1_k_groups(x, "rceil", offs),
        "permute_mxfp8": lambda: ops_permute.permute_mxfp8(data, scales, counts, "blocked"),
        "run_quantize_1x32": lambda: ops_1x32.run_quantize_1x32(x, "rceil", offs, "blocked"),  # the autograd entry
    }[name]


@pytest.mark.parametrize("name", list(BUDGETS))
def test_allocations_pass_their_size_by_keyword(stubs, monkeypatch, name):
    """``torch.empty(shape_tuple, ...)`` takes a slower path of torch's argument parser than ``size=shape`` or one
    int (about 1 µs more per allocation on a CPU, 2-3 µs with a ``torch.Size``; ``compile_cache.empty``)."""
    fn = one_call(name)
    fn()
    sizes = []
    real = torch.empty

    def spy(*args, **kwargs):
        sizes.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    fn()
    assert len(sizes) == len(BUDGETS[name][1])  # precondition: every allocation seen
    assert all(args == () or (len(args) == 1 and type(args[0]) is int) for args in sizes), sizes


@pytest.mark.parametrize("name", list(BUDGETS))
def test_one_call_costs_at_most_its_budget(stubs, name):
    py, ops = cost(one_call(name))
    assert stubs.launched() is not None  # precondition: the call reached its launch
    max_py, want_ops = BUDGETS[name]
    assert len(py) <= max_py, f"{name}: {len(py)} Python calls into moe_quant: {py}"
    assert sorted(ops) == sorted(want_ops), f"{name}: torch ops {ops}"


def _outcome(fn, args):
    """What a call did: ``("raised", type, message)``, or ``("returned", output forms, the launched variant and what
    it was passed)``: each tensor as the index of the argument (of ``args``) or output it is, else its form."""
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        return "raised", type(e), str(e)
    outs = [t for t in (got if isinstance(got, tuple) else (got,)) if t is not None]
    launched = fn.launched()

    def which(t):
        for name, group in (("arg", args), ("out", outs)):
            for i, u in enumerate(group):
                if t is u:
                    return name, i
        return None if t is None else ("other", tuple(t.shape), t.stride(), t.dtype)

    forms = [(tuple(t.shape), t.dtype) for t in outs]
    return "returned", forms, launched and (launched[0], [which(t) for t in launched[1]])


class _Sub(torch.Tensor):
    pass


XS = st.sampled_from(["ok", "fp32", "fp16", "k48", "1d", "3d", "rows0", "strided", "meta", "subclass", "list"])
OFFS = st.sampled_from(["none", "ok", "int64", "2d", "meta", "list"])


def _x_arg(kind):
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    return {"ok": x, "fp32": x.float(), "fp16": x.half(), "k48": x[:, :48].contiguous(), "1d": x[0],
            "3d": x.view(2, 32, 64), "rows0": x[:0], "strided": x.t(), "meta": x.to("meta"),
            "subclass": x.as_subclass(_Sub), "list": [[0.0] * 64]}[kind]


def _offs_arg(kind):
    offs = torch.tensor([30, 64], dtype=torch.int32)
    return {"none": None, "ok": offs, "int64": offs.long(), "2d": offs.view(1, 2), "meta": offs.to("meta"),
            "list": [30, 64]}[kind]


@given(XS, OFFS, st.sampled_from(["rceil", "floor", "RCEIL", ScaleMode.FLOOR, "bogus", 3]),
       st.sampled_from(["blocked", "plain", "bogus"]))
def test_public_hot_path_checks_equal_the_full_checks(x_kind, offs_kind, mode, scale_layout):
    """The public ops' hot path (each argument's properties read once, no check function called) against their full
    checks (the hot path made to answer None, so every call takes the checks): the same error for each bad argument,
    the same outputs and launch for good ones."""
    x, offs = _x_arg(x_kind), _offs_arg(offs_kind)
    calls = [lambda: ops_1x32.quantize_1x32(x, mode, offs, scale_layout)]
    if scale_layout == "blocked":  # (the 32x1 op has no layout argument: once per example)
        calls.append(lambda: ops_32x1.quantize_32x1_k_groups(x, mode, offs))
    for call in calls:
        outcomes = []
        for hot in (True, False):
            with fresh_stubs() as stubs, pytest.MonkeyPatch.context() as mp:
                if not hot:
                    mp.setattr(ops_1x32, "_hot_path", lambda *args: None)
                    mp.setattr(ops_32x1, "_hot_path", lambda *args: None)
                call.launched = stubs.launched
                outcomes.append(_outcome(call, (x, offs)))
        hot_path, checks = outcomes
        assert hot_path == checks, (x_kind, offs_kind, mode, scale_layout)
    if x_kind == offs_kind == "ok" and mode == "rceil" and scale_layout == "blocked":  # precondition: good ones launch
        assert checks[0] == "returned" and checks[2] is not None
