"""Measure the candidate designs of "a converted expert weight" against what a converted model must do.

    python scripts/probes/conversion_design_probe.py          # CPU is enough; prints one table (docs/design.md 8.1)

Candidates, each on ``moe_quant.moe.GroupedExperts`` (SwiGLU, three ``torch._grouped_mm`` calls):

* ``subclass``: each expert weight becomes a tensor subclass over the parameter's own storage (made with
  ``torch.Tensor._make_subclass``, as ``nn.Parameter`` is) whose ``__torch_function__`` sends the
  grouped-mm calls that use it to ``mxfp8_grouped_mm``;
* ``mode_in_hook``: plain parameters; forward pre/post hooks on the module enter/leave a
  ``TorchFunctionMode`` that does that routing;
* ``class_swap``: plain parameters; the module's class becomes a generated subclass whose forward calls
  the MXFP8 GEMMs (moe_quant's conversion, ``quantize_`` with ``MXFP8MoEConfig``).

Checks (each prints yes / no / the error): eager forward runs MXFP8 (3 calls); a write between forward and
backward raises autograd's error; ``torch.compile(fullgraph=True)`` (aot_eager) runs and calls MXFP8
(output SQNR against the unconverted block: MXFP8 noise is ~25 dB here, bf16 rounding ~49 dB);
``torch.func.grad`` of ``functional_call`` calls MXFP8; ``deepcopy`` and pickling keep it converted;
``state_dict`` loads with ``torch.load(weights_only=True)``; FSDP2 (``fully_shard``, one gloo rank)
runs forward + backward through MXFP8.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

import moe_quant.autograd  # noqa: E402
from moe_quant import MXFP8MoEConfig  # noqa: E402
from moe_quant.moe import GroupedExperts  # noqa: E402

DIM, HIDDEN, E, M = 64, 64, 4, 96
CALLS = [0]
_REAL = moe_quant.autograd.mxfp8_grouped_mm


def _counting(*args, **kwargs):
    CALLS[0] += 1
    return _REAL(*args, **kwargs)


moe_quant.autograd.mxfp8_grouped_mm = _counting  # every candidate reaches the GEMM through this name


def _route(args, kwargs):
    a, b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    return moe_quant.autograd.mxfp8_grouped_mm(a, b, offs)


class SubclassWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, data, requires_grad=True):
        return torch.Tensor._make_subclass(cls, data, requires_grad)

    def __deepcopy__(self, memo):
        return SubclassWeight(copy.deepcopy(self.as_subclass(torch.Tensor).detach(), memo), self.requires_grad)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and len(args) >= 2 and isinstance(args[1], cls):
            with torch._C.DisableTorchFunctionSubclass():
                return _route((args[0], args[1].as_subclass(torch.Tensor), *args[2:]), kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def convert_subclass(m):
    for n, p in list(m.named_parameters()):
        m._parameters[n] = SubclassWeight(p.detach())
    return m


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and len(args) >= 2 and args[1].ndim == 3:
            return _route(args, kwargs)
        return func(*args, **kwargs)


def convert_mode(m):
    def pre(mod, args):
        mod._mode = _Mode()
        mod._mode.__enter__()

    def post(mod, args, out):
        mod._mode.__exit__(None, None, None)

    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post)
    return m


def convert_class_swap(m):
    holder = torch.nn.Sequential(m)
    # per-GEMM: the probe counts mxfp8_grouped_mm calls, which the fused SwiGLU block (the default) makes none of
    quantize_(holder, MXFP8MoEConfig(fused_block=False), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    return holder[0]


CANDIDATES = {"subclass": convert_subclass, "mode_in_hook": convert_mode, "class_swap": convert_class_swap}


def make(kind):
    torch.manual_seed(0)
    plain = GroupedExperts(DIM, HIDDEN, E).to(torch.bfloat16)
    return plain, CANDIDATES[kind](copy.deepcopy(plain))


def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, DIM, generator=g).to(torch.bfloat16)
    return x, torch.tensor([20, 0, 40, 36], dtype=torch.int32)


def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def counted(fn):
    CALLS[0] = 0
    fn()
    return CALLS[0]


def check_eager(kind):
    _, m = make(kind)
    x, counts = inputs()
    return "yes" if counted(lambda: m(x, counts)) == 3 else "no"


def check_inplace(kind):
    _, m = make(kind)
    x, counts = inputs()
    out = m(x.requires_grad_(), counts)
    with torch.no_grad():
        m.w2.mul_(2)
    try:
        out.float().sum().backward()
    except RuntimeError as e:
        return "yes" if "inplace" in str(e) else f"other error: {str(e)[:60]}"
    return "no (silent)"


def check_compile(kind):
    plain, m = make(kind)
    x, counts = inputs()
    torch._dynamo.reset()
    try:
        out = [None]
        n = counted(lambda: out.__setitem__(0, torch.compile(m, backend="aot_eager", fullgraph=True)(x, counts)))
    except Exception as e:  # noqa: BLE001 -- a probe reports failures
        return f"fails: {type(e).__name__}"
    return f"{'yes' if n == 3 else 'no'} ({n} calls, {sqnr(plain(x, counts), out[0]):.1f} dB)"


def check_func(kind):
    _, m = make(kind)
    x, counts = inputs()
    params = {n: p.detach() for n, p in m.named_parameters()}
    try:
        n = counted(lambda: torch.func.grad(
            lambda p: torch.func.functional_call(m, p, (x, counts)).float().sum())(params))
    except Exception as e:  # noqa: BLE001
        return f"fails: {type(e).__name__}"
    return "yes" if n == 3 else f"no ({n} calls)"


def check_copies(kind):
    _, m = make(kind)
    x, counts = inputs()
    try:
        copies = [copy.deepcopy(m), pickle.loads(pickle.dumps(m))]
        ns = [counted(lambda c=c: c(x, counts)) for c in copies]
    except Exception as e:  # noqa: BLE001
        return f"fails: {type(e).__name__}"
    return "yes" if ns == [3, 3] else f"no ({ns} calls)"


def check_state_dict(kind):
    _, m = make(kind)
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, buf)
    buf.seek(0)
    try:
        torch.load(buf)
    except Exception as e:  # noqa: BLE001
        return f"fails: {type(e).__name__}"
    return "yes"


def fsdp2_calls(m, x, counts) -> int:
    """MXFP8 calls of one forward + backward of ``m`` (fp32) under FSDP2's ``fully_shard`` on a 1-rank group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = m.float()
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    return counted(lambda: m(x.float(), counts).sum().backward())


def check_fsdp2(kind):
    _, m = make(kind)
    try:
        n = fsdp2_calls(m, *inputs())
    except Exception as e:  # noqa: BLE001
        return f"fails: {type(e).__name__}"
    return "yes" if n == 3 else f"no ({n} calls)"


CHECKS = {
    "eager: 3 MXFP8 calls": check_eager,
    "write between fwd and bwd raises": check_inplace,
    "compile fullgraph (aot_eager) runs MXFP8": check_compile,
    "torch.func.grad(functional_call) runs MXFP8": check_func,
    "deepcopy / pickle stay converted": check_copies,
    "state_dict loads with weights_only": check_state_dict,
    "FSDP2 fully_shard fwd+bwd runs MXFP8": check_fsdp2,
}


def table(candidates, checks) -> list:
    """Each check of ``checks`` run on each of ``candidates`` (names) on a 1-rank gloo group: markdown rows."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        rows = [(name, [checks[name](kind) for kind in candidates]) for name in checks]
    finally:
        dist.destroy_process_group()
    lines = [f"torch {torch.__version__}", "| check | " + " | ".join(candidates) + " |",
             "|---|" + "---|" * len(candidates)]
    return lines + [f"| {name} | " + " | ".join(results) + " |" for name, results in rows]


def main() -> int:
    print("\n".join(table(CANDIDATES, CHECKS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
