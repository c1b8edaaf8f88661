"""Gloo CPU ranks for ``tests/test_ep.py``: one process group session runs a list of jobs, each rank
writes its results as JSON. Started with ``torch.multiprocessing``'s forkserver (see :func:`run_session`)."""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from fsdp2_check import backend_threads, release_mesh_process_groups  # noqa: E402  (the teardown checks)
from repo_subprocess import forkserver  # noqa: E402


def _error(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # the test asserts the type and message
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return None


def _bad_dispatch(kind: str, bad_rank: int, compiled: bool = False):
    """One dispatch (and its combine) with ``kind``'s bad input on ``bad_rank``: the error it raises.
    ``compiled``: under ``torch.compile(fullgraph=True)`` (aot_eager), the handshake run eagerly first."""
    from moe_quant.ep import MXFP8TokenDispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 2 * world
    disp = MXFP8TokenDispatcher(num_experts, 1)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    ids = (torch.arange(8) % num_experts).view(8, 1)
    scores = torch.ones(8, 1)
    counts = torch.bincount(ids.view(-1), minlength=num_experts).to(torch.int32)
    if kind == "negative" and rank == bad_rank:
        counts[0], counts[1] = counts[0] + counts[1] + 1, -1
    elif kind == "mismatch" and rank == bad_rank:
        counts[0], counts[1] = counts[0] + 1, counts[1] - 1
    elif kind == "sum" and rank == bad_rank:
        counts[0] += 3
    elif kind == "float_counts":
        counts = counts.float()
    elif kind == "bad_hidden":
        x = torch.randn(8, 48, dtype=torch.bfloat16)
    elif kind == "disagree_hidden" and rank == bad_rank:  # valid on each rank, different across ranks
        x = torch.randn(8, 96, dtype=torch.bfloat16)
    elif kind == "disagree_dtype" and rank == bad_rank:
        x = torch.randn(8, 64, dtype=torch.float32)
    elif kind == "disagree_experts" and rank == bad_rank:
        disp = MXFP8TokenDispatcher(num_experts + world, 1)
        counts = torch.bincount(ids.view(-1), minlength=num_experts + world).to(torch.int32)
    elif kind == "disagree_top_k" and rank == bad_rank:
        disp = MXFP8TokenDispatcher(num_experts, 2)
        ids = torch.stack([ids.view(-1), (ids.view(-1) + 1) % num_experts], 1)
        scores = torch.ones(8, 2)
        counts = torch.bincount(ids.view(-1), minlength=num_experts).to(torch.int32)
    elif kind == "disagree_wire" and rank == bad_rank:
        disp = MXFP8TokenDispatcher(num_experts, 1, wire="bf16")
    elif kind == "disagree_scale_mode" and rank == bad_rank:
        disp = MXFP8TokenDispatcher(num_experts, 1, scale_mode="floor")
    elif kind == "disagree_capacity_factor" and rank == bad_rank:  # sync-free here, synced on the peers
        disp = MXFP8TokenDispatcher(num_experts, 1, capacity_factor=2.0)
    elif kind == "disagree_overflow":
        disp = MXFP8TokenDispatcher(num_experts, 1, capacity_factor=2.0, overflow="drop" if rank == bad_rank else "error")
    elif kind == "disagree_transport" and rank == bad_rank:
        disp = MXFP8TokenDispatcher(num_experts, 1, transport="p2p")
    elif kind == "disagree_chunks":
        disp = MXFP8TokenDispatcher(num_experts, 1, transport="p2p", chunks=2 if rank == bad_rank else 1)
    elif kind == "disagree_max_tokens":
        disp = MXFP8TokenDispatcher(num_experts, 1, capacity_factor=2.0, max_tokens=16 if rank == bad_rank else 8)
    elif kind == "bad_hidden_one_rank" and rank == bad_rank:  # an argument error only this rank sees
        x = torch.randn(8, 48, dtype=torch.bfloat16)
    elif kind == "sync_free_bad_hidden_one_rank":  # the same at a sync-free first dispatch
        disp = MXFP8TokenDispatcher(num_experts, 1, capacity_factor=2.0)
        if rank == bad_rank:
            x = torch.randn(8, 48, dtype=torch.bfloat16)
    elif kind == "bad_counts_len_one_rank" and rank == bad_rank:
        counts = torch.cat([counts, counts.new_zeros(1)])
    elif kind == "experts_not_multiple":
        disp = MXFP8TokenDispatcher(world + 1, 1)
        counts = torch.bincount(ids.view(-1) % (world + 1), minlength=world + 1).to(torch.int32)
        ids = ids % (world + 1)
    if not compiled:
        return _error(lambda: disp.dispatch(x, scores, ids, counts))
    disp.handshake(torch.device("cpu"))  # as torchtitan's wire_meshes does, before compiling

    def step(x, scores, ids, counts):
        routed, _, metadata = disp.dispatch(x, scores, ids, counts)
        return disp.combine(routed, metadata, x)

    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.reset()
    return _error(lambda: torch.compile(step, backend="aot_eager", fullgraph=True)(x, scores, ids, counts))


def _host_read_order(wire: str):
    """What one synced dispatch and its combine do in order, from after the one-time handshake: "exchange"
    (each all-to-all), "quantize" (the wire's rowwise quantization), "sort" (the tokens' sort), "read" (the
    host read of the counts) and "route" (the route's row map, ``Route.src``, made)."""
    import torch.distributed as dist_

    from moe_quant import quantize as q
    from moe_quant.ep import MXFP8TokenDispatcher, legs, wire as ep_wire

    world = dist.get_world_size()
    disp = MXFP8TokenDispatcher(2 * world, 2, wire=wire)
    disp.handshake(torch.device("cpu"))
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.arange(16) % (2 * world), (torch.arange(16) + 1) % (2 * world)], 1)
    counts = torch.bincount(ids.reshape(-1), minlength=2 * world).to(torch.int32)
    seen = []
    patched = [(dist_, "all_to_all_single", "exchange"), (q, "quantize_rowwise", "quantize"),
               (torch, "argsort", "sort"), (torch.Tensor, "tolist", "read")]
    originals = [getattr(owner, name) for owner, name, _ in patched]
    for (owner, name, mark), original in zip(patched, originals):
        def spy(*a, _original=original, _mark=mark, **k):
            seen.append(_mark)
            return _original(*a, **k)

        setattr(owner, name, spy)
    src = legs.Route.src

    def made(route):
        if route._src is None:
            seen.append("route")
        return src.fget(route)

    legs.Route.src = property(made)
    try:
        routed, _, metadata = disp.dispatch(x, torch.rand(16, 2), ids, counts)
        disp.combine(routed, metadata, x)
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)
        legs.Route.src = src
    assert ep_wire.dist is dist_  # the legs call dist.all_to_all_single through this module
    return seen


def _checkpointed(case: dict, how: str) -> dict:
    """The converted EP block of ``case`` (a CheckCase's fields) under activation checkpointing (``how``:
    "reentrant", "non_reentrant", "sac" saving the grouped GEMMs) against the same block without it: are the
    output, the input gradient and the three weight gradients bit-identical, and how many fused expert blocks ran
    (the recompute's included)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from moe_quant.ep.check import CheckCase, _convert, _count_passes, _inputs, _routing, bits_equal
    from moe_quant.moe import EPMoE, MoE

    c = CheckCase(**case)
    world, rank = dist.get_world_size(), dist.get_rank()
    n_experts = c.experts_per_rank * world
    torch.manual_seed(c.seed)
    base = MoE(c.dim, c.hidden_dim, n_experts, c.top_k).to(torch.bfloat16)
    model = _convert(EPMoE.from_moe(base, wire=c.wire, scale_mode=c.scale_mode, transport=c.transport,
                                    chunks=c.chunks, capacity_factor=c.capacity_factor), c)
    xs, gouts = _inputs(c, world, "cpu", torch.bfloat16)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten._grouped_mm.default else \
            CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"use_reentrant": how == "reentrant"}
    if how == "sac":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)

    def step(checkpointed: bool):
        model.zero_grad(set_to_none=True)
        x = xs[rank].clone().requires_grad_()
        scores, ids, counts = _routing(model, x, c, n_experts)
        calls = {}
        with _count_passes(calls):
            if checkpointed:
                out = checkpoint(model.forward_routed, x, scores, ids, counts, **kwargs)
            else:
                out = model.forward_routed(x, scores, ids, counts)
            (out.float() * gouts[rank].float()).sum().backward()
        return [out.detach(), x.grad] + [getattr(model.experts, w).grad.clone() for w in ("w1", "w2", "w3")], calls

    ref, ref_calls = step(False)
    got, calls = step(True)
    return {"rank": rank, "equal": [bits_equal(a, b) for a, b in zip(ref, got)], "blocks": ref_calls["block"],
            "blocks_checkpointed": calls["block"], "tokens": c.tokens_of(rank)}


def _experts_settings(kind: str) -> dict:
    """``EPMoE`` whose experts rank 1 converts otherwise than rank 0 (``kind``: "equal", "scale_mode": FLOOR there,
    "unconverted": not at all, "handshake_scale_mode": FLOOR, the handshake called before the first forward, as
    before compiling); one forward and backward. Returns the error raised (or None), how many ``all_to_all_single``
    and ``all_gather_object`` calls ran, and whether the step's output was finite."""
    from torchao.quantization import quantize_

    from moe_quant.conversion import MXFP8MoEConfig
    from moe_quant.moe import EPMoE, GroupedExperts

    rank = dist.get_rank()
    torch.manual_seed(0)
    ep = EPMoE(64, 96, num_experts=2 * dist.get_world_size(), top_k=2).to(torch.bfloat16)
    mode = "floor" if rank == 1 and kind in ("scale_mode", "handshake_scale_mode") else "rceil"
    if not (rank == 1 and kind == "unconverted"):
        quantize_(ep, MXFP8MoEConfig(scale_mode=mode), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    calls = {"all_to_all_single": 0, "all_gather_object": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def spy(name):
        def counted(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return counted

    for name in calls:
        setattr(dist, name, spy(name))
    out = []

    def step():
        if kind == "handshake_scale_mode":
            ep.dispatcher.handshake(torch.device("cpu"))
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        y = ep(x)
        y.float().square().sum().backward()
        out.append(bool(torch.isfinite(y).all()))

    try:
        error = _error(step)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"error": error, "finite": out, **calls}


def _job(job):
    from moe_quant import prequantized
    from moe_quant.ep.check import CheckCase, run_check

    kind, arg = job
    if kind == "check":
        return run_check(CheckCase(**arg))
    if kind == "check_dtype":  # activations (and the models) of another dtype than bf16
        arg = dict(arg)
        dtype = getattr(torch, arg.pop("dtype"))
        return run_check(CheckCase(**arg), dtype=dtype)
    if kind == "check_no_registry":  # the GEMMs never find the received MXFP8 form: they quantize again
        original = prequantized.lookup
        prequantized.lookup = lambda x, mode: None
        try:
            return run_check(CheckCase(**arg))
        finally:
            prequantized.lookup = original
    if kind == "bad":
        return _bad_dispatch(**arg)
    if kind == "checkpointed":
        return _checkpointed(**arg)
    if kind == "experts_settings":
        return _experts_settings(**arg)
    if kind == "titan":
        import titan_ranks

        return titan_ranks.run(**arg)
    if kind == "titan_bits":
        import titan_bits_ranks

        return titan_bits_ranks.run(**arg)
    if kind == "titan_model":
        import titan_model_ranks

        return titan_model_ranks.run(**arg)
    if kind == "titan_settings":
        import titan_settings_ranks

        return titan_settings_ranks.run(**arg)
    if kind == "titan_precision":
        import titan_precision_ranks

        return titan_precision_ranks.run(**arg)
    if kind == "titan_model_state":  # rank 0 writes the reference weights the model jobs load
        import titan_model_ranks

        if dist.get_rank() == 0:
            titan_model_ranks.write_state(**arg)
        dist.barrier()
        return None
    if kind == "host_read_order":
        return _host_read_order(**arg)
    if kind == "transports":
        from moe_quant.ep.check import run_transport_check

        return run_transport_check(CheckCase(**arg["case"]), arg["variants"])
    if kind in ("sync_free", "token_bound"):
        from moe_quant.ep.check import run_sync_free_check, run_token_bound_check

        arg = dict(arg)
        fn = run_sync_free_check if kind == "sync_free" else run_token_bound_check
        return fn(CheckCase(**arg.pop("case")), **arg)
    raise ValueError(kind)


def _worker(rank, world, store, out_dir, jobs, nice=0, collective_timeout_s=60.0):
    torch.set_num_threads(1)
    os.nice(nice)
    # Before the process group: torch._dynamo (which moe_quant and torchao import) imported after
    # init_process_group keeps the gloo backend alive past destroy_process_group (torch 2.13), so its
    # threads were torn down at interpreter exit, which aborted a rank now and then ("terminate called
    # without an active exception", SIGABRT: every test of the session errored).
    import torch._dynamo as _dynamo  # noqa: F401  (as: a bare "import torch.x" would make torch a local)

    import moe_quant.ep  # noqa: F401
    from examples.titan.launch import provide_is_non_strict_tracing

    # torchtitan 0.3.0's all-to-all dispatcher calls a torch.compiler function torch 2.11 (the GPU machines')
    # lacks: the launcher's stand-in (nothing here exports), so that these ranks run under 2.11 too
    provide_is_non_strict_tracing()

    results = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        for job in jobs:
            results.append(_job(job))
        dist.barrier()
        dist.destroy_process_group()
        release_mesh_process_groups()  # DTensor's caches keep torchtitan's meshes and their groups alive
        results.append({"gloo_threads_after_teardown": backend_threads("gloo")})
    except Exception:
        results.append({"fatal": traceback.format_exc()})

    def clean(v):  # JSON has no inf
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(clean(results), f)
    # No interpreter shutdown: a gloo backend still alive then (the torchtitan sessions leave one, held
    # by something other than their meshes) is destroyed with its threads running, which aborts now
    # and then. The results are written; exit here.
    os._exit(0)


def start_session(world: int, jobs: list, folder: str, *, nice: int = 0, collective_timeout_s: float = 60.0):
    """Start ``jobs`` on ``world`` gloo ranks writing into ``folder`` (forks of one server per test process that
    imported torch and torchtitan once); :func:`finish_session` reads them. ``nice``: the ranks' niceness;
    ``collective_timeout_s``: gloo's timeout (a collective waiting longer for a peer raises)."""
    forkserver()
    return mp.start_processes(_worker, args=(world, os.path.join(folder, "store"), folder, jobs, nice,
                                             collective_timeout_s),
                              nprocs=world, join=False, start_method="forkserver")


def stop_session(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(10)


def finish_session(ctx, folder: str, timeout_s: float = 400.0, clean_teardown: bool = False) -> list:
    """The results of :func:`start_session`'s ranks, ``results[rank][job]``. Never hangs: ranks still running
    after ``timeout_s`` are terminated and the missing results raise. ``clean_teardown``: raise if a rank's gloo
    threads outlived ``destroy_process_group`` (its backend kept alive)."""
    world = len(ctx.processes)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            stop_session(ctx)
            raise TimeoutError(f"EP session of {world} ranks did not finish in {timeout_s} s")
    out = []
    for r in range(world):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            out.append(json.load(f))
    for r, res in enumerate(out):
        for item in res:
            if isinstance(item, dict) and "fatal" in item:
                raise RuntimeError(f"rank {r} failed:\n{item['fatal']}")
        left = res.pop()["gloo_threads_after_teardown"]
        if clean_teardown and left:
            raise RuntimeError(f"rank {r}: gloo threads alive after destroy_process_group: {left}")
    return out


def run_session(world: int, jobs: list, timeout_s: float = 400.0, clean_teardown: bool = False) -> list:
    """Runs ``jobs`` on ``world`` gloo ranks (:func:`start_session`, :func:`finish_session`); returns
    ``results[rank][job]``."""
    with tempfile.TemporaryDirectory() as tmp:
        return finish_session(start_session(world, jobs, tmp), tmp, timeout_s, clean_teardown)


class BackgroundSession:
    """A test module's EP session started when the session's tests are collected (the module's
    ``start_in_background``, called by ``tests/conftest.py``, which runs the module's tests last), so that it fills
    the core the (mostly single-threaded) other tests leave idle. ``jobs(folder)``: the jobs, given the session's
    folder. By default niced, with gloo's timeout 900 s (a starved peer is not a hang); ``clean_teardown`` as
    :func:`finish_session`'s."""

    NICE = 10

    def __init__(self, world: int, jobs, *, nice: int = NICE, collective_timeout_s: float = 900.0,
                 clean_teardown: bool = False):
        self.world, self.jobs, self.started = world, jobs, None
        self.nice, self.collective_timeout_s, self.clean_teardown = nice, collective_timeout_s, clean_teardown

    def start(self, selected=frozenset()) -> None:
        if self.started is None:
            folder = tempfile.mkdtemp(prefix="ep_session_")
            ctx = start_session(self.world, self.jobs(folder), folder, nice=self.nice,
                                collective_timeout_s=self.collective_timeout_s)
            self.started = (ctx, folder)

    def stop(self) -> None:
        if self.started is not None:
            ctx, folder = self.started
            self.started = None
            stop_session(ctx)
            shutil.rmtree(folder, ignore_errors=True)

    def results(self, timeout_s: float) -> list:
        """Started now where it was not yet; its results, as :func:`run_session`'s."""
        self.start()
        ctx, folder = self.started
        try:
            return finish_session(ctx, folder, timeout_s, self.clean_teardown)
        finally:
            self.stop()
