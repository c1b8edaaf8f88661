"""Hugging Face transformers (5.23): moe_quant as an experts implementation.

transformers' MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, ...) route their
experts module's forward through the experts interface (``ALL_EXPERTS_FUNCTIONS``), by the name in
``config._experts_implementation``. :func:`register_experts_implementation` registers
``"moe_quant_mxfp8"`` there, so::

    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="moe_quant_mxfp8")

runs every expert GEMM in MXFP8 (default :class:`MXFP8MoEConfig`, or the config ``quantize_`` gave
the module). ``quantize_(model, MXFP8MoEConfig(...), filter_fn=lambda mod, fqn: fqn.endswith(".experts"))``
converts the matched modules only, with that config, whatever the model's implementation name.

Either way the expert weights reach the GEMM as they are: fp32 master weights are served in MXFP8
under ``torch.compile`` too (transformers' own ``grouped_mm`` sends them to its unquantized fallback op).
Llama4's experts (``torch.bmm`` over every token) have no experts-interface forward;
:func:`llama4_forward` is their converted forward.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import re
import sys

import torch

from .config import MXFP8MoEConfig
from .experts import swiglu_experts_w13
from .gemm import bmm, grouped_mm

IMPLEMENTATION = "moe_quant_mxfp8"
_DEFAULT = MXFP8MoEConfig()
# transformers releases whose experts modules carry what the converted forward reads (has_gate, has_bias,
# is_transposed, has_post_expert_norm, _is_expert_parallel; 5.0-5.22 have the experts interface without them)
SUPPORTED_TRANSFORMERS = ((5, 23), (6, 0))  # [first, end)
REQUIREMENT = "transformers>=5.23,<6"


def transformers_version_problem() -> str | None:
    """Why the imported transformers cannot serve moe_quant's integration, or None if it can."""
    import transformers

    version = getattr(transformers, "__version__", "unknown")
    m = re.match(r"(\d+)\.(\d+)", version)
    first, end = SUPPORTED_TRANSFORMERS
    if m and first <= (int(m.group(1)), int(m.group(2))) < end:
        return None
    return (f"moe_quant's transformers integration needs {REQUIREMENT} (experts modules with has_gate, has_bias, "
            f"is_transposed and has_post_expert_norm); found transformers {version}: "
            f"pip install '{REQUIREMENT}'")


def require_supported_transformers() -> None:
    """``ImportError`` naming the supported versions if the imported transformers is not one of them."""
    problem = transformers_version_problem()
    if problem is not None:
        raise ImportError(problem)


def _config(module) -> MXFP8MoEConfig:
    return getattr(module, "_mxfp8_config", None) or _DEFAULT


def _linear(module, x, weight, offs, bias):
    """One grouped projection of an experts module (``weight`` stored (E, in, out) if the module is
    transposed, else (E, out, in)), in MXFP8."""
    w_t = weight if module.is_transposed else weight.transpose(-2, -1)
    out = grouped_mm(x.to(weight.dtype), w_t, offs, _config(module))
    return out if bias is None else out + bias


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts-interface forward (the arguments of transformers' ``grouped_mm`` implementation)."""
    num_top_k = top_k_index.size(-1)
    num_tokens = hidden_states.size(0)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # tokens grouped by expert
    x = hidden_states[perm // num_top_k]
    sample_weights = top_k_weights.reshape(-1)[perm]
    # counts without a host sync; ids past num_experts (expert-parallel sentinels) sort last, are not counted
    counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, expert_ids.clamp(max=self.num_experts - 1),
                        (expert_ids < self.num_experts).to(torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    sentinel = None
    if getattr(self, "_is_expert_parallel", False):
        sentinel = (expert_ids >= self.num_experts).unsqueeze(-1)
        expert_ids = expert_ids.clamp(max=self.num_experts - 1)
        x = x.masked_fill(sentinel, 0.0)

    if is_plain_swiglu(self):  # the whole block in one autograd function (fused quantization passes)
        w13, w2 = (self.gate_up_proj, self.down_proj) if not self.is_transposed else (
            self.gate_up_proj.transpose(-2, -1), self.down_proj.transpose(-2, -1))
        out = swiglu_experts_w13(x.to(w13.dtype), w13, w2, offs, _config(self))
        return _combine(out, sample_weights, perm, num_tokens, num_top_k, hidden_states)

    if self.has_gate:
        weight, bias = self.gate_up_proj, (self.gate_up_proj_bias[expert_ids] if self.has_bias else None)
    else:
        weight, bias = self.up_proj, (self.up_proj_bias[expert_ids] if self.has_bias else None)
    h = _linear(self, x, weight, offs, bias)
    if sentinel is not None:
        h = h.masked_fill(sentinel, 0.0)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _linear(self, h, self.down_proj, offs, self.down_proj_bias[expert_ids] if self.has_bias else None)
    if sentinel is not None:
        out = out.masked_fill(sentinel, 0.0)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return _combine(out, sample_weights, perm, num_tokens, num_top_k, hidden_states)


def _combine(out, sample_weights, perm, num_tokens, num_top_k, hidden_states):
    """Expert outputs (grouped by expert) weighted by their routing weights, back in token order, summed over
    each token's top-k."""
    out = out * sample_weights.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    out = out[inv_perm].view(num_tokens, num_top_k, hidden_states.size(-1)).sum(dim=1)
    return out.to(hidden_states.dtype)


def is_plain_swiglu(module) -> bool:
    """An experts-interface module whose computation is the SwiGLU block over concatenated gate and up weights:
    transformers' default gate (``act_fn(gate) * up`` of the two halves) with silu, no biases, no post-expert
    norm, not expert-parallel (whose sentinel tokens the per-GEMM forward masks). Such modules run
    :func:`moe_quant.mxfp8_swiglu_experts_w13`, which equals their per-GEMM conversion bit for bit."""
    if not getattr(module, "has_gate", False) or getattr(module, "has_bias", False):
        return False
    if getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False):
        return False
    if not getattr(module, "is_concatenated", True) or not _default_gate(type(module)):
        return False
    act = module.act_fn
    return "forward" not in vars(act) and type(act).forward in _silu_forwards()


def llama4_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' ``Llama4TextExperts``, converted: its two ``torch.bmm`` calls in MXFP8."""
    config = _config(self)
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate, up = bmm(hidden_states, self.gate_up_proj, config).chunk(2, dim=-1)
    out = bmm(up * self.act_fn(gate), self.down_proj, config)
    return out.view(-1, self.hidden_size)


# Not cached: the converted forward calls both while torch.compile traces, and dynamo warns about (and traces
# through) an lru_cache wrapper. Each is an import of a loaded module and a lookup.
def _default_gate(cls: type) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(cls, "_apply_gate", None) is _default_apply_gate


def _silu_forwards() -> tuple:
    from transformers.activations import SiLUActivation

    return torch.nn.SiLU.forward, SiLUActivation.forward


def _is_experts_interface_class(c: type) -> bool:
    """A transformers experts class whose forward goes through the experts interface (its
    ``use_experts_implementation`` decorator gives it ``_apply_gate``)."""
    return c.__module__.startswith("transformers.") and callable(getattr(c, "_apply_gate", None))


def _is_llama4_experts_class(c: type) -> bool:
    return c.__name__ == "Llama4TextExperts" and c.__module__.startswith("transformers.")


def known_class(cls: type):
    """``(K, forward)``: the first transformers experts class ``K`` in ``cls``'s MRO (Llama4's, or one of the
    experts interface) and its converted forward; None if there is none. ``ImportError`` if the imported
    transformers is not a supported one."""
    for c in cls.__mro__:
        if _is_llama4_experts_class(c):
            forward = llama4_forward
        elif _is_experts_interface_class(c):
            forward = experts_forward
        else:
            continue
        require_supported_transformers()
        return c, forward
    return None


def register_experts_implementation() -> str:
    """Register ``"moe_quant_mxfp8"`` in transformers' experts interface (idempotent); returns the name.
    ``import moe_quant`` does it already, whatever the import order (:func:`register_when_imported`), where the
    transformers is a supported one. ``ImportError`` with another transformers than ``transformers>=5.23,<6``. A
    model whose experts do not dispatch through the interface then refuses the name when it is built
    (:func:`_refuse_models_off_the_interface`)."""
    require_supported_transformers()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    _refuse_models_off_the_interface()
    return IMPLEMENTATION


_INTERFACE = "transformers.integrations.moe"  # the module holding ALL_EXPERTS_FUNCTIONS
_MODELING = "transformers.modeling_utils"  # the module holding PreTrainedModel (it imports _INTERFACE)
logger = logging.getLogger("moe_quant.conversion")


def _register_if_supported() -> None:
    """:func:`register_experts_implementation` where the imported transformers is a supported one; with another,
    nothing (``register_experts_implementation()`` and conversion say why)."""
    if transformers_version_problem() is None:
        register_experts_implementation()


def register_when_imported() -> None:
    """``import moe_quant``'s registration in transformers' experts interface, whatever the import order: now, if
    transformers is imported already; else when its experts interface module is first imported (a one-shot import
    hook; ``import moe_quant`` does not import transformers), so that ``from_pretrained(...,
    experts_implementation="moe_quant_mxfp8")`` finds it (and, once transformers' ``PreTrainedModel`` exists, the
    name's check against the model, :func:`_refuse_models_off_the_interface`)."""
    if sys.modules.get("transformers") is not None:  # None: an import of it was blocked
        _register_if_supported()
    else:
        _refuse_models_off_the_interface()  # its hook first: the interface is imported inside transformers' modeling
        _when_imported(_INTERFACE, _register_if_supported)


def _when_imported(fullname: str, action) -> None:
    """``action()`` now if module ``fullname`` is imported (fully: not one whose import is running), else right after
    its import runs (a one-shot import hook, :class:`_RegisterOnImport`). Where its import is running now (this is
    called from inside it) and no hook of ours waits for it, nothing."""
    module = sys.modules.get(fullname)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            action()
    elif not any(isinstance(f, _RegisterOnImport) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(fullname, action))


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for module ``fullname`` it takes the spec the other finders give and wraps its loader
    so that ``action`` runs right after the module does; then it leaves ``sys.meta_path``."""

    def __init__(self, fullname: str, action):
        self.fullname, self.action = fullname, action

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader, self.action)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    """A module's own loader, then ``action`` (a failure there is logged, never raised into the user's import of
    transformers)."""

    def __init__(self, loader, action):
        self._loader, self._action = loader, action

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._action()
        except Exception as e:  # noqa: BLE001 -- the user's import must go on; from_pretrained then says the name
            logger.warning("moe_quant could not register %r in transformers: %s: %s", IMPLEMENTATION,
                           type(e).__name__, e)

    def __getattr__(self, name):  # get_source, get_filename, ... as the module's own loader
        if name in ("_loader", "_action"):
            raise AttributeError(name)
        return getattr(self._loader, name)


_CHECKS_INTERFACE = "_moe_quant_checks_interface"  # marks the wrapped validator (installed once)


def off_interface_message(cls: type) -> str:
    return (f"{cls.__name__} does not run its experts through transformers' experts interface (its modeling module "
            f"{cls.__module__} has no @use_experts_implementation experts class; Llama4's experts are a torch.bmm "
            f"forward), so experts_implementation={IMPLEMENTATION!r} would run none of its expert GEMMs in MXFP8. "
            f"Load it with another implementation and convert its experts: moe_quant.convert(model, "
            f"filter_fn=lambda mod, fqn: fqn.endswith('.experts')), or quantize_(model, MXFP8MoEConfig(), "
            f"filter_fn=...) with that filter")


def _refuse_models_off_the_interface() -> None:
    """transformers validates an experts implementation name when a model is built (and in
    ``set_experts_implementation``) by ``PreTrainedModel.get_correct_experts_implementation``, which accepts any
    registered name for any model and checks only ``"grouped_mm"`` against the model (``_grouped_mm_can_dispatch``:
    its class's modeling module must use ``@use_experts_implementation``). A model off the interface then keeps its
    own experts' forward: it loads with ``"moe_quant_mxfp8"`` and runs nothing in MXFP8. This adds the same check
    for this name (the model raises ``ValueError`` naming ``moe_quant.convert``), by wrapping that method once,
    after ``transformers.modeling_utils`` has run (:func:`_when_imported`: the experts interface, where this name
    is registered, is imported in the middle of it)."""
    _when_imported(_MODELING, _wrap_validator)


def _wrap_validator() -> None:
    """:func:`_refuse_models_off_the_interface`'s wrapper of ``PreTrainedModel.get_correct_experts_implementation``
    (``transformers.modeling_utils`` has run)."""
    cls = sys.modules[_MODELING].PreTrainedModel
    current = cls.get_correct_experts_implementation
    if getattr(current, _CHECKS_INTERFACE, False):
        return

    @functools.wraps(current)
    def get_correct_experts_implementation(self, requested_experts):
        if requested_experts == IMPLEMENTATION and not self._can_set_experts_implementation():
            raise ValueError(off_interface_message(type(self)))
        return current(self, requested_experts)

    setattr(get_correct_experts_implementation, _CHECKS_INTERFACE, True)
    cls.get_correct_experts_implementation = get_correct_experts_implementation


def _configs(config) -> dict:
    """A transformers config and its sub-configs, by ``set_experts_implementation``'s keys ("" for itself)."""
    configs = {"": config}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            configs[key] = sub
    return configs


def restore_experts_implementation(module) -> None:
    """Each transformers model in ``module`` (itself included) running the ``"moe_quant_mxfp8"`` experts
    implementation, in its own config or a sub-config, gets the one transformers picks by default
    (``get_correct_experts_implementation(None)``: ``"grouped_mm"`` where it can dispatch, else ``"eager"``);
    other implementations stay. An experts module running it through the config of a model outside ``module``
    (``unconvert(model.model.layers[0])``) raises ``ValueError`` before anything changes: the implementation is
    the whole model's. :func:`moe_quant.unconvert` calls it."""
    if sys.modules.get("transformers") is None:  # no transformers model can be in module
        return
    from transformers import PreTrainedModel

    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    covered = {id(c) for m in models for c in _configs(m.config).values()}
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if (any(_is_experts_interface_class(c) for c in type(m).__mro__) and id(config) not in covered
                and getattr(config, "_experts_implementation", None) == IMPLEMENTATION):
            raise ValueError(
                f"unconvert: module {name or type(m).__name__!r} runs the {IMPLEMENTATION!r} experts implementation "
                f"of its model's config, which only the whole model can change: call unconvert(model) on the "
                f"model, or model.set_experts_implementation(...)")
    for model in models:
        current = {k: c._experts_implementation for k, c in _configs(model.config).items()}
        if IMPLEMENTATION in current.values():
            default = model.get_correct_experts_implementation(None)
            model.set_experts_implementation({k: default if v == IMPLEMENTATION else v for k, v in current.items()})
