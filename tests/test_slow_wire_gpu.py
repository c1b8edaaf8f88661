"""benchmarks.slow_wire on a CUDA GPU: an exchange is held until its bytes would have crossed the set wire, and
exchanges queue on that wire (one process: the kernels and streams, without a real exchange)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ms(fn) -> float:
    from benchmarks.timing import call_ms

    torch.cuda.synchronize()
    return call_ms(fn)


@pytest.fixture
def wire():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from benchmarks.slow_wire import SlowWire

    w = SlowWire(gbps=1.0)  # 1 byte per ns: 1e6 bytes = 1 ms
    w._on_wire(0, lambda: [])  # compile the two kernels
    torch.cuda.synchronize()
    return w


def test_an_exchange_ends_after_its_bytes_over_the_bandwidth(wire):
    def one():
        done, works = wire._on_wire(3_000_000, lambda: [])
        assert works == []
        torch.cuda.current_stream().wait_event(done)

    assert 2.95 <= _ms(one) < 4.0


def test_exchanges_queue_on_the_one_wire(wire):
    def two():
        events = [wire._on_wire(2_000_000, lambda: [])[0] for _ in range(2)]  # both ready at once
        for e in events:
            torch.cuda.current_stream().wait_event(e)

    assert 3.95 <= _ms(two) < 5.0


def test_the_caller_runs_on_until_it_waits(wire):
    """The caller's own work queued after the exchange runs beside the wire, not after it."""
    from benchmarks.slow_wire import slow_wire_spin_kernel, slow_wire_stamp_kernel

    slot = torch.zeros(1, dtype=torch.int64, device="cuda")

    def busy(ns):  # the caller's own work, on its own stream: ns of spinning
        slow_wire_stamp_kernel[(1,)](slot, num_warps=1)
        slow_wire_spin_kernel[(1,)](slot, ns, num_warps=1)

    assert 1.45 <= _ms(lambda: busy(1_500_000)) < 2.0

    def overlapped():
        done, _ = wire._on_wire(2_000_000, lambda: [])
        busy(1_500_000)
        torch.cuda.current_stream().wait_event(done)

    assert 1.95 <= _ms(overlapped) < 2.75  # after the wire it would take 3.5 ms


def test_the_wire_counts_from_the_post(wire):
    """A transfer cannot start before the host has posted it: time the host spends posting is not wire time."""
    import time

    def slow_post():
        time.sleep(0.003)  # the host posting for 3 ms (the device idle meanwhile)
        return []

    def one():
        done, _ = wire._on_wire(2_000_000, slow_post)
        torch.cuda.current_stream().wait_event(done)

    assert 4.95 <= _ms(one) < 6.5  # 3 ms of posting, then 2 ms of wire (counted from before the post: 3 ms)
