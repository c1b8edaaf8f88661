"""Colwise 32x1 (wgrad K-groups operands) and 3D expert-weight MXFP8 quantization bandwidth vs memcpy
and peers (docs/design.md section 6). Builds on :mod:`benchmarks.bench_quantize` (the 1x32 benchmark: group
offsets, torchao peer), never the other way.

    python -m benchmarks.bench_quantize_32x1 [--m 8192,32768,131072] [--r 2048,5120,7168] [--groups 8]
                                             [--w 8x8192x5120,8x2048x7168,16x2048x7168] [--no-torchao]
                                             [--kernels 32x1,3d,3d-fp32]

Per shape: us, TB/s, % of a bf16 memcpy of the same tensor measured in the same run (the kernel alone: each call
after an L2 flush, events around it); ``loop``: per call of the op called back to back from Python, as a user's
eager loop calls it (where the op's host time exceeds its kernel's, the host's rate); and the time per call
inside a CUDA graph of several calls (launch overhead hidden). Bytes = input read + every output
written once (data, the whole scale buffer with its padding, the padded offsets). Peers that run on
Hopper, timed in the same run (FLOOR: torchao's RCEIL Triton path needs a Blackwell instruction):
torchao's Triton ``triton_to_mxfp8_dim1`` (+ its K-groups scale rearrange) and ``triton_to_mxfp8_dim0``
(+ its per-group 3D rearrange). Along N torchao has no kernel that runs on Hopper.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_quantize import PEER_MODE, _torchao_triton_dim0, group_offsets, multiple_of_32_list
from benchmarks.timing import (Rotating, bench_us, device_name, host_us, loop_us, memcpy_tbps, print_table,
                               prog_name, tbps)
from moe_quant import cli, layouts
from moe_quant.kernels import ops
from moe_quant.kernels.quantize_32x1 import ops as ops_32x1
from moe_quant.numerics import BLOCK_SIZE, ScaleMode

MODE = ScaleMode.RCEIL
DEFAULT_SHAPES = [(8, 8192, 5120), (8, 2048, 7168), (16, 2048, 7168)]  # 3D weights (E, N, K)


def graph_us(make_call, rot: Rotating, calls: int = 8) -> float:
    """Per-call time of ``calls`` launches captured in one CUDA graph (one per rotating input set)."""
    fns = [make_call(rot.next()) for _ in range(calls)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return bench_us(g.replay) / calls


def k_groups_bytes(m: int, r: int, g: int, out: str) -> int:
    mp = layouts.k_groups_padded_len(m, g)
    if out == "fake":
        return 2 * m * r + 2 * r * mp + 4 * g
    rows, cols = layouts.k_groups_blocked_shape(r, m, g)
    return 2 * m * r + r * mp + rows * cols + 4 * g


def w_bytes(e: int, n: int, k: int, along: str, out: str) -> int:
    if out == "fake":
        return 4 * e * n * k
    rows, cols = layouts.blocked_shape(k if along == "n" else n, (n if along == "n" else k) // BLOCK_SIZE)
    return 3 * e * n * k + e * rows * cols


def _peers(no_torchao: bool):
    """torchao's Triton kernels that run on Hopper: the mx_formats module re-imported past its SM100 gate
    (``bench_quantize._torchao_triton_dim0``); the MoE scale rearranges are plain Triton."""
    if no_torchao:
        return None
    try:
        import torchao.prototype.moe_training.kernels.mxfp8.quant as kq

        dim0 = _torchao_triton_dim0()
        import torchao.prototype.mx_formats.kernels as km  # the re-imported module

        return dict(dim0=dim0, dim1=km.triton_to_mxfp8_dim1, kgroups=kq.triton_mx_block_rearrange_2d_K_groups,
                    per_group_3d=kq.triton_mx_block_rearrange_per_group_3d)
    except Exception as e:  # pragma: no cover
        print(f"torchao peers unavailable: {type(e).__name__}: {e}")
        return None


def _time_peer(fn, rot, nb: int, cp: float):
    try:
        fn(rot.next()[0])
        us = bench_us(lambda: fn(rot.next()[0]))
        return [us, 100 * tbps(nb, us) / cp]
    except Exception as e:
        print(f"peer failed: {type(e).__name__}: {str(e)[:200]}")
        return ["fail", "fail"]


def bench_k_groups(ms, rs, g: int, peers) -> list[list]:
    rows = []
    for m in ms:
        for r in rs:
            _, cp = memcpy_tbps((m, r))
            rot = Rotating(lambda: (torch.randn(m, r, device="cuda", dtype=torch.bfloat16),))
            for ragged in (False, True):
                offs = group_offsets(m, g, ragged)
                for out in ("mxfp8", "fake"):
                    if out == "mxfp8":
                        def make(t):
                            return lambda: ops.quantize_32x1_k_groups(t[0], MODE, offs)
                    else:
                        def make(t):
                            return lambda: ops.fake_quantize_32x1_k_groups(t[0], MODE, offs)
                    nb = k_groups_bytes(m, r, g, out)
                    make(rot.next())()
                    us = bench_us(lambda: make(rot.next())())
                    lus = loop_us(lambda: make(rot.next())())
                    gus = graph_us(make, rot)
                    row = [m, r, "ragged" if ragged else "aligned", out, us, tbps(nb, us), 100 * tbps(nb, us) / cp,
                           lus, 100 * tbps(nb, lus) / cp, gus, 100 * tbps(nb, gus) / cp]
                    if peers is not None and out == "mxfp8":
                        dim1, kg = peers["dim1"], peers["kgroups"]
                        pb = 3 * m * r + m * r // 32

                        def peer(x):
                            d, s = dim1(x, 32, PEER_MODE)
                            return d, kg(s.view(torch.uint8), offs // BLOCK_SIZE)  # torchao takes scale-column offsets

                        row += _time_peer(peer, rot, pb, cp)[1:] + _time_peer(lambda x: dim1(x, 32, PEER_MODE), rot,
                                                                              pb, cp)[1:]
                    else:
                        row += ["-", "-"]
                    rows.append(row + [cp])
            del rot
            torch.cuda.empty_cache()
    return rows


def bench_3d(shapes, peers) -> list[list]:
    rows = []
    for e, n, k in shapes:
        _, cp = memcpy_tbps((e * n, k))
        rot = Rotating(lambda: (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16),))
        for along in ("k", "n"):
            for out in ("mxfp8", "fake"):
                fn = {("k", "mxfp8"): ops.quantize_3d_along_k, ("n", "mxfp8"): ops.quantize_3d_along_n,
                      ("k", "fake"): ops.fake_quantize_3d_along_k, ("n", "fake"): ops.fake_quantize_3d_along_n}[
                    (along, out)]

                def make(t, fn=fn):
                    return lambda: fn(t[0], MODE)

                nb = w_bytes(e, n, k, along, out)
                make(rot.next())()
                us = bench_us(lambda: make(rot.next())())
                lus = loop_us(lambda: make(rot.next())())
                gus = graph_us(make, rot)
                row = [f"{e}x{n}x{k}", along, out, us, tbps(nb, us), 100 * tbps(nb, us) / cp, lus,
                       100 * tbps(nb, lus) / cp, gus, 100 * tbps(nb, gus) / cp]
                if peers is not None and out == "mxfp8" and along == "k":
                    dim0, p3 = peers["dim0"], peers["per_group_3d"]

                    def peer(w):
                        d, s = dim0(w.view(-1, k), 32, PEER_MODE)
                        return d, p3(s.view(torch.uint8).view(e, n, k // 32))

                    row += _time_peer(peer, rot, 3 * e * n * k + e * n * k // 32, cp)[1:]
                else:
                    row += ["-" if along == "k" else "none on Hopper"]
                rows.append(row + [cp])
        del rot
        torch.cuda.empty_cache()
    return rows


def bench_3d_fp32(shapes) -> list[list]:
    """fp32 master weights, quantized as their bf16 rounding: the kernels rounding as they load (``as_bf16``,
    what the GEMMs run) against the plain computation (``w.to(bfloat16)``, then the bf16 kernel), both timed
    here. Bytes of the fast path: the fp32 read plus the outputs; the plain path moves 6 more per element."""
    rows = []
    fns = {("k", "mxfp8"): lambda w, a: ops.run_3d_along_k(w, MODE.value, a),
           ("n", "mxfp8"): lambda w, a: ops.run_3d_along_n(w, MODE.value, a),
           ("k", "fake"): lambda w, a: ops.run_fake_3d_along_k(w, MODE.value, torch.bfloat16, a),
           ("n", "fake"): lambda w, a: ops.run_fake_3d_along_n(w, MODE.value, torch.bfloat16, a)}
    for e, n, k in shapes:
        _, cp = memcpy_tbps((e * n, k))
        rot = Rotating(lambda: (torch.randn(e, n, k, device="cuda", dtype=torch.float32),))
        for (along, out), fn in fns.items():
            nb = w_bytes(e, n, k, along, out) + 2 * e * n * k  # 4 bytes read per element, not 2

            def fast(t, fn=fn):
                return fn(t[0], True)

            def plain(t, fn=fn):
                return fn(t[0].to(torch.bfloat16), False)

            fast(rot.next()), plain(rot.next())
            us = bench_us(lambda: fast(rot.next()))
            pus = bench_us(lambda: plain(rot.next()))
            rows.append([f"{e}x{n}x{k}", along, out, us, tbps(nb, us), 100 * tbps(nb, us) / cp, pus, pus / us, cp])
        del rot
        torch.cuda.empty_cache()
    return rows


def host_overhead_us(n: int = 100, reps: int = 20) -> list[list]:
    """CPU time per eager call on tiny inputs (the launch queue never fills)."""
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    out = []
    kern = ops_32x1._kernel_32x1(x, MODE.value, "kgroups", torch.float8_e4m3fn)
    (r, mp), (sr, sc) = ops_32x1._k_groups_shapes(256, 256, 2)
    d = torch.empty(r, mp, device="cuda", dtype=torch.float8_e4m3fn)
    sbuf = torch.empty(sr, sc, device="cuda", dtype=torch.float8_e8m0fnu)
    pbuf = torch.empty(2, device="cuda", dtype=torch.int32)
    from moe_quant import quantize as q

    for name, fn in (
        ("quantize_32x1_k_groups", lambda: ops.quantize_32x1_k_groups(x, MODE, offs)),
        ("  of which: compiled kernel call alone (TVM-FFI)", lambda: kern(x, d, sbuf, offs, pbuf)),
        ("  of which: torch.empty x3", lambda: (torch.empty(r, mp, device="cuda", dtype=torch.float8_e4m3fn),
                                                torch.empty(sr, sc, device="cuda", dtype=torch.float8_e8m0fnu),
                                                torch.empty(2, device="cuda", dtype=torch.int32))),
        ("moe_quant.quantize.quantize_colwise_k_groups (public, checked)",
         lambda: q.quantize_colwise_k_groups(x, offs, MODE)),
        ("fake_quantize_32x1_k_groups", lambda: ops.fake_quantize_32x1_k_groups(x, MODE, offs)),
        ("quantize_3d_along_n", lambda: ops.quantize_3d_along_n(w, MODE)),
        ("quantize_3d_along_k (N % 128 == 0)", lambda: ops.quantize_3d_along_k(w, MODE)),
    ):
        out.append([name, host_us(fn, n, reps)])
    return out


def run(ms, rs, g: int, shapes, no_torchao: bool, kernels=("32x1", "3d", "3d-fp32")) -> None:
    print(f"device: {device_name()}  torch {torch.__version__}")
    peers = _peers(no_torchao)
    if "32x1" in kernels:
        print_table(
            f"colwise 32x1 MXFP8 along tokens, K-groups (fused per-group padding), G={g}, bf16 input, "
            f"{MODE.value} ({device_name()})",
            ["M", "R", "groups", "out", "us", "TB/s", "%memcpy", "loop us", "loop %memcpy", "graph us", "graph %memcpy",
             f"torchao({PEER_MODE}) dim1+Kgroups %memcpy", "torchao dim1-only %memcpy", "memcpy TB/s"],
            bench_k_groups(ms, rs, g, peers),
        )
    if "3d" in kernels:
        print_table(
            f"3D expert weights (E, N, K), bf16 input, {MODE.value} ({device_name()})",
            ["E x N x K", "along", "out", "us", "TB/s", "%memcpy", "loop us", "loop %memcpy", "graph us",
             "graph %memcpy",
             f"torchao({PEER_MODE}) dim0+3D %memcpy", "memcpy TB/s"],
            bench_3d(shapes, peers),
        )
    if "3d-fp32" in kernels:
        print_table(
            f"3D expert weights (E, N, K), fp32 input quantized as bf16 (as_bf16), {MODE.value} ({device_name()})",
            ["E x N x K", "along", "out", "us", "TB/s", "%memcpy", "cast + bf16 kernel us", "cast+kernel / as_bf16",
             "memcpy TB/s"],
            bench_3d_fp32(shapes),
        )
    print_table("host overhead per eager call (us)", ["call", "us"], host_overhead_us())


def weight_shapes(text: str) -> list[tuple[int, int, int]]:
    """``type=`` for --w: ``ExNxK`` weight shapes, comma separated, N and K multiples of 32."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or any(int(p) % 32 for p in parts[1:]):
            raise argparse.ArgumentTypeError(f"expected ExNxK shapes (N, K multiples of 32) such as 8x2048x7168, got {text!r}")
        shapes.append(tuple(int(p) for p in parts))
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected at least one ExNxK shape, got {text!r}")
    return shapes


def main(argv=None):
    from benchmarks.timing import require_cuda

    p = argparse.ArgumentParser(prog=prog_name())
    p.add_argument("--m", type=cli.positive_int_list, default=[8192, 32768, 131072])
    p.add_argument("--r", type=multiple_of_32_list, default=[2048, 5120, 7168])
    p.add_argument("--groups", type=cli.positive_int, default=8)
    p.add_argument("--w", type=weight_shapes, default=list(DEFAULT_SHAPES))
    p.add_argument("--kernels", type=cli.comma_choices("32x1", "3d", "3d-fp32"), default=["32x1", "3d", "3d-fp32"],
                   help="comma list of 32x1, 3d, 3d-fp32 (fp32 master weights read as bf16 vs cast + kernel)")
    p.add_argument("--no-torchao", action="store_true")
    args = p.parse_args(argv)
    require_cuda(argv)  # one line and exit status 2 without a GPU
    run(args.m, args.r, args.groups, args.w, args.no_torchao, args.kernels)


if __name__ == "__main__":
    main()
