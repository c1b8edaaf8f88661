"""Measure the candidate ways of converting a user's own experts module (docs/design.md section 8.2).

    python scripts/probes/own_forward_probe.py          # CPU is enough; prints one table

The module (``OwnExperts``) is what users write: three 3-D parameters and a SwiGLU forward that calls
``F.grouped_mm`` and ``torch._grouped_mm`` itself, with no ``_grouped_mm(self, *, A, B_t, offs)`` seam.
Each candidate is a converted subclass whose forward runs the module's own forward and sends its grouped
GEMMs to moe_quant's MXFP8 GEMM (``moe_quant.conversion.gemm.grouped_mm``):

* ``mode``: a ``TorchFunctionMode`` entered inside the converted forward routes every grouped-mm call;
* ``identity``: the same mode, routing only calls whose right operand is one of the module's parameters or
  a view of one (routing by parameter identity);
* ``nonstrict``: ``mode``, the forward wrapped in ``torch._dynamo.nonstrict_trace`` (module as an input);
* ``disabled``: ``mode``, the forward wrapped in ``torch._dynamo.disable`` (a graph break under compile);
* ``seam`` (for comparison): the module written with the seam, converted by overriding it.

Checks (each prints the MXFP8 calls seen, or the error): eager; ``torch.compile`` (aot_eager, inductor;
fullgraph or not; dynamic), with the output's SQNR against the unconverted module (MXFP8 noise is ~25 dB
here, bf16 rounding ~49 dB: a compiled graph that silently runs bf16 shows ~49 dB or inf); ``torch.func.grad``
of ``functional_call``; ``vmap``; FSDP2 (``fully_shard``, one gloo rank); fp32 master weights cast to bf16 in
the forward (``w.bfloat16()``, as torchtitan's forward does); deepcopy / pickle; host time of one eager
forward (CPU: the emulated MXFP8 GEMM dominates it), and the mode's own cost on the unconverted forward.
"""

from __future__ import annotations

import copy
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conversion_design_probe import DIM, HIDDEN, E, counted, fsdp2_calls, inputs, table  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from moe_quant import MXFP8MoEConfig  # noqa: E402
from moe_quant.conversion import gemm  # noqa: E402

CONFIG = MXFP8MoEConfig()  # the design probe counts the MXFP8 calls (moe_quant.autograd.mxfp8_grouped_mm)


class OwnExperts(nn.Module):
    """A user's experts module: its forward calls the grouped-mm ops itself (no seam)."""

    def __init__(self, cast=False):
        super().__init__()
        self.cast = cast
        self.w1 = nn.Parameter(torch.randn(E, HIDDEN, DIM) * 0.05)
        self.w2 = nn.Parameter(torch.randn(E, DIM, HIDDEN) * 0.05)
        self.w3 = nn.Parameter(torch.randn(E, HIDDEN, DIM) * 0.05)

    def weights(self):
        ws = (self.w1, self.w2, self.w3)
        return tuple(w.bfloat16() for w in ws) if self.cast else ws

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = self.weights()
        h = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


class SeamExperts(OwnExperts):
    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = self.weights()
        h = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs)

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)


def _mm_args(args, kwargs):
    a, b = args[0], args[1]
    return a, b, kwargs.get("offs", args[2] if len(args) > 2 else None)


class RouteAll(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            return gemm.grouped_mm(*_mm_args(args, kwargs), CONFIG)
        return func(*args, **kwargs)


class RouteOwnParameters(TorchFunctionMode):
    def __init__(self, module):
        super().__init__()
        self.params = [p for p in module.parameters() if p.ndim == 3]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            a, b, offs = _mm_args(args, kwargs)
            if any(b is p or b._base is p for p in self.params):
                return gemm.grouped_mm(a, b, offs, CONFIG)
        return func(*args, **kwargs)


def _mode_forward(self, x, counts):
    with RouteAll():
        return OwnExperts.forward(self, x, counts)


def _identity_forward(self, x, counts):
    with RouteOwnParameters(self):
        return OwnExperts.forward(self, x, counts)


def _nonstrict_forward(self, x, counts):
    return _nonstrict_routed(self, x, counts)


_nonstrict_routed = torch._dynamo.nonstrict_trace(_mode_forward)
_disabled_routed = torch._dynamo.disable(_mode_forward, reason="own experts forward")


class ModeExperts(OwnExperts):
    forward = _mode_forward


class IdentityExperts(OwnExperts):
    forward = _identity_forward


class NonstrictExperts(OwnExperts):
    forward = _nonstrict_forward


class DisabledExperts(OwnExperts):
    def forward(self, x, counts):
        return _disabled_routed(self, x, counts)


class ConvertedSeamExperts(SeamExperts):
    def _grouped_mm(self, *, A, B_t, offs):
        return gemm.grouped_mm(A, B_t, offs, CONFIG)


CANDIDATES = {"mode": ModeExperts, "identity": IdentityExperts, "nonstrict": NonstrictExperts,
              "disabled": DisabledExperts, "seam": ConvertedSeamExperts}


def make(kind, cast=False):
    torch.manual_seed(0)
    plain = OwnExperts(cast)
    if not cast:
        plain = plain.to(torch.bfloat16)
    conv = copy.deepcopy(plain)
    conv.__class__ = CANDIDATES[kind]
    return plain, conv


def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    err = (ref - x).pow(2).sum()
    return float("inf") if err == 0 else (10 * torch.log10(ref.pow(2).sum() / err)).item()


def _fails(e):
    return f"fails: {type(e).__name__}"


def _tried(fn, done):
    """``done(fn())``, or the failure."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 -- a probe reports failures
        return _fails(e)
    return done(value)


def check_eager(kind):
    plain, m = make(kind)
    x, counts = inputs()
    out = [None]
    n = counted(lambda: out.__setitem__(0, m(x, counts)))
    return f"{n} calls, {sqnr(plain(x, counts), out[0]):.1f} dB"


def _compile(kind, **kw):
    plain, m = make(kind)
    x, counts = inputs()
    eager = m(x, counts)
    torch._dynamo.reset()
    out = [None]

    def done(n):
        same = "= eager" if torch.equal(out[0], eager) else "!= eager"
        return f"{n} calls, {sqnr(plain(x, counts), out[0]):.1f} dB, {same}"

    return _tried(lambda: counted(lambda: out.__setitem__(0, torch.compile(m, **kw)(x, counts))), done)


def check_compile_aot(kind):
    return _compile(kind, backend="aot_eager", fullgraph=True)


def check_compile_inductor(kind):
    return _compile(kind, backend="inductor", fullgraph=True)


def check_compile_dynamic(kind):
    return _compile(kind, backend="aot_eager", fullgraph=True, dynamic=True)


def check_compile_breaks(kind):
    return _compile(kind, backend="aot_eager")


def check_func(kind):
    _, m = make(kind)
    x, counts = inputs()
    params = {n: p.detach() for n, p in m.named_parameters()}
    return _tried(lambda: counted(lambda: torch.func.grad(
        lambda p: torch.func.functional_call(m, p, (x, counts)).float().sum())(params)), lambda n: f"{n} calls")


def check_vmap(kind):
    _, m = make(kind)
    x, counts = inputs()
    return _tried(lambda: counted(lambda: torch.func.vmap(lambda xb: m(xb, counts))(torch.stack([x, x]))),
                  lambda n: f"{n} calls")


def check_fsdp2(kind):
    _, m = make(kind)
    return _tried(lambda: fsdp2_calls(m, *inputs()), lambda n: f"{n} calls (fwd+bwd)")


def check_cast(kind):
    plain, m = make(kind, cast=True)
    x, counts = inputs()
    out = [None]
    return _tried(lambda: counted(lambda: out.__setitem__(0, m(x, counts))),
                  lambda n: f"{n} calls, {sqnr(plain(x, counts), out[0]):.1f} dB")


def check_copies(kind):
    _, m = make(kind)
    x, counts = inputs()
    copies = lambda: (copy.deepcopy(m), pickle.loads(pickle.dumps(m)))  # noqa: E731
    return _tried(lambda: [counted(lambda c=c: c(x, counts)) for c in copies()], lambda ns: f"{ns} calls")


def _host_us(fn):
    with torch.no_grad():
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50):
                fn()
            best = min(best, (time.perf_counter() - t) / 50)
    return best * 1e6


def check_host_time(kind):
    _, m = make(kind)
    x, counts = inputs()
    x, counts = x[:32], torch.tensor([8, 8, 8, 8], dtype=torch.int32)
    return f"{_host_us(lambda: m(x, counts)):.0f} us"


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def mode_overhead() -> str:
    """The routing mode's own host cost: the unconverted forward (bf16 grouped-mm) with and without a mode that
    passes every call through."""
    plain, _ = make("mode")
    x, counts = inputs()
    x, counts = x[:32], torch.tensor([8, 8, 8, 8], dtype=torch.int32)

    def under_mode():
        with PassThrough():
            plain(x, counts)

    bare, moded = _host_us(lambda: plain(x, counts)), _host_us(under_mode)
    return f"unconverted forward {bare:.0f} us, under a pass-through TorchFunctionMode {moded:.0f} us"


CHECKS = {
    "eager": check_eager,
    "compile aot_eager fullgraph": check_compile_aot,
    "compile inductor fullgraph": check_compile_inductor,
    "compile aot_eager fullgraph dynamic": check_compile_dynamic,
    "compile aot_eager (graph breaks allowed)": check_compile_breaks,
    "torch.func.grad(functional_call)": check_func,
    "vmap over a batch of x": check_vmap,
    "FSDP2 fully_shard, 1 rank": check_fsdp2,
    "fp32 masters cast in forward": check_cast,
    "deepcopy / pickle": check_copies,
    "host time of one eager forward (no_grad)": check_host_time,
}


def main() -> int:
    torch.set_num_threads(1)
    print("\n".join(table(CANDIDATES, CHECKS)))
    print(f"mode overhead: {mode_overhead()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
