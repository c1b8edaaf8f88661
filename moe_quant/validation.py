"""Argument checks for the public API: clear Python errors before any kernel runs.

Value checks on ``offs`` (monotone, within M) read the tensor, so they run only where
that costs no device-host synchronization (``offs`` on the CPU) or when asked for;
kernels and the reference sanitize offsets themselves, so bad values never cause an
out-of-bounds write.
"""

from __future__ import annotations

import operator

import torch

from .numerics import BLOCK_SIZE

_A_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)
# inputs of the quantizers: the dtypes the kernels and the GEMMs take
OPERAND_DTYPES = (torch.bfloat16, torch.float32)
# to_mxfp8 / from_mxfp8 (reference only): any IEEE float dtype the fp32 math represents exactly
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def check_tensor(name: str, t, *, dtypes, ndim: int | None = None, min_ndim: int | None = None) -> None:
    """``t`` is a tensor of one of ``dtypes`` with exactly ``ndim`` (or at least ``min_ndim``) dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dim(s), got shape {tuple(t.shape)}")


def check_dtype_choice(name: str, dtype, allowed) -> None:
    """``dtype`` is one of ``allowed`` (a ``torch.dtype`` argument such as ``out_dtype``)."""
    if dtype not in allowed:
        raise TypeError(f"{name} must be one of {[str(d) for d in allowed]}, got {dtype!r}")


def check_size(name: str, value) -> int:
    """A non-negative integer size argument (Python or NumPy int; symbolic sizes pass through)."""
    if isinstance(value, torch.SymInt):
        return value
    if torch.compiler.is_compiling() and isinstance(value, int) and not isinstance(value, bool):
        # Dynamo presents a size read from device data (an unbacked SymInt) as an int here, and
        # operator.index would specialize it: check it symbolically instead (a runtime assert)
        torch._check(value >= 0, lambda name=name: f"{name} must be a non-negative int")  # bound: dynamo 2.11 reads no closure
        return value
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def check_block_multiple(name: str, dim_name: str, size: int) -> None:
    if size % BLOCK_SIZE != 0:
        raise ValueError(f"{name}: {dim_name} = {size} must be a multiple of {BLOCK_SIZE} (the MX block size)")


def check_offsets(
    offs, *, n_groups: int | None, total: int, device: torch.device | None, validate: bool | None = None
) -> torch.Tensor:
    """``offs``: int32, 1-D, ``n_groups`` long, on ``device``; values checked where cheap (see module doc).

    Returns the offsets to use from here on: ``offs`` itself, except under ``torch.compile`` with
    value checks on, where the values are unknown while tracing. There the result is the output of
    the custom op ``moe_quant::check_offsets``, which runs the same checks (the same ``ValueError``)
    when the compiled graph runs; the caller must use it, or the check is dead code in the graph.
    """
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a torch.Tensor of int32 group end offsets, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must have dtype torch.int32, got {offs.dtype}")
    if offs.ndim != 1:
        raise ValueError(f"offs must be 1-D (one end offset per group), got shape {tuple(offs.shape)}")
    if n_groups is not None and offs.numel() != n_groups:
        raise ValueError(f"offs must have one entry per expert ({n_groups}), got {offs.numel()}")
    if device is not None and offs.device != device:
        raise ValueError(f"offs must be on the same device as the input ({device}), got {offs.device}")
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate_offsets must be None, True or False, got {validate!r}")
    if validate is None:
        validate = offs.device.type == "cpu"
    if not validate or offs.numel() == 0:
        return offs
    if _is_compiling():
        return torch.ops.moe_quant.check_offsets(offs, total)
    check_offset_values(_unbatched(offs), total)
    return offs


def _unbatched(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``torch.func`` wrappers, vmapped dims first: ``(*batch, G)``.

    Under ``torch.vmap`` a batched ``offs`` cannot be read (data-dependent control flow); its
    values are checked for every batch element at once instead.
    """
    from torch._C import _functorch as ft

    while ft.is_functorch_wrapped_tensor(t):
        bdim = ft.maybe_get_bdim(t) if ft.is_batchedtensor(t) else None
        t = ft.get_unwrapped(t)
        if bdim is not None and bdim >= 0:
            t = t.movedim(bdim, 0)
    return t


def check_offset_values(offs: torch.Tensor, total: int) -> None:
    """Group ends (last dim; leading dims are vmapped batches) non-negative, non-decreasing, <= total."""
    o = offs.detach().cpu().to(torch.int64)
    if o.numel() == 0:
        return
    if bool((o < 0).any()):
        raise ValueError(f"offs must be non-negative, got {o.tolist()}")
    if bool((o[..., 1:] < o[..., :-1]).any()):
        raise ValueError(f"offs must be non-decreasing cumulative group ends, got {o.tolist()}")
    last = int(o[..., -1].max())
    if last > total:
        raise ValueError(f"offs[-1] = {last} is past the number of rows M = {total}")


@torch.library.custom_op("moe_quant::check_offsets", mutates_args=())
def _check_offsets_op(offs: torch.Tensor, total: int) -> torch.Tensor:
    """:func:`check_offset_values` inside a compiled graph; returns a copy of the (valid) offsets."""
    check_offset_values(offs, total)
    return offs.clone()


@_check_offsets_op.register_fake
def _(offs, total):
    return torch.empty_like(offs)


def check_bool(name: str, value) -> None:
    """``TypeError`` naming the option ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_grouped_mm_args(A, W_t, offs, out_dtype, validate_offsets: bool | None) -> torch.Tensor:
    """Inputs of ``mxfp8_grouped_mm``: A (M, K), W_t (E, K, N), offs (E,) int32; returns ``offs``
    as :func:`check_offsets` does."""
    check_tensor("A", A, dtypes=_A_DTYPES, ndim=2)
    check_tensor("W_t", W_t, dtypes=_A_DTYPES, ndim=3)  # fp32 master weights are read as bf16
    check_dtype_choice("out_dtype", out_dtype, _OUT_DTYPES)
    m, k = A.shape
    e, k_w, n = W_t.shape
    if k_w != k:
        raise ValueError(
            f"W_t must be (E, K, N) with K = A.shape[1] = {k} (the contraction dim), got shape {tuple(W_t.shape)}"
        )
    check_block_multiple("A", "K (A.shape[1])", k)
    check_block_multiple("W_t", "N (W_t.shape[2])", n)
    if W_t.device != A.device:
        raise ValueError(f"W_t must be on the same device as A ({A.device}), got {W_t.device}")
    return check_offsets(offs, n_groups=e, total=m, device=A.device, validate=validate_offsets)


def _check_block_tensors(x, **weights) -> None:
    """``x`` 2-D and each weight 3-D, bf16 or fp32 (fp32 master weights are read as bf16), on ``x``'s device."""
    check_tensor("x", x, dtypes=_A_DTYPES, ndim=2)
    for name, w in weights.items():
        check_tensor(name, w, dtypes=_A_DTYPES, ndim=3)
        if w.device != x.device:
            raise ValueError(f"{name} must be on the same device as x ({x.device}), got {w.device}")


def check_swiglu_experts_args(x, w1, w3, w2, offs, validate_offsets: bool | None) -> torch.Tensor:
    """Inputs of ``mxfp8_swiglu_experts``: ``x (M, D)``, ``w1``/``w3 (E, H, D)``, ``w2 (E, D, H)``,
    ``offs (E,)`` int32 (the :class:`moe_quant.moe.GroupedExperts` convention); returns ``offs`` as
    :func:`check_offsets` does."""
    _check_block_tensors(x, w1=w1, w3=w3, w2=w2)
    m, d = x.shape
    e, h, d1 = w1.shape
    if d1 != d:
        raise ValueError(f"w1 must be (E, H, D) with D = x.shape[1] = {d}, got shape {tuple(w1.shape)}")
    if tuple(w3.shape) != (e, h, d):
        raise ValueError(f"w3 must have the shape of w1 (E, H, D) = {(e, h, d)}, got {tuple(w3.shape)}")
    if tuple(w2.shape) != (e, d, h):
        raise ValueError(f"w2 must be (E, D, H) = {(e, d, h)} (w1's dims swapped), got {tuple(w2.shape)}")
    check_block_multiple("x", "D (x.shape[1])", d)
    check_block_multiple("w1", "H (w1.shape[1])", h)
    return check_offsets(offs, n_groups=e, total=m, device=x.device, validate=validate_offsets)


def check_swiglu_experts_w13_args(x, w13, w2, offs, validate_offsets: bool | None) -> torch.Tensor:
    """Inputs of ``mxfp8_swiglu_experts_w13``: ``x (M, D)``, ``w13 (E, 2H, D)`` (gate rows, then up rows),
    ``w2 (E, D, H)``, ``offs (E,)`` int32; returns ``offs`` as :func:`check_offsets` does."""
    _check_block_tensors(x, w13=w13, w2=w2)
    m, d = x.shape
    e, h2, d1 = w13.shape
    if d1 != d:
        raise ValueError(f"w13 must be (E, 2H, D) with D = x.shape[1] = {d}, got shape {tuple(w13.shape)}")
    if h2 % 2:
        raise ValueError(f"w13 must be (E, 2H, D) (gate rows, then up rows): its dim 1 ({h2}) must be even")
    if tuple(w2.shape) != (e, d, h2 // 2):
        raise ValueError(f"w2 must be (E, D, H) = {(e, d, h2 // 2)} (H = w13.shape[1] / 2), got {tuple(w2.shape)}")
    check_block_multiple("x", "D (x.shape[1])", d)
    check_block_multiple("w13", "H (w13.shape[1] / 2)", h2 // 2)
    return check_offsets(offs, n_groups=e, total=m, device=x.device, validate=validate_offsets)


def check_last_dim_blocks(name: str, t: torch.Tensor) -> None:
    """The last dim of ``t`` (at least 1-D) is a whole number of MX blocks."""
    check_block_multiple(name, f"the last dim ({name}.shape[-1])", t.shape[-1])


def check_shape(name: str, t: torch.Tensor, expected, what: str) -> None:
    """``t.shape == expected``; ``what`` says where the expectation comes from."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


# ----------------------------------------------------------------------------- public quantizers


def check_operand_2d(name: str, x, *, blocked_last_dim: bool) -> None:
    """A 2-D bf16/fp32 operand; with ``blocked_last_dim`` its last dim is a multiple of 32."""
    check_tensor(name, x, dtypes=OPERAND_DTYPES, ndim=2)
    if blocked_last_dim:
        check_block_multiple(name, f"K ({name}.shape[1])", x.shape[1])


def check_group_offsets(offs, x: torch.Tensor, *, required: bool) -> None:
    """``offs`` of a quantizer: int32 1-D group ends on ``x``'s device (values are sanitized, not checked)."""
    if offs is None:
        if required:
            raise TypeError("offs must be a torch.Tensor of int32 group end offsets, got None")
        return
    check_offsets(offs, n_groups=None, total=x.shape[0], device=x.device, validate=False)


def parse_along(along) -> str:
    """``along`` of :func:`quantize_3d`: ``"k"`` or ``"n"`` (any case)."""
    if isinstance(along, str) and along.lower() in ("k", "n"):
        return along.lower()
    raise ValueError(f"along must be 'k' or 'n', got {along!r}")


def check_weight_3d(name: str, w, along: str) -> None:
    """Expert weights ``(E, N, K)``: bf16/fp32, the quantized dim (K or N) a multiple of 32."""
    check_tensor(name, w, dtypes=OPERAND_DTYPES, ndim=3)
    if along == "k":
        check_block_multiple(name, f"K ({name}.shape[2])", w.shape[2])
    else:
        check_block_multiple(name, f"N ({name}.shape[1])", w.shape[1])


# ----------------------------------------------------------------------------- to_mxfp8 / from_mxfp8


def check_to_mxfp8_args(x) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_last_dim_blocks("x", x)


def check_from_mxfp8_args(data, scales, out_dtype) -> None:
    check_tensor("data", data, dtypes=(torch.float8_e4m3fn,), min_ndim=1)
    check_last_dim_blocks("data", data)
    check_tensor("scales", scales, dtypes=SCALE_DTYPES)
    check_shape("scales", scales, (*data.shape[:-1], data.shape[-1] // BLOCK_SIZE), "one scale per 32 elements of data")
    check_same_device("scales", scales, "data", data)
    check_dtype_choice("out_dtype", out_dtype, FLOAT_DTYPES)
