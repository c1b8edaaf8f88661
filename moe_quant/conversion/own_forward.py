"""The converted forward of an experts module conversion has no forward of its own for: the module's own forward,
its grouped GEMMs routed to MXFP8.

A user's experts module (or a subclass of a known one that overrides ``forward``) calls ``torch._grouped_mm`` /
``F.grouped_mm`` itself. :func:`routed_forward` makes its converted forward: the module's own forward run inside
:class:`GroupedMMRouting`, a ``TorchFunctionMode`` that sends each ``torch._grouped_mm`` call (``F.grouped_mm``
calls it) to :func:`moe_quant.conversion.gemm.grouped_mm` -- MXFP8, or the counted fallback -- and runs every other
op as it is. The parameters stay the module's own; ``torch.func``, FSDP2, activation checkpointing and pickling
see a plain module.

Under ``torch.compile`` Dynamo does not dispatch torch function modes for ``torch._grouped_mm`` (a private torch
function is not in ``torch.overrides.get_overridable_functions()``, which gates Dynamo's dispatch; measured with
torch 2.11 and 2.13, ``scripts/probes/own_forward_probe.py``): a traced forward would silently run the bf16 op. So this
forward is excluded from Dynamo (``torch._dynamo.disable``): a compiled model runs it eagerly, in MXFP8, behind a
graph break, logged once per class when Dynamo first traces it; ``fullgraph=True`` raises Dynamo's ``Unsupported``
with moe_quant's message, naming the seam to add (docs/design.md section 8.2).
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

from .fallbacks import fallback
from .gemm import grouped_mm

SEAM = "_grouped_mm(self, *, A, B_t, offs)"

logger = logging.getLogger("moe_quant.conversion")
_NOTED: set = set()  # classes whose graph break under torch.compile was logged


def _grouped_mm_args(self, mat2, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm``'s arguments by name (it takes them positionally or as keywords)."""
    return self, mat2, offs, bias, out_dtype


class GroupedMMRouting(TorchFunctionMode):
    """Inside it, each ``torch._grouped_mm`` call runs :func:`moe_quant.conversion.gemm.grouped_mm` with ``config``
    (MXFP8, or the plain op counted as a fallback); ``calls`` counts them. Other ops run unchanged. The mode is
    off while it handles a call (``TorchFunctionMode`` pops itself), so the MXFP8 GEMM's own ops are not seen."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch._grouped_mm:
            return func(*args, **kwargs)
        self.calls += 1
        a, b, offs, bias, out_dtype = _grouped_mm_args(*args, **kwargs)
        if bias is not None:
            fallback("grouped_mm with a bias", self.config.allow_fallback)
            return func(*args, **kwargs)
        return grouped_mm(a, b, offs, self.config, out_dtype=out_dtype)


def compile_note(cls: type, fullgraph: bool = False) -> str:
    """What ``torch.compile`` does with the converted ``cls`` (``fullgraph``: why it raises), and the seam that makes
    it traceable."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    what = (f"fullgraph=True cannot trace the converted {name}, which runs eagerly behind a graph break"
            if fullgraph else f"torch.compile runs the converted {name} eagerly, behind a graph break (still in MXFP8)")
    return (f"moe_quant: {what}: its own forward's torch._grouped_mm / F.grouped_mm calls are routed to MXFP8 by a "
            f"TorchFunctionMode, which Dynamo does not apply to torch._grouped_mm. To compile it into the graph, give "
            f"{name} a method {SEAM} that returns torch._grouped_mm(A, B_t, offs=offs), and call it in forward for "
            f"each expert GEMM (conversion then overrides that method; docs/own_moe.md)")


def _fullgraph() -> bool:
    """Dynamo is tracing with graph breaks not allowed (``fullgraph=True``, ``error_on_graph_break``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # another tracer, or Dynamo's internals moved: the disabled forward's reason still names the seam
        return False


def no_call_reason(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return (f"{name}.forward made no torch._grouped_mm / F.grouped_mm call, so nothing of it ran in MXFP8: "
            f"run each expert GEMM as torch._grouped_mm(A, W.transpose(-2, -1), offs=offs), or give the class a "
            f"method {SEAM} and call it")


def routed_forward(cls: type):
    """The converted forward of ``cls`` (a class conversion has no forward for): ``cls.forward`` (looked up at each
    call) inside :class:`GroupedMMRouting`. A forward that made no grouped-mm call is a counted fallback. Under
    ``torch.compile`` it runs eagerly behind a graph break, logged once per class; ``fullgraph=True`` raises
    ``Unsupported`` with :func:`compile_note`."""
    reason = no_call_reason(cls)
    note, fullgraph_note = compile_note(cls), compile_note(cls, fullgraph=True)

    def eager_forward(self, *args, **kwargs):
        config = self._mxfp8_config
        routing = GroupedMMRouting(config)
        with routing:
            out = cls.forward(self, *args, **kwargs)
        if routing.calls == 0:
            fallback(reason, config.allow_fallback)
        return out

    eager = torch._dynamo.disable(eager_forward, reason=fullgraph_note)

    @torch._dynamo.assume_constant_result
    def traced() -> bool:  # runs in Python while Dynamo traces forward (once per trace), so it is no graph break
        if _fullgraph():
            raise torch._dynamo.exc.Unsupported(fullgraph_note)
        if cls not in _NOTED:
            _NOTED.add(cls)
            logger.warning("%s (logged once per class)", note)
        return True

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            traced()
        return eager(self, *args, **kwargs)

    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward.__doc__ = f"{cls.__qualname__}'s own forward, its grouped GEMMs in MXFP8 (moe_quant conversion)."
    return forward
