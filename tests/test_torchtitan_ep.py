"""torchtitan 0.3.0's RoutedExperts with moe_quant's dispatcher (its torchtitan ``Config``) on 2 gloo ranks:
EP over the world and EP off, eager and ``torch.compile(fullgraph=True)``; torchtitan's own all-to-all
dispatcher feeding the converted experts compiled too (data-dependent row counts). Jobs: tests/titan_ranks.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytest.importorskip("torchtitan.models.common.token_dispatcher", reason="torchtitan not importable")
from ep_ranks import BackgroundSession  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

JOBS = {
    "ours_ep": ("titan", {"dispatcher": "moe_quant", "ep": True}),
    "ours_local": ("titan", {"dispatcher": "moe_quant", "ep": False}),
    "titan_ep": ("titan", {"dispatcher": "torchtitan", "ep": True}),
    "ours_ep_sync_free": ("titan", {"dispatcher": "moe_quant", "ep": True, "capacity_factor": 2.0}),
    # unequal T per rank: synced, and sync-free compiled before any eager step (the bound from max_tokens)
    "ours_ep_uneven": ("titan", {"dispatcher": "moe_quant", "ep": True, "tokens": (24, 9), "compile_backend": None}),
    "ours_ep_sync_free_uneven": ("titan", {"dispatcher": "moe_quant", "ep": True, "capacity_factor": 2.0,
                                           "max_tokens": 24, "tokens": (24, 9), "compiled_first": True}),
    "ours_ep_sync_free_unbounded": ("titan", {"dispatcher": "moe_quant", "ep": True, "capacity_factor": 2.0,
                                              "tokens": (24, 9), "compiled_first": True}),
    # every exchange held on the emulated slow wire (benchmarks.slow_wire.HeldExchanges), eager and compiled
    "ours_ep_wire": ("titan", {"dispatcher": "moe_quant", "ep": True, "wire_gbps": 50.0}),
    "titan_ep_wire": ("titan", {"dispatcher": "torchtitan", "ep": True, "wire_gbps": 50.0}),
}


_SESSION = BackgroundSession(2, lambda folder: [JOBS[n] for n in JOBS])
start_in_background, stop_background = _SESSION.start, _SESSION.stop  # the session starts at collection


@pytest.fixture(scope="module")
def titan2():
    results = _SESSION.results(timeout_s=2400.0)  # 9 compiles, shared 2 cores
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(JOBS)}


@pytest.mark.parametrize("job", [j for j in JOBS if j not in ("ours_ep_uneven", "ours_ep_sync_free_unbounded")])
def test_compiled_equals_eager_bit_for_bit(job, titan2):
    """Output, input gradient and the three weight gradients: compiled (aot_eager, fullgraph) == eager."""
    for r in titan2[job]:
        assert r["compiled_equal"] == [True] * 5, (job, r["compiled_equal"])
    assert all(r["ours"] == job.startswith("ours") for r in titan2[job])


def test_compiled_block_reads_the_device_once_per_count_exchange(titan2):
    """The compiled block's host reads of device tensors (tests/graph_reads.py: on a GPU each is a
    synchronization): moe_quant's synced dispatcher makes one device-to-host copy of the counts and reads
    nothing else of the device (as in eager, where one pinned copy is read), at most what torchtitan's own
    dispatcher makes (two copies: input and output splits); the sync-free and local dispatchers none."""
    def reads(job):
        counts = [r["graph_reads"] for r in titan2[job]]
        assert all(len(c) == 1 for c in counts), (job, counts)  # fullgraph: one graph per rank
        return [c[0] for c in counts]

    for ours, theirs in zip(reads("ours_ep"), reads("titan_ep")):
        assert (ours["copies"], ours["reads"]) == (1, 0), ours
        assert theirs["copies"] >= 1 and ours["copies"] + ours["reads"] <= theirs["copies"] + theirs["reads"], (
            ours, theirs)
    for job in ("ours_ep_sync_free", "ours_local"):
        for c in reads(job):
            assert (c["copies"], c["reads"]) == (0, 0), (job, c)


@pytest.mark.parametrize("ours, theirs, exchanges", [("ours_ep_wire", "ours_ep", 7), ("titan_ep_wire", "titan_ep", 5)])
def test_the_slow_wire_holds_every_exchange_of_both_dispatchers(ours, theirs, exchanges, titan2):
    """``benchmarks.slow_wire.HeldExchanges`` (torchtitan's trainer: ``--moe_quant.wire_gbps``) puts every
    all-to-all of a step on the emulated wire, eager and compiled, for moe_quant's dispatcher (the counts, the
    MXFP8 dispatch as data and scales, the combine; backward: the combine's MXFP8 gradient as two, the dispatch's:
    7) and torchtitan's (counts, dispatch, combine, and the two backward legs through its functional
    collective's autograd: 5), with the same bytes either way, and changes no bit of the output or a gradient."""
    for held, plain in zip(titan2[ours], titan2[theirs]):
        wire = held["wire"]
        assert wire["eager"] == wire["compiled"] and wire["eager"][0] == exchanges and wire["eager"][1] > 0, wire
        assert held["eager"] == plain["eager"] and held["wgrads"] == plain["wgrads"]
        assert held["compiled_equal"] == [True] * 5, held["compiled_equal"]


def test_ep_off_dispatches_locally_and_ep_equals_it(titan2):
    """``wire_meshes(ep_mesh=None)`` (EP off): each rank runs its own tokens through all experts; with EP
    over the two ranks the same tokens give the same output and input gradient bit for bit."""
    for ep, local in zip(titan2["ours_ep"], titan2["ours_local"]):
        assert local["local"] and not ep["local"]
        assert ep["eager"] == local["eager"]


def test_sync_free_equals_synced_in_torchtitan(titan2):
    """The sync-free dispatcher (capacity_factor 2 on 2 ranks: nothing can overflow) gives the synced
    dispatcher's output, input and weight gradients bit for bit, and compiles fullgraph (test above)."""
    for sf, synced in zip(titan2["ours_ep_sync_free"], titan2["ours_ep"]):
        assert sf["eager"] == synced["eager"] and sf["wgrads"] == synced["wgrads"]


def test_ours_equals_torchtitans_all_to_all(titan2):
    """Same converted experts, torchtitan's dispatcher (bf16 all-to-all): the experts quantize their inputs
    1x32 anyway and both apply the routing scores in fp32 (tests/test_torchtitan_dispatch_bits.py has the
    score and weight gradients), so the MXFP8 wire gives the same output and input gradient bits."""
    for ours, theirs in zip(titan2["ours_ep"], titan2["titan_ep"]):
        assert ours["ours"] and not theirs["ours"]  # precondition: the two dispatchers ran
        assert ours["eager"] == theirs["eager"]


def test_sync_free_unequal_tokens_compiled_first(titan2):
    """T = 24 and 9 on the two ranks, max_tokens=24 in the dispatcher Config: the block compiles fullgraph
    before any eager step (the bound is fixed in wire_meshes' handshake) and equals the synced dispatcher
    bit for bit (output, input and weight gradients; compiled == eager above), nothing overflowing."""
    for sf, synced in zip(titan2["ours_ep_sync_free_uneven"], titan2["ours_ep_uneven"]):
        assert sf["token_bound"] == 24 and sf["overflow"] == 0, sf["token_bound"]
        assert sf["eager"] == synced["eager"] and sf["wgrads"] == synced["wgrads"]


def test_sync_free_without_a_bound_does_not_compile(titan2):
    """Sync-free, no max_tokens, compiled before any eager dispatch: agreeing on the bound would read the
    host while tracing, so every rank raises the same clear error instead (nothing was exchanged)."""
    errors = [r["compile_error"] for r in titan2["ours_ep_sync_free_unbounded"]]
    assert len({e["message"] for e in errors}) == 1, errors
    assert "max_tokens" in errors[0]["message"] and "token bound" in errors[0]["message"], errors
