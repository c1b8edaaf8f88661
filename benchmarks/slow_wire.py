"""A slower wire on one machine: every exchange takes at least its bytes over a set bandwidth.

    torchrun --nproc_per_node 2 -m benchmarks.bench_ep --wire-gbps 50

Why. The EP goal at a slower wire (50 GB/s per GPU, a 400 Gb/s inter-node link) has to be measured on one
machine of NVLinked GPUs. Holding NCCL to a few channels (``NCCL_MAX_NCHANNELS``) slows it, but not alike for
every form of exchange: with 4 channels on 2 H200s (NCCL 2.28.9, ``scripts/probes/p2p_probe.py``) a point-to-point op
of at most 32 MB moved about 40 GB/s and a larger one about 80 GB/s, and an ``all_to_all_single`` (its own block
copied through the same channels) 56 GB/s. A transport that sends smaller or larger messages then gets another
wire. Here NCCL runs at full NVLink speed and each exchange is held until its bytes would have crossed a wire of
``gbps``: the same wire for every form.

How. :class:`SlowWire` replaces ``torch.distributed.all_to_all_single`` and ``batch_isend_irecv`` while active.
Each call runs on one *wire stream* per process: the stream waits for the caller's stream (the data is ready),
the real exchange is posted (NCCL's stream waits for the wire stream), a one-thread kernel stamps the GPU's
global nanosecond timer (so no earlier than the host finished posting), the wire stream waits for the exchange,
and a one-thread kernel spins until the stamp plus ``bytes / gbps`` nanoseconds. The caller's stream waits for the end of the spin (synchronous calls), or the
returned work's ``wait()`` makes it wait (``async_op=True``, ``batch_isend_irecv``). So an exchange ends at
``max(real end, start + bytes / bandwidth)``, where ``start`` is when its data was ready, the wire free (the
previous exchange's end) and the exchange posted: exchanges queue on the one wire in the order they are posted, as on one link.
``bytes`` are what this rank sends to the other ranks (its own block is not on the wire): the same count as
``bench_ep``'s legs and ``scripts/ep_wire_fit.py``.

What it does not model: the receive side (a balanced exchange sends and receives alike), the latency of a real
network (the real NVLink exchange's own fixed cost stands for it), a late peer (the stamp is this rank's: where
the peer posts its side later, the exchange still ends at the real end or this rank's stamp plus the transfer,
so it is short by up to the peer's delay), and the SMs that a slow NCCL transfer keeps for its whole time (the
real kernels hold NVLink's channels for the fast transfer only). Exchanges outside ``torch.distributed``'s two
functions (functional collectives, as torchtitan's dispatcher uses) run at full speed: ``bench_ep`` refuses its
torchtitan row under ``--wire-gbps``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def a2a_bytes_to_others(inp: torch.Tensor, input_split_sizes, rank: int, world: int) -> int:
    """Bytes an ``all_to_all_single`` of ``inp`` sends to the other ranks: all but this rank's own rows (an even
    split without ``input_split_sizes``)."""
    total = inp.numel() * inp.element_size()
    if not input_split_sizes:
        return total * (world - 1) // world
    rows = inp.shape[0] if inp.dim() else 0
    row_bytes = total // rows if rows else 0
    return total - int(input_split_sizes[rank]) * row_bytes


def p2p_bytes_to_others(ops: list, rank: int) -> int:
    """Bytes the sends of a ``batch_isend_irecv`` list carry to other ranks (``rank``: this process's global
    rank; a send to itself is not on the wire)."""
    n = 0
    for op in ops:
        peer = op.peer if op.peer is not None else dist.get_global_rank(op.group, op.group_peer)
        if op.op is dist.isend and peer != rank:
            n += op.tensor.numel() * op.tensor.element_size()
    return n


try:  # the two kernels; Triton comes with PyTorch's CUDA wheels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton: SlowWire refuses to start
    triton = None

if triton is not None:
    @triton.jit
    def _now(dummy):
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def slow_wire_stamp_kernel(slot_ptr):
        """``*slot_ptr`` = the global nanosecond timer."""
        tl.store(slot_ptr, _now(tl.full((), 0, tl.int32)))

    @triton.jit
    def slow_wire_spin_kernel(slot_ptr, ns):
        """Spin until the global timer reaches ``*slot_ptr + ns``."""
        z = tl.full((), 0, tl.int32)
        target = tl.load(slot_ptr) + ns
        t = _now(z)
        while t < target:
            t = _now(z)


class _PaddedWork:
    """A posted exchange's work whose ``wait()`` also waits for the wire (the end of its spin)."""

    def __init__(self, work, done: torch.cuda.Event):
        self._work, self._done = work, done

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done.query()

    def __getattr__(self, name):
        return getattr(self._work, name)


class SlowWire:
    """``with SlowWire(gbps):`` every ``all_to_all_single`` and ``batch_isend_irecv`` of this process takes at
    least its bytes to the other ranks over ``gbps`` GB/s (see the module doc). CUDA only."""

    def __init__(self, gbps: float):
        if not gbps > 0:
            raise ValueError(f"gbps must be a positive bandwidth in GB/s, got {gbps}")
        if not torch.cuda.is_available() or triton is None:
            raise RuntimeError("SlowWire needs CUDA and Triton: it holds NCCL's exchanges on the GPU")
        self.gbps = float(gbps)
        self._stream = torch.cuda.Stream()
        self._slot = torch.zeros(1, dtype=torch.int64, device="cuda")
        self._saved = None

    def _on_wire(self, nbytes: int, post) -> tuple:
        """``post()`` (posts the real exchange asynchronously, returns its works) on the wire stream, then the
        spin; returns ``(done event, works)``."""
        ws = self._stream
        ws.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ws):
            works = post()  # NCCL's stream waits for the wire stream as it is now
            # the stamp, after the post: the transfer starts once its data is ready, the wire free (the previous
            # spin is ahead on this stream) and the host has posted it (a point-to-point batch of many blocks takes
            # the host a while; counted from before the post, that time would overlap the emulated transfer)
            slow_wire_stamp_kernel[(1,)](self._slot, num_warps=1)
            for w in works:
                w.wait()  # the wire stream waits for NCCL's
            slow_wire_spin_kernel[(1,)](self._slot, int(nbytes / self.gbps), num_warps=1)  # 1 GB/s = 1 byte per ns
        done = torch.cuda.Event()
        done.record(ws)
        return done, works

    def __enter__(self):
        a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            n = a2a_bytes_to_others(input, input_split_sizes, dist.get_rank(group), dist.get_world_size(group))
            done, (work,) = self._on_wire(n, lambda: [a2a(output, input, output_split_sizes, input_split_sizes,
                                                          group=group, async_op=True)])
            if async_op:
                return _PaddedWork(work, done)
            torch.cuda.current_stream().wait_event(done)
            return None

        def batch_isend_irecv(p2p_op_list):
            n = p2p_bytes_to_others(p2p_op_list, dist.get_rank())
            done, works = self._on_wire(n, lambda: list(batch(p2p_op_list)))
            return [_PaddedWork(w, done) for w in works]

        self._saved = (a2a, batch)
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single, dist.batch_isend_irecv = self._saved
        self._saved = None


__all__ = ["SlowWire", "a2a_bytes_to_others", "p2p_bytes_to_others"]
