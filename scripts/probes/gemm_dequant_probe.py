"""Is a Hopper GEMM that reads MXFP8 operands (fp8 + e8m0 scales, dequantized to bf16 in its main loop)
worth building for the emulated backend? A same-framework measurement of what the main-loop dequantization
costs, at the SwiGLU expert block's GEMM shapes.

    python scripts/probes/gemm_dequant_probe.py [--rounds 5] [--m 2048,16384] [--json PATH]

GPU only (one line and exit status 2 elsewhere). Batched GEMMs ``C[e] = A[e] @ B[e]^T`` over E = 8 experts of
equal size (``A (E, M, K)``, ``B (E, N, K)``: the expert weight's layout, K contiguous in both), bf16 out,
fp32 accumulation, timed in interleaved rounds (median and range of the per-round ratios):

* ``cublas`` -- ``torch.bmm`` on bf16 operands (what ``torch._grouped_mm`` does per expert on Hopper);
* ``grouped`` -- ``torch._grouped_mm`` on the same operands as one (E*M, K) matrix with offsets;
* ``triton-bf16`` -- one Triton kernel, ``tl.dot`` on the dequantized bf16 operands (the emulated GEMM as it
  is: the operands were written as bf16 by a quantization pass);
* ``triton-mx`` -- the same kernel reading both operands as e4m3 + e8m0 scales (blocks of 32 along K) through
  ``tl.dot_scaled``, which on Hopper (no MX tensor cores) upcasts them to bf16 in the main loop: the
  "fp8-reading GEMM";
* ``triton-mx-w`` -- only B (the weight) as e4m3 + scales, A bf16.

Every Triton variant is autotuned over the same configurations. The result of ``triton-mx`` is compared with
``triton-bf16`` on the dequantized operands (same products; only the accumulation order may differ).
Operands: random e4m3 bytes (no NaN) and scales 2^-8..2^8, so every dequantized value is exact in bf16.
Only the ratios between variants of one run mean anything (the H100's clock drifts within a run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.timing import bench_us, device_name, print_table, require_cuda, write_json  # noqa: E402
from moe_quant import cli  # noqa: E402

E = 8
# (name, K, N) of the block's GEMMs, per expert M from --m: DeepSeek-V3 (D 7168, H 2048) and Llama4 (D 5120, H 8192)
GEMMS = [("dsv3 x@w1^T", 7168, 2048), ("dsv3 h@w2^T", 2048, 7168), ("llama4 x@w1^T", 5120, 8192),
         ("llama4 h@w2^T", 8192, 5120)]


def _configs():
    shapes = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 128, 3, 8),
              (128, 256, 128, 2, 8), (64, 256, 64, 4, 4)]
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in shapes]


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Grouped tile order (GROUP M-tiles share their B tiles in L2)."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(n_m - first_m, GROUP)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _bmm_kernel(a, b, sa, sb, c, M, N, K, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GROUP: tl.constexpr):
    """MODE 0: bf16 x bf16; 1: e4m3 x e4m3 with e8m0 scales; 2: bf16 x (e4m3 with scales). M, N, K multiples
    of the tile."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP)
    e = tl.program_id(1).to(tl.int64)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    a_ptr = a + e * M * K + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptr = b + e * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    sa_ptr = sa + e * M * (K // 32) + rm[:, None].to(tl.int64) * (K // 32) + rs[None, :]
    sb_ptr = sb + e * N * (K // 32) + rn[:, None].to(tl.int64) * (K // 32) + rs[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        av = tl.load(a_ptr)
        bv = tl.load(b_ptr)
        if MODE == 0:
            acc = tl.dot(av, tl.trans(bv), acc)
        elif MODE == 1:
            acc = tl.dot_scaled(av, tl.load(sa_ptr), "e4m3", tl.trans(bv), tl.load(sb_ptr), "e4m3", acc)
        else:
            acc = tl.dot_scaled(av, None, "bf16", tl.trans(bv), tl.load(sb_ptr), "e4m3", acc)
        a_ptr += BK
        b_ptr += BK
        sa_ptr += BK // 32
        sb_ptr += BK // 32
    c_ptr = c + e * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptr, acc.to(tl.bfloat16))


def _kernels():
    """The kernel, autotuned over :func:`_configs` per shape and mode."""
    return triton.autotune(configs=_configs(), key=["M", "N", "K", "MODE"])(_bmm_kernel)


def _operands(m, k, n, device):
    """Random e4m3 data (no NaN) and e8m0 scales 119..135; their exact bf16 dequantization."""
    def fp8(*shape):
        bits = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        bits[(bits & 0x7F) == 0x7F] = 0x00  # e4m3 NaN -> 0
        return bits.view(torch.float8_e4m3fn)

    def dequant(q, s):
        return (q.float() * torch.exp2(s.float() - 127).repeat_interleave(32, dim=-1)).to(torch.bfloat16)

    qa, qb = fp8(E, m, k), fp8(E, n, k)
    sa = torch.randint(119, 136, (E, m, k // 32), dtype=torch.uint8, device=device)
    sb = torch.randint(119, 136, (E, n, k // 32), dtype=torch.uint8, device=device)
    a, b = dequant(qa, sa), dequant(qb, sb)
    assert torch.equal(a.float(), qa.float() * torch.exp2(sa.float() - 127).repeat_interleave(32, dim=-1))
    return qa, sa, qb, sb, a, b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/probes/gemm_dequant_probe.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=cli.positive_int_list, default=[2048, 16384], help="tokens per expert")
    p.add_argument("--rounds", type=cli.positive_int, default=5)
    p.add_argument("--json", type=cli.writable_file, default=None)
    args = p.parse_args(argv)
    if any(m % 256 for m in args.m):  # the kernel has no bounds masks: whole tiles only
        p.error(f"--m: tokens per expert must be multiples of 256, got {args.m}")
    require_cuda(argv)

    bmm = _kernels()
    dev = torch.device("cuda")
    rows, records = [], []
    for m in args.m:
        for name, k, n in GEMMS:
            qa, sa, qb, sb, a, b = _operands(m, k, n, dev)
            c = torch.empty(E, m, n, dtype=torch.bfloat16, device=dev)
            grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), E)  # noqa: E731
            offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * m
            a2, bt = a.view(E * m, k), b.transpose(1, 2)
            runs = {
                "cublas": lambda: torch.bmm(a, bt),
                "grouped": lambda: torch._grouped_mm(a2, bt, offs=offs),
                "triton-bf16": lambda: bmm[grid](a, b, sa, sb, c, m, n, k, MODE=0),
                "triton-mx": lambda: bmm[grid](qa, qb, sa, sb, c, m, n, k, MODE=1),
                "triton-mx-w": lambda: bmm[grid](a, qb, sa, sb, c, m, n, k, MODE=2),
            }
            outs, configs = {}, {}
            for v, fn in runs.items():
                out = fn()
                outs[v] = (c if v.startswith("triton") else out.view(E, m, n)).clone()
                configs[v] = str(bmm.best_config) if v.startswith("triton") else None
            ref = outs["triton-bf16"].float()
            checks = {v: ((outs[v].float() - ref).abs().max().item(), torch.equal(outs[v], outs["triton-bf16"]))
                      for v in runs}
            times = {v: [] for v in runs}
            for _ in range(args.rounds):
                for v, fn in runs.items():
                    times[v].append(bench_us(fn))
            flops = 2 * E * m * n * k
            for v in runs:
                ratios = [t / base for t, base in zip(times[v], times["triton-bf16"])]
                vs_cublas = [t / base for t, base in zip(times[v], times["cublas"])]
                us = statistics.median(times[v])
                rows.append([name, m, v, us, flops / us / 1e6, f"{statistics.median(ratios):.3f}",
                             f"{min(ratios):.3f}-{max(ratios):.3f}", f"{statistics.median(vs_cublas):.3f}",
                             f"{checks[v][0]:.3g}", "yes" if checks[v][1] else "no"])
                records.append(dict(gemm=name, m=m, k=k, n=n, variant=v, us=times[v], max_abs_diff=checks[v][0],
                                    bit_equal=checks[v][1], config=configs[v]))
            del qa, sa, qb, sb, a, b, c, outs
    print_table(f"E={E} batched GEMMs on {device_name()}, triton {triton.__version__}, {args.rounds} interleaved "
                "rounds (ratios: median, range)",
                ["gemm", "M/expert", "variant", "us", "TFLOP/s", "x triton-bf16", "range", "x cublas",
                 "max |diff| vs triton-bf16", "bit-equal"], rows)
    write_json(args.json, dict(device=device_name(), triton=triton.__version__, results=records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
