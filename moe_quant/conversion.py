"""Drop-in model conversion: ``quantize_(model, MXFP8MoEConfig(), filter_fn=...)``.

The handler registered with torchao's ``quantize_`` replaces every 3-D floating-point
parameter of the matched modules (the stacked expert weights ``(E, N, K)``) by an
:class:`MXFP8ExpertWeight`: a tensor subclass that wraps the original high-precision
tensor and changes exactly one thing. A ``torch._grouped_mm`` /
``torch.nn.functional.grouped_mm`` call whose ``mat_b`` is such a weight (normally
``w.transpose(-2, -1)``) runs :func:`moe_quant.mxfp8_grouped_mm` (MXFP8 forward, dgrad
and wgrad), and so does a ``torch.bmm`` / ``torch.matmul`` / ``@`` of an ``(E, T, K)`` input by
a converted ``(E, K, N)`` weight (E uniform groups of T rows: Hugging Face's Llama4 experts);
every other op runs as the plain op on the wrapped tensor.

How the pieces fit:

* ``__torch_function__`` intercepts the grouped-mm call, above autograd, so the MXFP8
  ``autograd.Function`` owns the backward. Dynamo traces it, so it works under
  ``torch.compile(fullgraph=True)``. Any other function goes straight to dispatch.
* ``__torch_dispatch__`` (below autograd) runs every aten op on the wrapped tensor.
  Views, ``detach``, ``clone``, ``_to_copy`` and the factory ops FSDP2 / ``to_empty``
  use return the wrapper again; in-place ops (``copy_``, optimizer updates, fused and
  foreach AdamW included) mutate the wrapped tensor (PyTorch hands back the wrapper
  argument itself); everything else returns plain tensors.
* ``__tensor_flatten__`` / ``__tensor_unflatten__`` make it a traceable wrapper subclass
  (torch.compile, AOTAutograd); ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` let
  FSDP2 all-gather the plain (optionally mixed-precision-cast) data and rebuild the wrapper.
* ``state_dict()`` holds plain tensors (a state-dict hook unwraps); ``load_state_dict``
  copies into the wrapped tensor, and with ``assign=True`` re-wraps the assigned tensor.
* Under ``torch.inference_mode`` composite ops reach ``__torch_dispatch__`` undecomposed and are
  decomposed there, and a wrapper is an inference tensor exactly when the tensor it wraps is
  one (a view of a normal weight stays normal), so a converted model serves in
  ``inference_mode`` as the unconverted one does.
* ``quantize_`` on an already converted model re-configures the wrappers in place (see
  :class:`MXFP8MoEConfig`).

A grouped-mm, bmm or matmul call MXFP8 cannot serve (3D x 3D grouped mm, no ``offs``, the
weight first, dtype or shape it does not support) runs the plain op; each reason is counted in :func:`fallback_counts` and logged
once (``logging.WARNING``), or raises when ``MXFP8MoEConfig(allow_fallback=False)``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import validation as v
from . import weight_cache
from .func_transforms import enter_mode_pre_hook, exit_mode_hook, under_transforms
from ._torchao import AOBaseConfig, register_quantize_module_handler
from .backends import GemmBackend
from .numerics import BLOCK_SIZE, ScaleMode

logger = logging.getLogger(__name__)
aten = torch.ops.aten

_OUT_DTYPES = (torch.bfloat16, torch.float32)
_IN_DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class MXFP8MoEConfig(AOBaseConfig):
    """Train the converted expert weights' grouped GEMMs in MXFP8.

    Args:
        scale_mode: e8m0 scale rounding, ``"rceil"`` (default) or ``"floor"``.
        backend: GEMM backend, ``"auto"`` (``scaled`` on SM100+, else ``emulated``),
            ``"emulated"`` (dequantize + bf16 ``torch._grouped_mm``, any device) or
            ``"scaled"`` (``torch._scaled_grouped_mm``, SM100+ only).
        out_dtype: output dtype of the MXFP8 grouped GEMM when the call passes no
            ``out_dtype``: ``None`` (default: the dtype of ``mat_a``, as the plain op),
            ``torch.bfloat16`` or ``torch.float32``.
        allow_fallback: when True (default) a call MXFP8 cannot serve runs the plain op
            and is counted and logged once; when False it raises ``ValueError``.
        cache_quantized_weights: when True, each converted weight keeps its quantized fwd and dgrad
            operands and reuses them while the weight is unchanged, so with gradient accumulation the
            weights are quantized once per optimizer step instead of once per micro-batch. Every write to
            the weight drops them -- optimizer steps of every kind, in-place ops on it or any view of it,
            ``.data`` writes and assignment, ``load_state_dict``, writes into its ``state_dict()`` tensors,
            FSDP2 all-gathers -- and entries are keyed by the exact view (see
            :mod:`moe_quant.weight_cache`). Costs memory: two bf16 copies of every converted weight on the
            emulated GEMM (two fp8 copies plus scales on the scaled one), held between steps. Off by
            default.

    Use it as ``quantize_(model, MXFP8MoEConfig(...), filter_fn=...)``. The handler converts every
    3-D floating-point parameter of each matched module (the stacked expert weights ``(E, N, K)``).

    **filter_fn.** Match the routed-experts module itself. For torchtitan's ``GroupedExperts`` (or
    :class:`moe_quant.moe.GroupedExperts`) the robust choice is an ``isinstance`` filter::

        quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))

    A name filter such as ``lambda mod, fqn: "experts" in fqn`` also matches torchtitan's
    ``shared_experts`` (a ``FeedForward`` with 2-D weights): nothing is converted there, and a
    warning says so once per module class (not once per layer).

    **Calling quantize_ again re-configures.** On a model that is already converted, ``quantize_``
    with another ``MXFP8MoEConfig`` swaps the config of each matched wrapper in place (e.g. RCEIL
    then FLOOR: the next grouped-mm call runs FLOOR). The wrapped weights, the ``nn.Parameter``
    objects, optimizer state and ``state_dict`` keys are untouched; ``torch.compile`` recompiles on
    the next call. With an equal config it is a no-op. A parameter already sharded by FSDP2
    (``fully_shard``) cannot be re-configured (``ValueError``): call ``quantize_`` before
    ``fully_shard``, as for the first conversion.
    """

    scale_mode: ScaleMode = ScaleMode.RCEIL
    backend: GemmBackend = GemmBackend.AUTO
    out_dtype: Optional[torch.dtype] = None
    allow_fallback: bool = True
    cache_quantized_weights: bool = False

    def __post_init__(self):
        object.__setattr__(self, "scale_mode", ScaleMode.parse(self.scale_mode, "scale_mode"))
        object.__setattr__(self, "backend", GemmBackend.parse(self.backend, "backend"))
        if self.out_dtype is not None and self.out_dtype not in _OUT_DTYPES:
            raise ValueError(
                f"out_dtype must be None, torch.bfloat16 or torch.float32, got {self.out_dtype!r}"
            )
        for flag in ("allow_fallback", "cache_quantized_weights"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")


# ----------------------------------------------------------------------------- fallback accounting

_FALLBACKS: collections.Counter = collections.Counter()


def fallback_counts() -> dict[str, int]:
    """Grouped-mm calls on converted weights that ran the plain op, by reason.

    Eager calls are counted one by one; under torch.compile the count grows while the graph
    is traced (once per tracing pass), not on each call of the compiled graph.
    """
    return dict(_FALLBACKS)


def reset_fallback_counts() -> None:
    _FALLBACKS.clear()


@torch._dynamo.assume_constant_result
def _note_fallback(reason: str) -> bool:
    # Runs in Python even while dynamo traces (once per trace), so it never breaks a graph.
    if reason not in _FALLBACKS:
        logger.warning("mxfp8 grouped_mm fallback to the plain op: %s (logged once per reason)", reason)
    _FALLBACKS[reason] += 1
    return True


# ----------------------------------------------------------------------------- the wrapper


# Ops whose outputs are wrappers again. Views share the weight's quantized-operand cache (they read the
# same values); copies get a new one.
_VIEW_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.as_strided.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
}
_COPY_OPS = {
    aten.clone.default,
    aten._to_copy.default,  # .to(dtype / device), .float(), .cuda()
    aten._pin_memory.default,
    aten.empty_like.default,  # Module.to_empty
    aten.new_zeros.default,  # FSDP2 sharding
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
_PRESERVE = _VIEW_OPS | _COPY_OPS


def _written_wrappers(func, args, kwargs) -> list:
    """The wrapper arguments that ``func`` writes to (in-place and ``out=`` arguments, by its schema)."""
    if not func._schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, MXFP8ExpertWeight):
                written.append(t)
    return written


class _Unwrap(torch.autograd.Function):
    """The wrapped tensor, differentiably (the gradient flows through unchanged). In the
    ``forward`` + ``setup_context`` form with a ``vmap`` rule, so ``torch.func`` transforms run it."""

    @staticmethod
    def forward(w):
        return w._data

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad

    @staticmethod
    def vmap(info, in_dims, w):  # a batched wrapper (vmap over stacked weights): unwrap each level
        return _Unwrap.apply(w), in_dims[0]


def _converted(t):
    """The MXFP8ExpertWeight ``t`` is, or wraps under ``torch.func`` wrappers; else None."""
    t = under_transforms(t)
    return t if isinstance(t, MXFP8ExpertWeight) else None


def _plain(t):
    return _Unwrap.apply(t) if _converted(t) is not None else t


class MXFP8ExpertWeight(torch.Tensor):
    """A stacked expert weight whose grouped-mm calls run in MXFP8 (see the module doc).

    ``MXFP8ExpertWeight(data, config)``: ``data`` a 3-D floating-point tensor ``(E, N, K)`` (not
    itself a wrapper), ``config`` an :class:`MXFP8MoEConfig`. Views of a wrapper (any shape) are
    wrappers too; they are built internally without these checks.
    """

    _data: torch.Tensor
    config: MXFP8MoEConfig
    # The quantized-operand cache of the weight, shared with every view of it; every write this wrapper
    # sees invalidates it (moe_quant.weight_cache says which writes those are).
    _weight_cache: weight_cache.QuantizedWeightCache

    @staticmethod
    def __new__(cls, data: torch.Tensor, config: MXFP8MoEConfig, _view: bool = False, _cache=None):
        if not _view:
            _check_wrapper_args(data, config)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, config: MXFP8MoEConfig, _view: bool = False, _cache=None):
        self._data = data
        self.config = config
        self._weight_cache = weight_cache.QuantizedWeightCache(data) if _cache is None else _cache

    def __repr__(self):
        return f"MXFP8ExpertWeight(config={self.config}, data={self._data})"

    def __tensor_flatten__(self):
        return ["_data"], self.config

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, config, outer_size, outer_stride):
        return cls(inner_tensors["_data"], config, _view=True)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd cache key: everything a compiled graph depends on (metadata, no values)."""
        d = self._data
        key = (
            tuple(self.shape), self.stride(), str(self.dtype), self.device.type, self.requires_grad,
            tuple(d.shape), d.stride(), d.storage_offset(), str(d.dtype), repr(self.config),
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    # -- function level: the grouped-mm override

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM_FUNCS:
            return _grouped_mm(func, args, kwargs)
        if func in _BMM_FUNCS:
            return _bmm(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # -- dispatch level: everything else on the wrapped tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _PRESERVE and func is not aten._grouped_mm.default:
            # Under inference_mode the autograd keys are skipped, and with them the decomposition of
            # composite ops (.mT, .to, reshape, ...): they arrive here whole. Decompose them, so that
            # their views come back through the ops above (wrappers) exactly as outside inference_mode.
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        config = cache = None

        def unwrap(t):
            nonlocal config, cache
            config = config or t.config
            cache = cache if cache is not None else t._weight_cache
            return t._data

        u_args, u_kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs))
        if func is aten.detach.default:
            # the same wrapped tensor (already detached): nn.Parameter(w) and w.data keep the weight's own
            # data, whose version counter the cache watches for plain writes (the state_dict() tensors)
            return _rewrap(cls, u_args[0], config, cache)
        if func is aten._grouped_mm.default:
            # Only reachable with torch-function handling disabled: no MXFP8 autograd here.
            _fallback("aten._grouped_mm reached __torch_dispatch__ (torch function disabled)", config)
        # In-place ops mutate the wrapped tensor; PyTorch returns the (wrapper) argument itself. Below
        # autograd no version counter moves, so a written weight invalidates its cache here.
        out = func(*u_args, **u_kwargs)
        for t in _written_wrappers(func, args, kwargs):
            t._weight_cache.invalidate()
        if func in _PRESERVE:
            shared = cache if func in _VIEW_OPS else None  # a copy gets a cache of its own
            return pytree.tree_map_only(
                torch.Tensor, lambda t: _rewrap(cls, t, config, shared) if t.is_floating_point() else t, out
            )
        return out

    # -- writes and copies that do not pass through dispatch

    @property
    def data(self):
        """As ``Tensor.data``: a detached alias (a wrapper reading the same values, sharing the cache)."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        """``weight.data = t``: the wrapper now wraps ``t`` (plain, or another wrapper's data), as a plain
        tensor's ``.data =`` would; shape, dtype and device follow ``t``, the cached operands are dropped."""
        if value is self:
            return
        new = value._data if isinstance(value, MXFP8ExpertWeight) else value
        if not isinstance(new, torch.Tensor) or not new.is_floating_point():
            raise TypeError(f"data must be a floating-point torch.Tensor, got {getattr(new, 'dtype', type(new).__name__)}")
        fresh = _rewrap(type(self), new.detach(), self.config)
        torch._C.TensorBase.data.__set__(self, fresh)  # this wrapper's metadata (shape, strides, dtype, device)
        self._weight_cache.invalidate()  # views taken before keep the old data, and no stale entry survives
        self._data, self._weight_cache = fresh._data, fresh._weight_cache

    def share_memory_(self):
        self._data.share_memory_()
        self._weight_cache.invalidate()
        return self

    def is_shared(self) -> bool:
        return self._data.is_shared()

    def _python_state(self) -> dict:
        """The Python attributes a copy carries (nn.Parameter's flag, config, user attributes): all but the
        wrapped tensor and the cache, which a copy makes anew."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_data", "_weight_cache")}

    def __reduce_ex__(self, protocol):
        # pickling (torch.save, torch.multiprocessing queues): the wrapped tensor, the config and the
        # Python attributes (nn.Parameter's flag among them); the cache is not carried
        return _rebuild_expert_weight, (self._data, self.config, self.requires_grad, self._python_state())

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = _rebuild_expert_weight(
            copy.deepcopy(self._data, memo), self.config, self.requires_grad, copy.deepcopy(self._python_state(), memo)
        )
        memo[id(self)] = new
        return new

    # -- FSDP2 all-gather extension

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = self._data
        # Uneven sharding on dim 0: FSDP2 wants the padded shard size from every rank.
        padded_rows = math.ceil(outer_size[0] / mesh.size())
        if data.shape[0] != padded_rows:
            padded = data.new_zeros((padded_rows, *data.shape[1:]))
            padded[: data.shape[0]].copy_(data)
            data = padded
        if mp_policy.param_dtype is not None:
            data = data.to(mp_policy.param_dtype)
        return (data.contiguous(),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # step 1+: refill the unsharded parameter allocated at step 0
            local = out._local_tensor if hasattr(out, "_local_tensor") else out
            if not isinstance(local, MXFP8ExpertWeight):
                raise RuntimeError(f"expected an MXFP8ExpertWeight unsharded parameter, got {type(local).__name__}")
            if local._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                local._data.copy_(data)
            # the all-gather wrote new values into the unsharded weight, maybe straight into its storage
            local._weight_cache.invalidate()
            return None
        return MXFP8ExpertWeight(data, self.config, _view=True), (data,)


def _rebuild_expert_weight(data, config, requires_grad, state) -> "MXFP8ExpertWeight":
    w = MXFP8ExpertWeight(data, config, _view=True)
    if requires_grad:
        w.requires_grad_(True)
    w.__dict__.update(state)
    return w


def _rewrap(cls, t: torch.Tensor, config: MXFP8MoEConfig, cache=None) -> MXFP8ExpertWeight:
    """The wrapper around an op's output ``t``, an inference tensor exactly when ``t`` is one.

    Under ``torch.inference_mode`` a view of a normal tensor is a normal tensor (it shares its
    base's version counter), but a wrapper made there would be an inference tensor, which has
    no version counter: autograd's view bookkeeping then fails with "Cannot set version_counter
    for inference tensor". So the wrapper is made in the inference state of what it wraps.
    """
    inference = t.is_inference()
    if inference != torch.is_inference_mode_enabled():
        with torch.inference_mode(inference):
            return cls(t, config, _view=True, _cache=cache)
    return cls(t, config, _view=True, _cache=cache)


def _check_wrapper_args(data, config) -> None:
    if isinstance(data, MXFP8ExpertWeight):
        raise TypeError("data must be a plain tensor: MXFP8ExpertWeight cannot wrap another MXFP8ExpertWeight")
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a torch.Tensor (stacked expert weights (E, N, K)), got {type(data).__name__}")
    if not data.is_floating_point():
        raise TypeError(f"data must be a floating-point tensor, got {data.dtype}")
    if data.ndim != 3:
        raise ValueError(f"data must be 3-D stacked expert weights (E, N, K), got shape {tuple(data.shape)}")
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"config must be an MXFP8MoEConfig, got {type(config).__name__}")


# ----------------------------------------------------------------------------- grouped-mm override

_GROUPED_MM_FUNCS = {torch._grouped_mm, aten._grouped_mm, aten._grouped_mm.default}
if hasattr(F, "grouped_mm"):  # today a Python function calling torch._grouped_mm; also catch it directly
    _GROUPED_MM_FUNCS.add(F.grouped_mm)
_ARG_NAMES = (("input", "self", "mat_a"), ("mat2", "mat_b"), ("offs",), ("bias",), ("out_dtype",))


def _bind(args, kwargs):
    values = list(args) + [None] * (len(_ARG_NAMES) - len(args))
    for i, names in enumerate(_ARG_NAMES):
        for name in names:
            if name in kwargs:
                values[i] = kwargs[name]
    unknown = set(kwargs) - {n for names in _ARG_NAMES for n in names}
    if unknown:
        raise TypeError(f"grouped_mm got unexpected keyword arguments {sorted(unknown)}")
    return values


def _unsupported_reason(mat_a, mat_b, offs, out_dtype) -> Optional[str]:
    if _converted(mat_a) is not None or _converted(mat_b) is None:
        return "the converted weight is not mat_b (the second operand)"
    if mat_a.ndim != 2 or mat_b.ndim != 3:
        return f"{mat_a.ndim}D x {mat_b.ndim}D operands (MXFP8 serves 2D x 3D with offs)"
    if offs is None:
        return "2D x 3D without offs"
    if mat_a.dtype not in _IN_DTYPES or mat_b.dtype not in _IN_DTYPES:
        return f"dtypes {mat_a.dtype} x {mat_b.dtype} (MXFP8 serves bfloat16 / float32)"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype {out_dtype} (MXFP8 serves bfloat16 / float32)"
    k, n = mat_b.shape[-2], mat_b.shape[-1]
    if k % BLOCK_SIZE or n % BLOCK_SIZE:
        return f"K={k} / N={n} not multiples of {BLOCK_SIZE}"
    return None


def _fallback(reason: str, config: Optional[MXFP8MoEConfig]) -> None:
    if config is not None and not config.allow_fallback:
        raise ValueError(f"MXFP8 grouped_mm cannot serve this call ({reason}) and allow_fallback=False")
    _note_fallback(reason)


def _add_bias(out: torch.Tensor, bias: torch.Tensor, offs: Optional[torch.Tensor], n_groups: int) -> torch.Tensor:
    """``bias`` (N,) / (1, N): added to every row; (E, N) with E > 1: one row per group."""
    if bias.ndim == 2 and bias.shape[0] == n_groups and n_groups > 1:
        if out.ndim == 3:  # (E, M, N) from 3D operands
            return out + bias.unsqueeze(1).to(out.dtype)
        if offs is None:
            raise ValueError("a per-group bias (E, N) needs offs")
        rows = torch.arange(out.shape[0], device=out.device, dtype=offs.dtype)
        group = torch.searchsorted(offs, rows, right=True).clamp(max=n_groups - 1)
        return out + bias.to(out.dtype)[group]
    return out + bias.to(out.dtype)


def _grouped_mm(func, args, kwargs):
    from .autograd import mxfp8_grouped_mm

    mat_a, mat_b, offs, bias, out_dtype = _bind(args, kwargs)
    weight = _converted(mat_b) if _converted(mat_b) is not None else _converted(mat_a)
    config: MXFP8MoEConfig = weight.config
    n_groups = weight.shape[0] if weight.ndim == 3 else (offs.numel() if offs is not None else 1)
    resolved = out_dtype if out_dtype is not None else (config.out_dtype or mat_a.dtype)
    if bias is not None:  # checked before any work, MXFP8 or fallback
        v.check_bias(bias, mat_b.shape[-1], n_groups)
    reason = _unsupported_reason(mat_a, mat_b, offs, resolved)
    if reason is None:
        cache = weight._weight_cache if config.cache_quantized_weights else None
        out = mxfp8_grouped_mm(  # fp32 master weights are read as bf16
            mat_a, _plain(mat_b), offs, scale_mode=config.scale_mode, out_dtype=resolved, backend=config.backend,
            weight_cache=cache,
        )
    else:
        _fallback(reason, config)
        out = torch._grouped_mm(_plain(mat_a), _plain(mat_b), offs=offs, out_dtype=out_dtype)
    if bias is not None:
        out = _add_bias(out, bias, offs, n_groups)
    return out


# ----------------------------------------------------------------------------- bmm override (HF Llama4)

# torch.bmm and torch.matmul / @ of an (E, T, K) input by a converted (E, K, N) weight (every expert
# sees T tokens, as in Hugging Face's Llama4TextExperts) is a grouped GEMM of E uniform groups of T rows.
_BMM_FUNCS = {torch.bmm, torch.Tensor.bmm, aten.bmm, aten.bmm.default, torch.matmul, torch.Tensor.matmul,
              torch.Tensor.__matmul__}


def _bmm(func, args, kwargs):
    names = (("input", "self"), ("mat2", "other"))
    a, b = list(args[:2]) + [next((kwargs[n] for n in ns if n in kwargs), None) for ns in names[len(args[:2]):]]
    extra = sorted(set(kwargs) - {n for ns in names for n in ns})
    weight = b if isinstance(b, MXFP8ExpertWeight) else a
    op = getattr(func, "__name__", str(func))
    if not isinstance(weight, MXFP8ExpertWeight):  # the wrapper is elsewhere (out=): not an expert GEMM
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if extra:
        reason = f"{op} with keyword arguments {extra}"
    elif isinstance(a, MXFP8ExpertWeight) or not isinstance(b, MXFP8ExpertWeight):
        reason = f"{op}: the converted weight is not the second operand"
    elif a.ndim != 3 or b.ndim != 3:  # reasons name no sizes: each is logged once, not once per shape
        reason = f"{op} of {a.ndim}D x {b.ndim}D operands (MXFP8 serves (E, T, K) x (E, K, N))"
    elif a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        reason = f"{op} with a broadcast batch or mismatched K (MXFP8 serves (E, T, K) x (E, K, N))"
    else:
        e, t, k = a.shape
        a2 = a.reshape(e * t, k)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=a.device) * t
        reason = _unsupported_reason(a2, b, offs, weight.config.out_dtype or a.dtype)
        if reason is None:
            return _grouped_mm(torch._grouped_mm, (a2, b), {"offs": offs}).view(e, t, -1)
        reason = f"{op}: {reason}"
    _fallback(reason, weight.config)
    u_args, u_kwargs = pytree.tree_map_only(MXFP8ExpertWeight, _plain, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*u_args, **u_kwargs)


# ----------------------------------------------------------------------------- conversion


def _unwrap_for_checkpoint(t):
    if isinstance(t, MXFP8ExpertWeight):
        return t._data
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2) around a wrapper
    if isinstance(local, MXFP8ExpertWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local._data, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for name in getattr(module, "_mxfp8_converted", ()):
        key = prefix + name
        value = state_dict.get(key)
        if value is not None and not isinstance(value, nn.Parameter):  # keep_vars=True keeps parameters
            state_dict[key] = _unwrap_for_checkpoint(value)


def _load_state_dict_post_hook(module, incompatible_keys):
    # load_state_dict(assign=True) replaces the parameter by the checkpoint's plain tensor: re-wrap it.
    for name in getattr(module, "_mxfp8_converted", ()):
        param = getattr(module, name, None)
        if isinstance(param, torch.Tensor) and not _is_converted(param):
            wrapped = MXFP8ExpertWeight(param.detach(), module._mxfp8_config)
            setattr(module, name, nn.Parameter(wrapped, requires_grad=param.requires_grad))


def _is_converted(t) -> bool:
    return isinstance(t, MXFP8ExpertWeight) or isinstance(getattr(t, "_local_tensor", None), MXFP8ExpertWeight)


def convert_parameters(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    """Wrap each 3-D floating-point parameter of ``module`` and its submodules (or only
    ``parameter_name``) in :class:`MXFP8ExpertWeight`, in place; returns ``module``."""
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"config must be an MXFP8MoEConfig, got {type(config).__name__}")
    found = False
    for mod in module.modules():
        converted, reconfigured = [], False
        for name, param in list(mod.named_parameters(recurse=False)):
            if parameter_name is not None and name != parameter_name:
                continue
            if _is_converted(param):
                found = True
                reconfigured |= _reconfigure(mod, name, param, config)
                continue
            if param.ndim != 3 or not param.is_floating_point():
                continue
            if getattr(param, "_local_tensor", None) is not None:
                raise ValueError(
                    f"parameter {name!r} is already a DTensor (sharded); call quantize_ before fully_shard"
                )
            _wrap_parameter(mod, name, param, config)
            converted.append(name)
            found = True
            logger.info("converted %s.%s %s to MXFP8ExpertWeight", type(mod).__name__, name, tuple(param.shape))
        if converted:
            if not getattr(mod, "_mxfp8_hooked", False):
                mod.register_state_dict_post_hook(_state_dict_hook)
                mod.register_load_state_dict_post_hook(_load_state_dict_post_hook)
                mod.register_forward_pre_hook(enter_mode_pre_hook)  # torch.func transforms
                mod.register_forward_hook(exit_mode_hook, always_call=True)
                mod._mxfp8_hooked = True
            mod._mxfp8_converted = tuple(sorted(set(getattr(mod, "_mxfp8_converted", ())) | set(converted)))
        if converted or reconfigured:
            mod._mxfp8_config = config
    if not found:
        _warn_nothing_converted(module)
    return module


# parameters replaced by a new object (where swapping in place was refused), so that a parameter tied
# between modules converts to one parameter, whichever module quantize_ visits first
_REPLACED = WeakIdKeyDictionary()


def _wrap_parameter(mod: nn.Module, name: str, param: nn.Parameter, config: MXFP8MoEConfig) -> None:
    """Make ``mod.<name>`` a converted weight. The parameter object itself becomes the wrapper
    (``torch.utils.swap_tensors``), so every module that holds it -- a tied parameter -- and every
    optimizer built before the conversion sees one converted parameter."""
    replaced = _REPLACED.get(param)
    if replaced is not None:  # a tie whose other end was converted by replacement
        setattr(mod, name, replaced)
        return
    new = nn.Parameter(MXFP8ExpertWeight(param.detach(), config), requires_grad=param.requires_grad)
    if type(param) is nn.Parameter:
        try:
            torch.utils.swap_tensors(param, new)
            return
        except RuntimeError as e:  # weak references to it, or C++ holds it (a live autograd graph)
            logger.debug("converting %s by replacement (swap refused: %s)", name, e)
    _REPLACED[param] = new
    setattr(mod, name, new)


# module classes already warned about: a filter such as ``"experts" in fqn`` matches torchtitan's
# ``shared_experts`` (a FeedForward) in every layer; one warning per class says it all.
_WARNED_NOTHING_CONVERTED: set = set()


def _warn_nothing_converted(module: nn.Module) -> None:
    cls = type(module)
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _WARNED_NOTHING_CONVERTED:
        logger.debug("MXFP8MoEConfig matched %s; nothing converted", key)
        return
    _WARNED_NOTHING_CONVERTED.add(key)
    logger.warning(
        "MXFP8MoEConfig matched %s, which has no 3-D floating-point parameter (stacked expert "
        "weights); nothing converted. Check quantize_'s filter_fn: a name filter such as "
        "'\"experts\" in fqn' also matches shared experts; an isinstance filter "
        "(lambda mod, fqn: isinstance(mod, GroupedExperts)) matches only the routed experts. "
        "(Logged once per module class.)",
        cls.__name__,
    )


def _reconfigure(mod: nn.Module, name: str, param, config: MXFP8MoEConfig) -> bool:
    """An already converted parameter takes ``config`` in place (its data untouched); True if it changed."""
    local = param if isinstance(param, MXFP8ExpertWeight) else param._local_tensor
    if local.config == config:
        return False
    if local is not param:  # FSDP2 keeps its own unsharded copy of the wrapper, with the old config
        raise ValueError(
            f"parameter {name!r} is already sharded by FSDP2 (a DTensor) with {local.config}; it cannot be "
            f"re-configured to {config}: call quantize_ before fully_shard"
        )
    logger.info("re-configured %s.%s: %s -> %s", type(mod).__name__, name, local.config, config)
    local.config = config
    local._weight_cache.clear()  # operands of the old config (scale mode, backend) are never used again
    return True


@register_quantize_module_handler(MXFP8MoEConfig)
def _mxfp8_moe_transform(module: nn.Module, config: MXFP8MoEConfig, parameter_name: Optional[str] = None) -> nn.Module:
    return convert_parameters(module, config, parameter_name)


def unwrap_parameters(module: nn.Module) -> nn.Module:
    """Undo the conversion in place: converted parameters become plain parameters again."""
    for mod in module.modules():
        for name in getattr(mod, "_mxfp8_converted", ()):
            param = getattr(mod, name)
            if isinstance(param, MXFP8ExpertWeight):
                setattr(mod, name, nn.Parameter(param._data.detach(), requires_grad=param.requires_grad))
        mod.__dict__.pop("_mxfp8_converted", None)
    return module


__all__ = [
    "MXFP8MoEConfig",
    "MXFP8ExpertWeight",
    "convert_parameters",
    "unwrap_parameters",
    "fallback_counts",
    "reset_fallback_counts",
]
