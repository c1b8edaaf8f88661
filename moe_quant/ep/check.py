"""The EP MoE block against the single-process converted block, on one rank of a process group.

Used by ``tests/test_ep.py`` (gloo ranks on the CPU) and ``scripts/ep_check.py`` (torchrun, any size).
Every rank builds the same global model and the same inputs (seeded), runs its shard of the
expert-parallel block (:class:`moe_quant.moe.EPMoE`) forward and backward, runs the single-process
converted :class:`moe_quant.moe.MoE` on all ranks' tokens (global token order rank-major, the routing
each rank computed for its own tokens) and compares its own shard: forward output and input gradient
bit for bit, expert weight gradients by SQNR (against the single-process MXFP8 block and against bf16).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.utils._python_dispatch

from .. import quantize as q
from .. import validation
from ..backends import GemmBackend, resolve_gemm_backend
from ..moe import EPMoE, MoE
from . import blocks
from .wire import WireLog

_LEGS = ("dispatch", "combine", "combine backward", "dispatch backward")


@dataclasses.dataclass
class CheckCase:
    dim: int = 64
    hidden_dim: int = 96
    experts_per_rank: int = 2
    top_k: int = 2
    tokens: tuple = (40,)  # tokens of each rank; one value: the same on every rank
    routing: str = "router"  # "router" | "one_rank" (every token to experts 0..top_k-1: one rank receives all)
    wire: str = "mxfp8"
    scale_mode: str = "rceil"
    convert: bool = True  # the experts converted with MXFP8MoEConfig (else bf16 experts)
    seed: int = 0
    transport: str = "all_to_all"  # the dispatcher's transport ("all_to_all" | "p2p")
    chunks: int = 1  # ranges of local experts ("p2p")
    sm_carveout: int | None = None  # SMs the experts' GEMMs leave to the exchange (chunks > 1)
    capacity_factor: float | None = None  # the dispatcher's sync-free mode (None: synced)
    experts_dtype: str | None = None  # the experts' weights' dtype ("bfloat16", ...), if not the activations'

    def tokens_of(self, rank: int) -> int:
        return self.tokens[rank] if len(self.tokens) > 1 else self.tokens[0]


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |ref - x|^2)`` in fp32 (inf where equal)."""
    ref, x = ref.float(), x.float()
    err = (ref - x).pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _convert(module, case: CheckCase):
    from torchao.quantization import quantize_

    from ..conversion import MXFP8MoEConfig

    quantize_(module, MXFP8MoEConfig(scale_mode=case.scale_mode), filter_fn=lambda mod, fqn: "experts" in fqn)
    return module


def _inputs(case: CheckCase, world: int, device, dtype):
    xs, gouts = [], []
    for r in range(world):
        g = torch.Generator().manual_seed(case.seed * 1000 + r + 1)
        t = case.tokens_of(r)
        xs.append(torch.randn(t, case.dim, generator=g).to(device, dtype))
        gouts.append(torch.randn(t, case.dim, generator=g).to(device, dtype))
    return xs, gouts


def _routing(model: MoE, x: torch.Tensor, case: CheckCase, n_experts: int):
    if case.routing == "router":
        return model.router(x)
    if case.routing != "one_rank":
        raise ValueError(f"routing must be 'router' or 'one_rank', got {case.routing!r}")
    t = x.shape[0]
    ids = torch.arange(case.top_k, device=x.device).expand(t, case.top_k).contiguous()
    scores = torch.linspace(0.2, 0.8, t * case.top_k, device=x.device).view(t, case.top_k)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device)
    counts[: case.top_k] = t
    return scores, ids, counts


@contextlib.contextmanager
def _count_passes(counter: dict):
    """Counts the emulated GEMMs' quantization passes (``fake_rowwise``: 1x32, ``fake_colwise_k_groups`` and
    ``colwise_k_groups_plain``: 32x1, the latter the fp8 forms the fused block keeps of x and, with
    ``dswiglu_cols_fp8``, makes of grad_a and grad_b) and the fused SwiGLU block's calls
    (``moe_quant.autograd.mxfp8_swiglu_experts``, which the conversion looks up on each call)."""
    from .. import autograd

    patched = [(q, "fake_rowwise", "rowwise"), (q, "fake_colwise_k_groups", "colwise"),
               (q, "colwise_k_groups_plain", "colwise"), (autograd, "mxfp8_swiglu_experts", "block")]
    originals = [getattr(owner, name) for owner, name, _ in patched]
    for (owner, name, key), original in zip(patched, originals):
        counter[key] = 0

        def counting(*args, _original=original, _key=key, **kwargs):
            counter[_key] += 1
            return _original(*args, **kwargs)

        setattr(owner, name, counting)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)


def _run(model, xs_local, routings, gouts, forward):
    out = forward(model, xs_local, routings)
    (out.float() * torch.cat(gouts).float()).sum().backward()
    return out


def run_check(case: CheckCase, group=None, device="cpu", dtype=torch.bfloat16) -> dict:
    """Runs ``case`` on this rank; returns its measurements (see the module doc)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device(device)
    n_experts = case.experts_per_rank * world
    torch.manual_seed(case.seed)
    base = MoE(case.dim, case.hidden_dim, n_experts, case.top_k).to(device, dtype)
    if case.experts_dtype is not None:  # e.g. fp32 activations (and router) into bf16 experts
        base.experts.to(getattr(torch, case.experts_dtype))
    ep = EPMoE.from_moe(base, group=group, wire=case.wire, scale_mode=case.scale_mode, transport=case.transport,
                        chunks=case.chunks, sm_carveout=case.sm_carveout, capacity_factor=case.capacity_factor)
    ref = copy.deepcopy(base)
    bf16 = copy.deepcopy(base)
    if case.convert:
        _convert(ref, case)
        _convert(ep, case)
    xs, gouts = _inputs(case, world, device, dtype)

    # single process: every rank's tokens, rank-major, each routed as its rank routes them
    leaves = {name: [x.clone().requires_grad_() for x in xs] for name in ("ref", "bf16")}
    results, routings = {}, {}
    for name, model in (("ref", ref), ("bf16", bf16)):
        rts = routings[name] = [_routing(model, x, case, n_experts) for x in leaves[name]]
        out = model.forward_routed(torch.cat(leaves[name]), torch.cat([r[0] for r in rts]),
                                   torch.cat([r[1] for r in rts]), sum(r[2] for r in rts))
        (out.float() * torch.cat(gouts).float()).sum().backward()
        results[name] = out
    lo = sum(case.tokens_of(r) for r in range(rank))
    hi = lo + case.tokens_of(rank)

    # expert parallel: this rank's tokens only
    x = xs[rank].clone().requires_grad_()
    calls = {}
    with WireLog() as log, _count_passes(calls):
        scores, ids, counts = _routing(ep, x, case, n_experts)
        out = ep.forward_routed(x, scores, ids, counts)
        (out.float() * gouts[rank].float()).sum().backward()

    n = case.experts_per_rank
    local_counts = sum(r[2] for r in routings["ref"])[rank * n:(rank + 1) * n]
    own = routings["ref"][rank]
    routing_equal = bits_equal(ids, own[1]) and bits_equal(scores.detach(), own[0].detach())
    empty = [e for e in range(n) if int(local_counts[e]) == 0]
    empty_zero = all(bool((getattr(ep.experts, w).grad[e] == 0).all()) for w in ("w1", "w2", "w3") for e in empty)
    wgrad = {}
    for w in ("w1", "w2", "w3"):
        g_ep = getattr(ep.experts, w).grad
        g_ref = getattr(ref.experts, w).grad[rank * n:(rank + 1) * n]
        g_bf16 = getattr(bf16.experts, w).grad[rank * n:(rank + 1) * n]
        wgrad[w] = {"vs_mxfp8": sqnr_db(g_ref, g_ep), "vs_bf16": sqnr_db(g_bf16, g_ep),
                    "single_process_mxfp8_vs_bf16": sqnr_db(g_bf16, g_ref)}
    legs = {}
    for leg in _LEGS:
        rows, nbytes = log.by_leg(leg)
        legs[leg] = {"rows": rows, "bytes": nbytes, "bytes_per_token": nbytes / rows if rows else None}
    emulated = resolve_gemm_backend(GemmBackend.AUTO, device) is GemmBackend.EMULATED
    return {
        "rank": rank,
        "world": world,
        "tokens": case.tokens_of(rank),
        "received_rows": legs["combine"]["rows"],
        "empty_local_experts": len(empty),
        "empty_expert_wgrad_zero": empty_zero,
        "routing_equal": routing_equal,
        "out_equal": bits_equal(out.detach(), results["ref"].detach()[lo:hi]),
        "xgrad_equal": bits_equal(x.grad, leaves["ref"][rank].grad),
        "out_sqnr_vs_bf16": sqnr_db(results["bf16"].detach()[lo:hi], out.detach()),
        "wgrad_sqnr": wgrad,
        "legs": legs,
        "hidden": case.dim,
        "gemm_rowwise_quantizations": calls["rowwise"] if emulated else None,
        "gemm_colwise_quantizations": calls["colwise"] if emulated else None,
        "fused_block_calls": calls["block"],
    }


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a device tensor on the host (``.item()``, ``.tolist()``, data-dependent
    shapes). ``Tensor.tolist`` of a CPU tensor does not dispatch, so it is counted by a patch too. The
    grouped GEMM's offset value check is not counted: it runs on CPU tensors only (off on CUDA, where
    it would be a sync)."""

    BANNED = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave", "_unique2"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.BANNED:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        seen, real = self.seen, self._tolist

        def tolist(t):
            seen.append("tolist")
            return real(t)

        torch.Tensor.tolist = tolist
        self._check_values = validation.check_offset_values
        check_values, mode = self._check_values, self

        def unseen(*args, **kwargs):
            n = len(mode.seen)
            try:
                return check_values(*args, **kwargs)
            finally:
                del mode.seen[n:]

        validation.check_offset_values = unseen
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        validation.check_offset_values = self._check_values
        return super().__exit__(*exc)


def run_transport_check(case: CheckCase, variants: list, group=None) -> dict:
    """The EP block of ``case`` with the dispatcher settings of each of ``variants`` (dicts of EPMoE
    arguments: transport, chunks; and ``posting``, :data:`moe_quant.ep.blocks.POSTINGS`) against ``case``'s own
    settings, same weights and inputs: are the output, the input gradient and the three weight gradients
    bit-identical, and the bytes and rows of each leg?"""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_experts = case.experts_per_rank * world
    torch.manual_seed(case.seed)
    base = MoE(case.dim, case.hidden_dim, n_experts, case.top_k).to(torch.bfloat16)
    xs, gouts = _inputs(case, world, "cpu", torch.bfloat16)
    results = []
    own = {"transport": case.transport, "chunks": case.chunks, "sm_carveout": case.sm_carveout}
    for settings in [own] + list(variants):
        settings = dict(settings)
        form = settings.pop("posting", blocks.POSTINGS[0])  # the p2p transport's posting form (a candidate)
        model = EPMoE.from_moe(base, group=group, wire=case.wire, scale_mode=case.scale_mode, **settings)
        if case.convert:
            _convert(model, case)
        x = xs[rank].clone().requires_grad_()
        with blocks.posting(form), WireLog() as log:
            scores, ids, counts = _routing(model, x, case, n_experts)
            out = model.forward_routed(x, scores, ids, counts)
            (out.float() * gouts[rank].float()).sum().backward()
        results.append(([out.detach(), x.grad] + [getattr(model.experts, w).grad for w in ("w1", "w2", "w3")],
                        {leg: log.by_leg(leg) for leg in _LEGS}))
    (ref, ref_legs), names = results[0], ("out", "x_grad", "w1_grad", "w2_grad", "w3_grad")
    return {"rank": rank, "tokens": case.tokens_of(rank),
            "variants": [{"settings": dict(v), "equal": {n: bits_equal(a, b) for n, a, b in zip(names, ref, res)},
                          "legs_equal": legs == ref_legs, "legs": {k: list(val) for k, val in legs.items()}}
                         for v, (res, legs) in zip(variants, results[1:])],
            "wgrad_nonzero": all(bool(t.abs().sum() > 0) for t in ref[2:])}


def _read_overflow(dispatcher) -> tuple:
    """``(count, None)`` from ``check_overflow``, or ``(None, message)`` where it raised."""
    try:
        return dispatcher.check_overflow(), None
    except ValueError as e:
        return None, str(e)


def _step(model, case: CheckCase, n_experts: int, x0, gout, *, count_reads: bool) -> tuple:
    """One forward and backward of the EP block on this rank's tokens ``x0``: ``(output, input gradient,
    the host reads it made (None where not counted), rows handed to the dispatch all-to-all)``."""
    x = x0.clone().requires_grad_()
    reads = _HostReads() if count_reads else contextlib.nullcontext()
    with reads, WireLog() as log:
        scores, ids, counts = _routing(model, x, case, n_experts)
        out = model.forward_routed(x, scores, ids, counts)
        (out.float() * gout.float()).sum().backward()
    return out.detach(), x.grad, reads.seen if count_reads else None, log.by_leg("dispatch")[0]


def _ep_models(case: CheckCase, world: int, group, **sync_free) -> dict:
    """The synced and the sync-free (``sync_free``: its dispatcher arguments) EP block of ``case``, same weights."""
    torch.manual_seed(case.seed)
    base = MoE(case.dim, case.hidden_dim, case.experts_per_rank * world, case.top_k).to(torch.bfloat16)
    models = {"synced": EPMoE.from_moe(base, group=group, wire=case.wire, scale_mode=case.scale_mode),
              "sync_free": EPMoE.from_moe(base, group=group, wire=case.wire, scale_mode=case.scale_mode, **sync_free)}
    if case.convert:
        for m in models.values():
            _convert(m, case)
    return models


def run_sync_free_check(case: CheckCase, capacity_factor: float, overflow: str = "error", group=None,
                        steps: int = 2, max_tokens: int | None = None, chunks: int = 1,
                        sm_carveout: int | None = None) -> dict:
    """The EP block in the synced mode and in the sync-free mode (``capacity_factor``, ``overflow``,
    ``max_tokens``, ``chunks``, ``sm_carveout``), same weights and inputs (``case.tokens``: T per rank, may
    differ): are outputs and gradients bit-identical, how many host reads did the sync-free steps after the first
    make, how many rows did each rank hand to the dispatch all-to-all, how many overflowed, what did
    ``check_overflow`` say."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_experts = case.experts_per_rank * world
    models = _ep_models(case, world, group, capacity_factor=capacity_factor, overflow=overflow, max_tokens=max_tokens,
                        chunks=chunks, sm_carveout=sm_carveout)
    xs, gouts = _inputs(case, world, "cpu", torch.bfloat16)
    res, host_reads = {}, {"synced": [], "sync_free": []}
    dispatch_rows = []
    for name, model in models.items():
        if name == "synced" and overflow == "drop":
            continue
        outs = []
        for step in range(steps):
            out, x_grad, reads, rows = _step(model, case, n_experts, xs[rank], gouts[rank], count_reads=step > 0)
            host_reads[name] += reads or []
            if name == "sync_free":
                dispatch_rows.append(rows)
            outs.append((out, x_grad))
        res[name] = outs + [tuple(getattr(model.experts, w).grad for w in ("w1", "w2", "w3"))]
    disp = models["sync_free"].dispatcher
    dropped, error = _read_overflow(disp)
    sf = res["sync_free"]
    out = {"rank": rank, "tokens": case.tokens_of(rank), "host_reads": host_reads["sync_free"],
           "synced_host_reads": host_reads["synced"], "dispatch_rows": dispatch_rows,
           "token_bound": disp.token_bound, "dropped": dropped, "error": error,
           "finite": bool(torch.isfinite(sf[0][0]).all()),
           "check_again": disp.check_overflow()}
    if "synced" in res:
        sy = res["synced"]
        out["out_equal"] = all(bits_equal(a[0], b[0]) for a, b in zip(sy[:steps], sf[:steps]))
        out["xgrad_equal"] = all(bits_equal(a[1], b[1]) for a, b in zip(sy[:steps], sf[:steps]))
        out["wgrad_equal"] = all(bits_equal(a, b) for a, b in zip(sy[steps], sf[steps]))
    return out


def run_token_bound_check(case: CheckCase, capacity_factor: float, later_tokens: tuple, overflow: str = "error",
                          max_tokens: int | None = None, group=None) -> dict:
    """The sync-free block's token bound: a first step with ``case.tokens`` per rank (it fixes the bound,
    unless ``max_tokens`` does), then a step with ``later_tokens`` per rank (more than the bound on some
    rank). Per rank: the bound, the rows handed to each step's dispatch all-to-all (the same every step
    and on every rank), ``check_overflow`` after each step, whether the later output is finite and what
    that step read on the host."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_experts = case.experts_per_rank * world
    model = _ep_models(case, world, group, capacity_factor=capacity_factor, overflow=overflow,
                       max_tokens=max_tokens)["sync_free"]
    out = {"rank": rank, "dispatch_rows": [], "overflow": [], "errors": []}
    for step, tokens in enumerate((case.tokens, later_tokens)):
        step_case = dataclasses.replace(case, tokens=tuple(tokens), seed=case.seed + step)
        xs, gouts = _inputs(step_case, world, "cpu", torch.bfloat16)
        y, _, reads, rows = _step(model, step_case, n_experts, xs[rank], gouts[rank], count_reads=step > 0)
        out["dispatch_rows"].append(rows)
        dropped, error = _read_overflow(model.dispatcher)
        out["overflow"].append(dropped)
        out["errors"].append(error)
        if step > 0:
            out["later_host_reads"] = reads
            out["later_finite"] = bool(torch.isfinite(y).all())
            out["later_tokens"] = y.shape[0]
    out["token_bound"] = model.dispatcher.token_bound
    return out


__all__ = ["CheckCase", "run_check", "run_sync_free_check", "run_token_bound_check", "run_transport_check", "sqnr_db",
           "bits_equal"]
