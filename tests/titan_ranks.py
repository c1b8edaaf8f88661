"""Gloo CPU ranks for ``tests/test_torchtitan_ep.py``: torchtitan 0.3.0's ``RoutedExperts`` with converted
experts and moe_quant's dispatcher (through its torchtitan ``Config``), EP over a 1-D device mesh of the
world or EP off (``wire_meshes(ep_mesh=None)``), eager and ``torch.compile(fullgraph=True)``; and
torchtitan's own ``AllToAllTokenDispatcher`` feeding the converted experts, eager and compiled."""

from __future__ import annotations

import time

import graph_reads
import torch
import torch.distributed as dist

D, HIDDEN, E, K, T = 64, 96, 4, 2, 24


def _bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _sqnr(ref, x):
    ref, x = ref.float(), x.float()
    err = (ref - x).pow(2).sum()
    return float("inf") if err == 0 else float(10 * torch.log10(ref.pow(2).sum() / err))


def _block(dispatcher_cfg, ep: bool):
    """A RoutedExperts of this rank (its E/R experts under EP, all E without), weights from one seed."""
    from torchao.quantization import quantize_
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

    from moe_quant import MXFP8MoEConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    n = E // world if ep else E
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(E, HIDDEN, D, generator=g) * 0.1, torch.randn(E, D, HIDDEN, generator=g) * 0.1,
            torch.randn(E, HIDDEN, D, generator=g) * 0.1]
    block = RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=D, hidden_dim=HIDDEN, num_experts=n),
                                 token_dispatcher=dispatcher_cfg).build()
    lo = rank * n if ep else 0
    with torch.no_grad():
        for p, w in zip((block.inner_experts.w1_EFD, block.inner_experts.w2_EDF, block.inner_experts.w3_EFD), full):
            p.copy_(w[lo:lo + n])
    block.to(torch.bfloat16)
    quantize_(block, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
    mesh = None
    if ep:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    block.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return block


def _inputs(tokens=None, dtype=torch.bfloat16):
    """This rank's tokens (``tokens[rank]`` of them, default T; activations and output gradient in ``dtype``),
    routing and output gradient."""
    rank = dist.get_rank()
    t = tokens[rank] if tokens else T
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1, t, D, generator=g).to(dtype)
    logits = torch.randn(t, E, generator=g)
    if rank == 1:
        logits[:, 0] += 4  # uneven: most of this rank's copies to expert 0
    scores, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add(0, ids.reshape(-1), torch.ones(t * K, dtype=torch.int64))
    gout = torch.randn(1, t, D, generator=g).to(dtype)
    return x, scores.view(1, t, K), ids.view(1, t, K), counts, gout


def _step(fn, block, x, scores, ids, counts, gout):
    for p in block.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    out = fn(x, scores, ids, counts)
    (out.float() * gout.float()).sum().backward()
    ws = [block.inner_experts.w1_EFD, block.inner_experts.w2_EDF, block.inner_experts.w3_EFD]
    return [out.detach(), x.grad] + [w.grad.clone() for w in ws]


def _held(step, wire_gbps):
    """``step`` (a callable) with every EP exchange held to ``wire_gbps`` (benchmarks.slow_wire.HeldExchanges;
    None: as it is); returns its result and the exchanges and bytes the wire counted."""
    if wire_gbps is None:
        return step(), None
    from benchmarks.slow_wire import LEDGER, HeldExchanges

    before = dict(LEDGER)
    with HeldExchanges(wire_gbps):
        out = step()
    return out, [LEDGER["exchanges"] - before["exchanges"], LEDGER["bytes"] - before["bytes"]]


def run(dispatcher: str, ep: bool, compile_backend: str | None = "aot_eager", capacity_factor=None,
        max_tokens=None, tokens=None, compiled_first: bool = False, wire_gbps: float | None = None) -> dict:
    """Eager and compiled steps of one block; returns whether they are bit-identical, and the outputs.
    ``tokens``: T of each rank (default T on every rank); ``compiled_first``: the compiled step runs
    before the eager one (the sync-free token bound must then be fixed without a dispatch: max_tokens);
    an error it raises is returned as ``compile_error``. ``wire_gbps``: every step's exchanges held on the
    emulated wire (``wire``: the exchanges and bytes it counted in the eager and in the compiled step)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from moe_quant.ep.titan import dispatcher_class, dispatcher_config

    from torchtitan.distributed.utils import set_spmd_backend

    torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's compile does
    set_spmd_backend("partial_dtensor")  # plain process groups (its default needs torchtitan's trainer set-up)
    if dispatcher == "moe_quant":
        cfg = dispatcher_config(num_experts=E, top_k=K, capacity_factor=capacity_factor, max_tokens=max_tokens)
    else:
        cfg = AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)
    block = _block(cfg, ep)
    args = _inputs(tokens)
    t0 = time.monotonic()
    res = {"ours": isinstance(block.token_dispatcher, dispatcher_class()), "local": not ep, "rows": int(args[3].sum())}
    compiled = None
    graphs = []  # what dynamo captured (tests/graph_reads.py counts its host reads)
    backend = graph_reads.recording_backend(graphs, compile_backend) if compile_backend else None
    wire = {}
    if compile_backend and compiled_first:
        torch._dynamo.reset()
        try:
            compiled, wire["compiled"] = _held(
                lambda: _step(torch.compile(block, backend=backend, fullgraph=True), block, *args), wire_gbps)
        except Exception as e:  # the test asserts the type and message
            res["compile_error"] = {"type": type(e).__name__, "message": str(e)}
            return res
    eager, wire["eager"] = _held(lambda: _step(block, block, *args), wire_gbps)
    res.update({"eager": [t.float().tolist() for t in eager[:2]], "wgrads": [t.float().tolist() for t in eager[2:]]})
    if compile_backend:
        if compiled is None:
            torch._dynamo.reset()
            compiled, wire["compiled"] = _held(
                lambda: _step(torch.compile(block, backend=backend, fullgraph=True), block, *args), wire_gbps)
        res["compiled_equal"] = [_bits_equal(a, b) for a, b in zip(eager, compiled)]
        res["graph_reads"] = [graph_reads.count(g) for g in graphs]
    if wire_gbps is not None:
        res["wire"] = wire
    if dispatcher == "moe_quant" and capacity_factor is not None:
        res["token_bound"] = block.token_dispatcher.token_bound
        res["overflow"] = block.token_dispatcher.check_overflow()
    res["seconds"] = time.monotonic() - t0
    return res


__all__ = ["run", "D", "E", "K", "T"]
