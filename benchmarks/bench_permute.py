"""Received-rows permutation kernel (moe_quant.ep.permute_received on SM90+): µs, TB/s and % of a memcpy of
the same bytes, for M in 8192/32768/131072, K in 2048/5120/7168, dequant (bf16) and blocked outputs.

    python -m benchmarks.bench_permute [--m 8192,32768] [--k 7168] [--ranks 8] [--experts 8]

Bytes moved: dequant reads M K (fp8) + M K/32 (scales) and writes 2 M K (bf16); blocked reads the same and
writes M K + the M-groups scale buffer. "% memcpy" compares TB/s with a bf16 device copy of an (M, K) tensor.
"""

from __future__ import annotations

import argparse

from benchmarks.timing import require_cuda


def ragged_counts(m: int, k: int, ranks: int, experts: int):
    """``(ranks, experts)`` int32 CUDA rows per (source rank, local expert), ragged, summing to ``m`` (seeded
    by ``m + k``): the received-rows layout every permute benchmark times."""
    import torch

    g = torch.Generator().manual_seed(m + k)
    w = torch.rand(ranks * experts, generator=g) + 0.05
    counts = (w / w.sum() * m).floor().to(torch.int32)
    counts[-1] += m - int(counts.sum())  # ragged, summing to M
    return counts.view(ranks, experts).cuda()


def received_rows(m: int, k: int):
    """``(data (m, k) e4m3, scales (m, k/32) uint8)`` on the GPU: finite values, scales 2^-27..2^12."""
    import torch

    return (torch.randint(0, 127, (m, k), device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.randint(100, 140, (m, k // 32), device="cuda", dtype=torch.uint8))


def permute_bytes(m: int, k: int, experts: int, out: str) -> int:
    """Bytes one permute call moves: the fp8 rows and scales read, ``out``'s outputs written (bf16 rows for
    ``"dequant"``; fp8 rows and the M-groups blocked scale buffer for ``"blocked"``)."""
    from moe_quant import layouts

    read = m * k + m * k // 32
    if out == "dequant":
        return read + 2 * m * k
    sr, sc = layouts.m_groups_blocked_shape(m, k // 32, experts)
    return read + m * k + sr * sc


def time_outputs(m: int, k: int, ranks: int, experts: int, outs=("dequant", "blocked")) -> list[tuple]:
    """``(out, µs, TB/s, memcpy TB/s)`` of one permute call per output kind in ``outs`` at ``(m, k)`` (ragged
    counts, inputs rotated past the L2), and of a bf16 memcpy of an ``(m, k)`` tensor timed with them."""
    import torch

    from benchmarks.timing import Rotating, bench_us, memcpy_tbps, tbps
    from moe_quant.kernels.permute import ops as ops_permute

    counts = ragged_counts(m, k, ranks, experts)
    rot = Rotating(lambda: received_rows(m, k))
    _, cp_tbps = memcpy_tbps((m, k))
    res = []
    for out in outs:
        def run(out=out):
            d, s = rot.next()
            ops_permute.permute_mxfp8(d, s, counts, out, torch.bfloat16)

        run()
        us = bench_us(run)
        res.append((out, us, tbps(permute_bytes(m, k, experts, out), us), cp_tbps))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="8192,32768,131072")
    p.add_argument("--k", default="2048,5120,7168")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    args = p.parse_args(argv)
    require_cuda(argv)
    from benchmarks.timing import device_name, print_table

    rows = []
    for m in (int(v) for v in args.m.split(",")):
        for k in (int(v) for v in args.k.split(",")):
            for out, us, t, cp_tbps in time_outputs(m, k, args.ranks, args.experts):
                rows.append([m, k, out, round(us, 1), round(t, 2), round(100 * t / cp_tbps, 1), round(cp_tbps, 2)])
    print_table(f"permute_received kernel, R={args.ranks} E={args.experts} ragged ({device_name()})",
                ["M", "K", "out", "us", "TB/s", "%memcpy", "memcpy TB/s"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
