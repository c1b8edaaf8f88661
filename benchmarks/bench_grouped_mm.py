"""One expert layer, fwd + bwd: emulated MXFP8 (moe_quant) vs bf16 torch._grouped_mm vs torchao's
emulated MXFP8 path, on the DeepSeek-V3 and Llama4 expert shapes (DESIGN.md section 6).

    python -m benchmarks.bench_grouped_mm [--shapes dsv3,llama4] [--compile] [--no-torchao]

Prints a table: ms per fwd+bwd, ratio to bf16, speedup over torchao emulated, SQNR of the output.
"""

from __future__ import annotations

import argparse
import math
from unittest import mock

import torch

from benchmarks.timing import bench_us, device_name, print_table
from moe_quant import backends, mxfp8_grouped_mm

SHAPES = {  # name: (M tokens, K in, N out, G experts)
    "dsv3": (131072, 7168, 2048, 8),
    "llama4": (131072, 5120, 8192, 8),
}


def ragged_offsets(m: int, g: int, seed: int = 0, align: int = 32) -> torch.Tensor:
    """Uneven group sizes (router-like imbalance) summing to m, each a multiple of ``align``.

    PyTorch's bf16 grouped GEMM backward needs 16-byte-aligned token groups (a device assert
    otherwise), so the baseline gets aligned groups, as torchtitan pads them; moe_quant itself
    takes any sizes.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(g, generator=gen) + 0.5
    sizes = (w / w.sum() * m / align).floor().long() * align
    sizes[-1] += m - sizes.sum()
    return sizes.cumsum(0).to(torch.int32).cuda()


def sqnr(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


def torchao_emulated():
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    def f(A, W_t, offs):
        return _to_mxfp8_then_scaled_grouped_mm(A, W_t, offs, kernel_preference=KernelPreference.EMULATED)

    return f


def main():
    from benchmarks.timing import require_cuda

    require_cuda()  # one line and exit status 2 without a GPU
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3,llama4")
    p.add_argument("--compile", action="store_true", help="add a torch.compile(mxfp8_grouped_mm) row")
    p.add_argument("--no-torchao", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)

    impls = {
        "bf16 torch._grouped_mm": lambda A, W_t, offs: torch._grouped_mm(A, W_t, offs=offs),
        "moe_quant emulated": lambda A, W_t, offs: mxfp8_grouped_mm(A, W_t, offs, backend="emulated"),
    }

    def reference_quant(A, W_t, offs):
        with mock.patch.object(backends, "use_quant_kernels", lambda x: False):
            return mxfp8_grouped_mm(A, W_t, offs, backend="emulated")

    impls["moe_quant emulated, reference quant"] = reference_quant
    if args.compile:
        impls["moe_quant emulated, torch.compile"] = torch.compile(
            lambda A, W_t, offs: mxfp8_grouped_mm(A, W_t, offs, backend="emulated")
        )
    if not args.no_torchao:
        try:
            impls["torchao emulated (to_mx)"] = torchao_emulated()
        except Exception as e:  # noqa: BLE001 -- report and go on without the peer
            print(f"torchao emulated path unavailable: {e!r}")

    rows = []
    for name in args.shapes.split(","):
        m, k, n, g = SHAPES[name]
        A = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        W = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)).requires_grad_()
        offs = ragged_offsets(m, g)
        go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref_out = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs).detach()
        base_us = None
        torchao_us = None
        results = []
        for label, f in impls.items():
            def step():
                out = f(A, W.transpose(-2, -1), offs)
                out.backward(go)

            try:
                step()
                us = bench_us(step, warmup_ms=50, rep_ms=300)
                quality = sqnr(f(A, W.transpose(-2, -1), offs).detach(), ref_out)
            except torch.OutOfMemoryError as e:
                print(f"{name} {label}: out of memory ({e})")
                torch.cuda.empty_cache()
                continue
            finally:
                A.grad = W.grad = None
            if label.startswith("bf16"):
                base_us = us
            if label.startswith("torchao"):
                torchao_us = us
            results.append((label, us, quality))
        for label, us, quality in results:
            rows.append(
                [
                    f"{name} ({m}, {k}->{n}, G={g})",
                    label,
                    us / 1e3,
                    us / base_us if base_us else float("nan"),
                    torchao_us / us if torchao_us else float("nan"),
                    quality,
                ]
            )
        del A, W, go, ref_out
        torch.cuda.empty_cache()
    print_table(
        f"expert layer fwd+bwd on {device_name()} (do_bench median)",
        ["shape", "implementation", "ms", "x bf16", "speedup vs torchao emu", "out SQNR dB"],
        rows,
    )


if __name__ == "__main__":
    main()
