"""Rowwise 1x32 MXFP8 quantization bandwidth: the CuTe-DSL kernel vs memcpy and peers (docs/design.md section 6).

    python -m benchmarks.bench_quantize [--m 8192,32768,131072] [--k 2048,5120,7168] [--groups 8]
                                        [--no-compile-ref] [--no-torchao] [--tiles 256x4,128x8]

Per (M, K), G groups (128-aligned and ragged), bf16 input, two output kinds:
``mxfp8`` (e4m3 data + M-groups blocked scales) and ``fake`` (dequantized bf16, the emulated
GEMM's operand). Columns: us, TB/s, % of a bf16 memcpy of the same tensor measured in this run,
for moe_quant's kernel (alone: each call after an L2 flush; and ``loop``: called back to back from
Python, as a user's eager loop calls it, where the op's host time can exceed the kernel's),
``torch.compile`` of the reference, and torchao's Triton ``triton_to_mxfp8_dim0`` (+ its Triton M-groups
scale rearrange). Bytes = input read + outputs written (the whole scale buffer, padding included). Also
prints host overhead per eager call.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import Rotating, bench_us, device_name, host_us, loop_us, memcpy_tbps, print_table, tbps
from moe_quant import layouts, reference
from moe_quant.kernels import compile_cache, ops
from moe_quant.kernels.quantize_1x32 import ops as ops_1x32
from moe_quant.numerics import ScaleMode


def group_offsets(m: int, g: int, ragged: bool, seed: int = 0) -> torch.Tensor:
    if not ragged:
        sizes = torch.full((g,), m // g, dtype=torch.int64)
        sizes[-1] += m - sizes.sum()
    else:  # uneven sizes, none a multiple of 128 (router-like imbalance)
        gen = torch.Generator().manual_seed(seed)
        w = torch.rand(g, generator=gen) + 0.5
        sizes = (w / w.sum() * m).floor().long()
        sizes[:-1] += torch.randint(1, 127, (g - 1,), generator=gen)
        sizes[-1] = m - sizes[:-1].sum()
    return sizes.cumsum(0).to(torch.int32).cuda()


PEER_MODE = "floor"  # see _torchao_triton_dim0


def nbytes(m: int, k: int, g: int, kind: str) -> int:
    if kind == "fake":
        return 2 * m * k + 2 * m * k
    rows, cols = layouts.m_groups_blocked_shape(m, k // 32, g)
    return 2 * m * k + m * k + rows * cols


def _torchao_triton_dim0():
    """torchao 0.18 defines its Triton MX kernels only on SM100+ (its RCEIL path uses a Blackwell PTX
    cvt); the FLOOR path is plain Triton, so re-import the module past the arch gate and time FLOOR."""
    import importlib

    import torchao.prototype.mx_formats.kernels as km
    import torchao.utils as tu

    if not km._triton_kernels_available:
        orig = tu.is_sm_at_least_100
        tu.is_sm_at_least_100 = lambda: True
        try:
            km = importlib.reload(km)
        finally:
            tu.is_sm_at_least_100 = orig
    return km.triton_to_mxfp8_dim0


def torchao_peer(kind: str):
    if kind != "mxfp8":
        return None
    try:
        from torchao.prototype.moe_training.kernels.mxfp8.quant import triton_mx_block_rearrange_2d_M_groups

        triton_to_mxfp8_dim0 = _torchao_triton_dim0()
    except Exception as e:  # pragma: no cover
        print(f"torchao peer unavailable: {e}")
        return None

    def f(x, offs):
        data, scales = triton_to_mxfp8_dim0(x, 32, PEER_MODE)
        return data, triton_mx_block_rearrange_2d_M_groups(scales.view(torch.uint8), offs)

    def f_dim0(x, offs):
        return triton_to_mxfp8_dim0(x, 32, PEER_MODE)

    return f, f_dim0


def torchao_cutedsl_peer():
    """torchao's own CuTe-DSL 1x32 kernel (plain scales; its blocked output is SM100-only)."""
    try:
        from torchao.prototype.moe_training.kernels.mxfp8.cutedsl_quantize_2d_1x32 import (
            mxfp8_quantize_cutedsl_2d_1x32,
        )

        return lambda x: mxfp8_quantize_cutedsl_2d_1x32(x, 32, "rceil", blocked_scale_output=False)
    except Exception as e:  # pragma: no cover
        print(f"torchao cutedsl peer unavailable: {e}")
        return None


def host_overhead_us(n: int = 100, reps: int = 20) -> dict:
    """Host time per eager call (tiny input): batches of ``n`` calls, few enough that the launch queue
    never fills, so the GPU never throttles the loop; the best batch of ``reps``."""
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    out = {}
    kern = ops_1x32._kernel_for(x, "rceil", "mgroups", "float8_e4m3fn")
    rows, cols = layouts.m_groups_blocked_shape(256, 8, 2)
    d = torch.empty(256, 256, device="cuda", dtype=torch.float8_e4m3fn)
    sc = torch.empty(rows, cols, device="cuda", dtype=torch.float8_e8m0fnu)
    for name, fn in (
        ("quantize_1x32(offs)", lambda: ops.quantize_1x32(x, ScaleMode.RCEIL, offs)),
        ("  of which: compiled kernel call alone (TVM-FFI)", lambda: kern(x, d, sc, offs)),
        ("fake_quantize_1x32", lambda: ops.fake_quantize_1x32(x, ScaleMode.RCEIL)),
        ("torch.ops.moe_quant.quantize_1x32", lambda: torch.ops.moe_quant.quantize_1x32(x, "rceil", offs, "blocked")),
        ("torch.empty x2 (floor)", lambda: (torch.empty(256, 256, device="cuda"), torch.empty(8, 8, device="cuda"))),
    ):
        out[name] = host_us(fn, n, reps)
    return out


def multiple_of_32_list(text: str) -> list[int]:
    """``type=`` for --k: a comma list of positive multiples of 32 (the quantized dim)."""
    from moe_quant import cli

    values = cli.positive_int_list(text)
    if any(v % 32 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive multiples of 32, got {text!r}")
    return values


def tile_list(text: str) -> list[tuple[int, int]]:
    """``type=`` for --tiles: ``THREADSxITERS`` pairs of positive integers, comma separated."""
    tiles = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected THREADSxITERS pairs such as 128x8,512x2, got {text!r}")
        tiles.append((int(parts[0]), int(parts[1])))
    return tiles


def main():
    from benchmarks.timing import prog_name, require_cuda
    from moe_quant import cli

    p = argparse.ArgumentParser(prog=prog_name())
    p.add_argument("--m", type=cli.positive_int_list, default=[8192, 32768, 131072])
    p.add_argument("--k", type=multiple_of_32_list, default=[2048, 5120, 7168])
    p.add_argument("--groups", type=cli.positive_int, default=8)
    p.add_argument("--no-compile-ref", action="store_true")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--tiles", type=tile_list, default=[],
                   help="extra tile configs to time, e.g. 128x8,512x2 (threads x iters)")
    p.add_argument("--kinds", type=cli.comma_choices("mxfp8", "fake"), default=["mxfp8", "fake"])
    args = p.parse_args()
    require_cuda()  # one line and exit status 2 without a GPU
    ms, ks = args.m, args.k
    g = args.groups
    kinds = args.kinds
    print(f"device: {device_name()}  torch {torch.__version__}")

    from moe_quant.kernels.quantize_1x32.config import TileConfig, Variant

    extra_tiles = [TileConfig(threads=th, iters=it) for th, it in args.tiles]

    ref_c = {}
    if not args.no_compile_ref:
        ref_c["mxfp8"] = torch.compile(reference.quantize_rowwise, dynamic=True, fullgraph=True)
        ref_c["fake"] = torch.compile(reference.fake_quantize_rowwise, dynamic=True, fullgraph=True)

    rows = []
    tile_rows = []
    peer_failed = False
    for m in ms:
        for k in ks:
            cp_us, cp_tbps = memcpy_tbps((m, k))
            rot = Rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),))
            for ragged in (False, True):
                offs = group_offsets(m, g, ragged)
                for kind in kinds:
                    nb = nbytes(m, k, g, kind)
                    if kind == "mxfp8":
                        ours = lambda: ops.quantize_1x32(rot.next()[0], ScaleMode.RCEIL, offs)  # noqa: E731
                    else:
                        ours = lambda: ops.fake_quantize_1x32(rot.next()[0], ScaleMode.RCEIL)  # noqa: E731
                    ours()
                    us = bench_us(ours)
                    lus = loop_us(ours)
                    row = [m, k, "ragged" if ragged else "aligned", kind, us, tbps(nb, us),
                           100 * tbps(nb, us) / cp_tbps, lus, 100 * tbps(nb, lus) / cp_tbps]
                    if kind in ref_c:
                        fn = ref_c[kind]
                        if kind == "mxfp8":
                            call = lambda: fn(rot.next()[0], ScaleMode.RCEIL, offs)  # noqa: E731
                        else:
                            call = lambda: fn(rot.next()[0], ScaleMode.RCEIL)  # noqa: E731
                        call()
                        rus = bench_us(call)
                        row += [rus, 100 * tbps(nb, rus) / cp_tbps]
                    else:
                        row += ["-", "-"]
                    peer = None if (args.no_torchao or peer_failed) else torchao_peer(kind)
                    if peer is not None:
                        f, f_dim0 = peer
                        try:
                            f(rot.next()[0], offs)
                            pus = bench_us(lambda: f(rot.next()[0], offs))
                            dus = bench_us(lambda: f_dim0(rot.next()[0], offs))
                            row += [pus, 100 * tbps(nb, pus) / cp_tbps,
                                    100 * tbps(3 * m * k + m * k // 32, dus) / cp_tbps]
                        except Exception as e:
                            print(f"torchao triton peer failed: {type(e).__name__}: {str(e)[:300]}")
                            peer_failed = True
                            row += ["fail", "fail", "fail"]
                    else:
                        row += ["-", "-", "-"]
                    cd = None if (args.no_torchao or kind != "mxfp8" or getattr(args, "no_torchao_cutedsl", False)) else torchao_cutedsl_peer()
                    if cd is not None:
                        try:
                            cd(rot.next()[0])
                            cus = bench_us(lambda: cd(rot.next()[0]))
                            row += [100 * tbps(3 * m * k + m * k // 32, cus) / cp_tbps]
                        except Exception as e:
                            print(f"torchao cutedsl peer failed: {type(e).__name__}: {str(e)[:200]}")
                            args.no_torchao_cutedsl = True
                            row += ["fail"]
                    else:
                        row += ["-"]
                    row += [cp_tbps]
                    rows.append(row)
                    for tile in extra_tiles:
                        kk = "mgroups" if kind == "mxfp8" else "fake"
                        od = "float8_e4m3fn" if kind == "mxfp8" else "bfloat16"
                        v = Variant("bfloat16", "rceil", kk, od, tile=tile)
                        kern = ops.get_kernel(v, compile_cache.arch(torch.device("cuda")))
                        if kind == "mxfp8":
                            rws, cls = layouts.m_groups_blocked_shape(m, k // 32, g)
                            o1 = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
                            o2 = torch.empty(rws, cls, device="cuda", dtype=torch.float8_e8m0fnu)
                            call = lambda: kern(rot.next()[0], o1, o2, offs)  # noqa: E731
                        else:
                            o1 = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
                            call = lambda: kern(rot.next()[0], o1, None, None)  # noqa: E731
                        call()
                        tus = bench_us(call)
                        tile_rows.append([m, k, "ragged" if ragged else "aligned", kind, f"{tile.threads}x{tile.iters}",
                                          tus, 100 * tbps(nb, tus) / cp_tbps])
            del rot
            torch.cuda.empty_cache()
    print_table(
        f"rowwise 1x32 MXFP8, G={g}, bf16 input, RCEIL ({device_name()})",
        ["M", "K", "groups", "out", "us", "TB/s", "%memcpy", "loop us", "loop %memcpy", "ref.compile us",
         "ref %memcpy",
         f"torchao({PEER_MODE}) us", "torchao %memcpy", "torchao dim0-only %memcpy", "torchao cutedsl(plain) %memcpy",
         "memcpy TB/s"],
        rows,
    )
    if tile_rows:
        print_table("tile configs (threads x iters)", ["M", "K", "groups", "out", "tile", "us", "%memcpy"], tile_rows)
    ho = host_overhead_us()
    print_table("host overhead per eager call (us; CPU time, launch queue never full)", ["call", "us"], [[k, v] for k, v in ho.items()])
    print(f"kernel cache: {ops.STATS}")


if __name__ == "__main__":
    main()
