"""The sync-free EP block on one CUDA GPU (an NCCL group of one rank): no host synchronization in forward or
backward after the first (handshake) step, and the whole block, forward and backward, captured in a CUDA graph
and replayed with new tokens and routing equals eager bit for bit (docs/design.md section 9, "Synchronization").
The synced mode, as the control, does synchronize (its one host read per dispatch). Also on that group: the
emulated slow wire of torchtitan's trainer (``benchmarks.slow_wire.HeldExchanges``) on the GPU, eager and
compiled."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torchao.quantization import quantize_

from moe_quant.conversion import MXFP8MoEConfig
from moe_quant.moe import EPMoE, MoE

pytestmark = pytest.mark.gpu

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 128, 4, 2, 512


@pytest.fixture(scope="module")
def nccl_one_rank(tmp_path_factory):
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA GPU and NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _block(group, **mode):
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K).to(device="cuda", dtype=torch.bfloat16)
    ep = EPMoE.from_moe(moe, group=group, **mode)
    quantize_(ep, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    return ep


def _routing(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    if seed % 2:  # uneven: most copies to expert 0
        ids[: TOKENS // 2, 0] = 0
        ids[: TOKENS // 2, 1] = 1 + torch.randint(0, EXPERTS - 1, (TOKENS // 2,), generator=g)
    scores = torch.rand(TOKENS, TOP_K, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS).to(torch.int32)
    gout = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16)
    return [t.cuda() for t in (x, scores, ids, counts, gout)]


def _step(ep, x, scores, ids, counts, gout):
    """Forward and backward of the block after the router: ``(out, x.grad)`` (the weights' ``.grad`` set)."""
    x = x.detach().requires_grad_()
    out = ep.forward_routed(x, scores, ids, counts)
    out.backward(gout)
    return out, x.grad


def _sync_free(group):
    return _block(group, capacity_factor=float(TOP_K), max_tokens=TOKENS)  # never overflows


def _host_waits(fn) -> int:
    """Runs ``fn`` with CUDA's sync debug mode set to raise (a blocking copy, ``.item()`` of a device tensor, a
    stream or device sync) and returns how many CUDA events the host waited for (the synced dispatcher's pinned
    copy of the counts is read after an event's ``synchronize``, which the debug mode does not see)."""
    waits = []
    original = torch.cuda.Event.synchronize

    def counted(event):
        waits.append(event)
        return original(event)

    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = counted
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = original
    torch.cuda.synchronize()
    return len(waits)


def test_sync_free_block_reads_nothing_on_the_host_and_the_synced_one_does(nccl_one_rank):
    synced, free = _block(nccl_one_rank), _sync_free(nccl_one_rank)
    batch = _routing(0)
    for ep in (synced, free):
        _step(ep, *batch)  # first step: the handshake (one host read), kernel compiles
    assert _host_waits(lambda: _step(synced, *batch)) == 1  # the control: one host read per dispatch
    assert _host_waits(lambda: _step(free, *batch)) == 0
    assert free.dispatcher.check_overflow() == 0


def test_sync_free_block_replays_in_a_cuda_graph_bit_exactly(nccl_one_rank):
    graphed, eager = _sync_free(nccl_one_rank), _sync_free(nccl_one_rank)
    static = _routing(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (handshake, kernel compiles, allocator) off the capture stream
        for _ in range(3):
            graphed.zero_grad(set_to_none=True)
            _step(graphed, *static)
    torch.cuda.current_stream().wait_stream(side)
    graphed.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_dx = _step(graphed, *static)
    weights = [graphed.experts.w1, graphed.experts.w2, graphed.experts.w3]
    for seed in (1, 2, 3):
        batch = _routing(seed)
        with torch.no_grad():
            for s, b in zip(static, batch):
                s.copy_(b)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        out, dx = _step(eager, *batch)
        torch.cuda.synchronize()
        assert torch.equal(static_out, out) and torch.equal(static_dx, dx), seed
        for w, e in zip(weights, (eager.experts.w1, eager.experts.w2, eager.experts.w3)):
            assert torch.equal(w.grad, e.grad), seed
        assert bool(out.isfinite().all())
    assert graphed.dispatcher.check_overflow() == 0 and eager.dispatcher.check_overflow() == 0


def test_held_exchanges_run_on_the_gpu_eager_and_compiled(nccl_one_rank):
    """``--moe_quant.wire_gbps``'s exchanges on CUDA (the wire stream, the stamp and spin kernels, the real
    exchange inside the ops), through the in-place all-to-all (moe_quant's legs) and torchtitan's dispatcher's
    functional one, eager and under inductor: the exchange's values, each one counted (one rank: nothing goes
    to another rank, no time held)."""
    titan = pytest.importorskip("torchtitan.models.common.token_dispatcher")
    from benchmarks.slow_wire import LEDGER, HeldExchanges

    x = torch.randn(64, 32, device="cuda")

    def step(t):
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t)
        return titan.all_to_all_single(out * 2, None, None, nccl_one_rank) + 1

    before = LEDGER["exchanges"]
    with HeldExchanges(50.0):
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True)(x)
    torch.cuda.synchronize()
    assert torch.equal(eager, x * 2 + 1) and torch.equal(compiled, eager)
    assert LEDGER["exchanges"] - before == 4
