"""The converted forward of an experts module conversion has no forward of its own for: the module's own forward,
its grouped GEMMs routed to MXFP8.

A user's experts module (or a subclass of a known one that overrides ``forward``) calls ``torch._grouped_mm`` /
``F.grouped_mm`` itself. :func:`routed_forward` makes its converted forward: the module's own forward run inside
:class:`GroupedMMRouting`, a ``TorchFunctionMode`` that sends each ``torch._grouped_mm`` call (``F.grouped_mm``
calls it) whose weight operand is one of the module's own parameters -- or a tensor made from them in this
forward: a view, a cast, ``.data``, a local shard -- to :func:`moe_quant.conversion.gemm.grouped_mm` (MXFP8, or the
counted fallback), and runs every other op as it is: a grouped GEMM on another module's weights (a submodule the
user left unconverted, one converted with its own config) is that module's business. The parameters stay the
module's own; ``torch.func``, FSDP2, activation checkpointing and pickling see a plain module.

**Activation checkpointing inside the forward.** ``torch.utils.checkpoint`` recomputes the checkpointed part in
backward, outside this forward and its mode, where the recompute would run the plain GEMMs (reentrant: silently,
the gradients the bf16 ones; non-reentrant: ``CheckpointError``, the saved tensors differ). So where a routed call
ran inside a checkpoint (under another grad mode or saved-tensors hook than the forward began with), the backward
of every autograd node this forward made runs inside the same routing (a node pre-hook enters it, the node's post-hook
leaves it: the recompute runs within the node whose saved tensor triggers it, or within ``CheckpointFunction``'s
node), and the recompute runs the same MXFP8 GEMMs. Routing by the weight makes that window harmless for
everything else a node's backward runs. A checkpoint *around* the module needs nothing: its recompute calls this
forward again.

Under ``torch.compile`` Dynamo does not dispatch torch function modes for ``torch._grouped_mm`` (a private torch
function is not in ``torch.overrides.get_overridable_functions()``, which gates Dynamo's dispatch; measured with
torch 2.11 and 2.13, ``scripts/probes/own_forward_probe.py``): a traced forward would silently run the bf16 op. So this
forward is excluded from Dynamo (``torch._dynamo.disable``): a compiled model runs it eagerly, in MXFP8, behind a
graph break, logged once per class when Dynamo first traces it; ``fullgraph=True`` raises Dynamo's ``Unsupported``
with moe_quant's message, naming the seam to add (docs/design.md section 8.2).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .fallbacks import fallback
from .gemm import grouped_mm

SEAM = "_grouped_mm(self, *, A, B_t, offs)"

logger = logging.getLogger("moe_quant.conversion")
_NOTED: set = set()  # classes whose graph break under torch.compile was logged


def own_parameters(module: nn.Module) -> list:
    """The module's own parameters: its own, and those of its ``ParameterList`` / ``ParameterDict`` children (not
    other submodules')."""
    holders = [module] + [c for c in module.children() if isinstance(c, (nn.ParameterList, nn.ParameterDict))]
    return [p for h in holders for p in h._parameters.values() if p is not None]


def _grouped_mm_args(self, mat2, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm``'s arguments by name (it takes them positionally or as keywords)."""
    return self, mat2, offs, bias, out_dtype


def _storage_id(t):
    """The identity of the storage under ``t`` (a DTensor's local shard's), or None where there is none (functorch
    wrappers, meta)."""
    t = getattr(t, "_local_tensor", t)  # DTensor: its shard; to_local() shares that storage
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


class GroupedMMRouting(TorchFunctionMode):
    """Inside it, each ``torch._grouped_mm`` call whose weight operand (``mat2``) is one of ``module``'s own
    parameters (:func:`own_parameters`, read when the mode is made: FSDP2's gathered ones, ``functional_call``'s)
    or made from them inside the mode runs :func:`moe_quant.conversion.gemm.grouped_mm` with ``config`` (MXFP8, or
    the plain op counted as a fallback); ``calls`` counts them. "Made from them": a tensor that shares a parameter's
    storage (a view, ``.data``, ``detach``, a DTensor's local shard), or the result of an op whose tensor arguments
    are all such (``w.bfloat16()``, ``w.mT``, ``torch.stack`` of them). Other grouped GEMMs and every other op run
    unchanged. The mode is off while it handles a call (``TorchFunctionMode`` pops itself), so the MXFP8 GEMM's own
    ops are not seen."""

    def __init__(self, module: nn.Module, config):
        super().__init__()
        self.config = config
        self.calls = 0
        self.checkpointed = False  # a routed call ran under another autograd state than the mode was made in
        self._state = _autograd_state()
        self._made = WeakIdKeyDictionary()  # the parameters and the tensors made from them inside the mode
        for p in own_parameters(module):
            self._made[p] = True
        self._storages = None  # the parameters' storage identities, read at the first grouped-mm call

    def _is_weight(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if t in self._made:
            return True
        if self._storages is None:
            self._storages = {_storage_id(p) for p in list(self._made.keys())} - {None}
        return _storage_id(t) in self._storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            a, b, offs, bias, out_dtype = _grouped_mm_args(*args, **kwargs)
            if not self._is_weight(b):  # another module's weight: its own business
                return func(*args, **kwargs)
            self.calls += 1
            if not self.checkpointed and _autograd_state() != self._state:
                self.checkpointed = True
            if bias is not None:
                fallback("grouped_mm with a bias", self.config.allow_fallback)
                return func(*args, **kwargs)
            return grouped_mm(a, b, offs, self.config, out_dtype=out_dtype)
        out = func(*args, **kwargs)
        if self._made and self._from_weights(args, kwargs):
            for t in _tensors(out):
                self._made[t] = True
        return out

    def _from_weights(self, args, kwargs) -> bool:
        """Every tensor argument (top level, or in a list / tuple) is a weight or made from them, and there is one."""
        found = False
        for value in (*args, *kwargs.values()):
            for t in _tensors(value):
                if t not in self._made:
                    return False
                found = True
        return found


def _autograd_state() -> tuple:
    """Grad mode and the innermost saved-tensors pack hook: both change inside ``torch.utils.checkpoint`` (the
    reentrant one runs its function under ``no_grad``, the non-reentrant one under hooks of its own), so a routed
    call that sees another state than its forward began in may run again in backward. (A private torch function;
    where it is missing every forward is taken for checkpointed: correct, and slower in backward.)"""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except AttributeError:
        return (object(),)
    return torch.is_grad_enabled(), None if hooks is None else hooks[0]


_WINDOWS = threading.local()  # the routing modes the backward windows of this thread entered, innermost last


def _enter_window(module, config, _grad_outputs):
    mode = GroupedMMRouting(module, config)
    mode.__enter__()
    stack = getattr(_WINDOWS, "modes", None)
    if stack is None:
        stack = _WINDOWS.modes = []
    stack.append(mode)


def _leave_window(_grad_inputs, _grad_outputs):
    _WINDOWS.modes.pop().__exit__(None, None, None)


def _close_stale_windows() -> None:
    """Windows a backward pass that raised left open (a node's post-hook does not run then): close those on top of
    this thread's mode stack, outside any backward pass."""
    stack = getattr(_WINDOWS, "modes", None)
    if not stack or torch._C._current_graph_task_id() != -1:
        return
    from torch.overrides import _get_current_function_mode_stack

    while stack and _get_current_function_mode_stack()[-1:] == [stack[-1]]:
        stack.pop().__exit__(None, None, None)


_LEAF = None  # a 0-element leaf: a node made from it tells the autograd sequence number of this thread


def _sequence_number():
    """This thread's autograd sequence number, or None where this forward makes no autograd nodes to hook (grad
    disabled; a ``torch.func`` transform, whose own levels run the backward)."""
    global _LEAF
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return None
    if _LEAF is None:
        _LEAF = torch.empty(0, requires_grad=True)
    node = _LEAF.view(0).grad_fn
    return None if node is None else node._sequence_nr()


def _nodes_made_since(outputs, start: int):
    """The autograd nodes behind ``outputs`` made on this thread since sequence number ``start`` (this forward's)."""
    stack = [t.grad_fn for t in _tensors(outputs if isinstance(outputs, (list, tuple)) else [outputs])]
    seen, nodes = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable") or node._sequence_nr() < start:  # a leaf's accumulator, or made before
            continue
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


def _route_backward(module, config, outputs, start: int) -> None:
    """The backward of every node this forward made runs inside the routing (see the module doc)."""
    enter = functools.partial(_enter_window, module, config)
    for node in _nodes_made_since(outputs, start):
        node.register_prehook(enter)
        node.register_hook(_leave_window)


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
    return (f"{name}.forward made no torch._grouped_mm / F.grouped_mm call on its own parameters, so nothing of it "
            f"ran in MXFP8: run each expert GEMM as torch._grouped_mm(A, W.transpose(-2, -1), offs=offs), or give "
            f"the class a method {SEAM} and call it")


def routed_forward(cls: type):
    """The converted forward of ``cls`` (a class conversion has no forward for): ``cls.forward`` (looked up at each
    call) inside :class:`GroupedMMRouting`, and its backward too where a checkpoint may recompute it
    (:func:`_route_backward`). A forward that made no grouped-mm call on the module's parameters is a counted
    fallback. Under ``torch.compile`` it runs eagerly behind a graph break, logged once per class; ``fullgraph=True``
    raises ``Unsupported`` with :func:`compile_note`."""
    reason = no_call_reason(cls)
    note, fullgraph_note = compile_note(cls), compile_note(cls, fullgraph=True)

    def eager_forward(self, *args, **kwargs):
        config = self._mxfp8_config
        _close_stale_windows()
        start = _sequence_number()
        routing = GroupedMMRouting(self, config)
        with routing:
            out = cls.forward(self, *args, **kwargs)
        if routing.calls == 0:
            fallback(reason, config.allow_fallback)
        elif start is not None and routing.checkpointed:  # its recompute may run in backward: route that too
            _route_backward(self, config, out, start)
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
