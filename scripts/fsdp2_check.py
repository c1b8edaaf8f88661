"""FSDP2 check for MXFP8-converted experts: ``torchrun --nproc_per_node 2 scripts/fsdp2_check.py``.

Works on CPU (gloo) and CUDA (nccl); ``--device auto`` picks CUDA when present.

For each expert count in ``--experts`` (default ``4,3``: even and uneven dim-0 sharding),
it trains a small MoE model (``moe_quant.moe.TinyMoEModel``, converted with
``quantize_(..., MXFP8MoEConfig(), filter_fn=lambda m, fqn: "experts" in fqn)``) for a few
steps two ways, on the same per-rank batches:

* ``fsdp``: ``fully_shard`` on every MoE layer and on the root, fp32 sharded parameters,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, AdamW on the sharded
  (DTensor) parameters;
* ``reference``: no FSDP. A full fp32 master copy on every rank; each step it is cast into
  a converted bf16 working copy, which runs forward/backward on the rank's batch; the
  bf16 gradients are cast to fp32, averaged across ranks with ``all_reduce`` and applied
  by AdamW to the master copy. This is what FSDP2 with that policy computes.

It checks: the expert modules are converted and their unsharded weights seen in forward are
plain parameters; the MXFP8 grouped GEMM ran; no grouped-mm call fell back to the plain op; the per-step losses and the final parameters
of the two runs agree (``--rtol``); the loss goes down; ``state_dict()`` of the FSDP model
holds DTensors of plain tensors. Rank 0 prints one PASS/FAIL line per case with the
numbers and a final verdict; the exit code is 0 only if everything passed on every rank.

Teardown is part of the check: after a barrier every rank destroys the process group and
drops the references that DTensor's caches keep to it, so that the communication backend
and its threads (gloo: ``gloo_tcp_loop``, ``pt_gloo_runloop``) end before the interpreter
exits; each rank then prints whether any such thread is left (a left-over gloo thread is a
failure). A backend left for interpreter shutdown to destroy used to abort the process now
and then with ``terminate called without an active exception`` after ``PASS overall``.

With expert parallelism (tokens already dispatched and permuted so that each rank holds
only its local experts' tokens, ``offs`` over the local experts), the same conversion
applies unchanged: the local expert weights are ``(E_local, N, K)`` and
``mxfp8_grouped_mm`` sees only local groups; FSDP2 then shards those local experts over
the data-parallel mesh.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Runnable as `torchrun ... scripts/fsdp2_check.py` from the repository root without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import require_cuda  # noqa: E402
from moe_quant import cli  # noqa: E402
import moe_quant.autograd  # noqa: E402
from moe_quant.conversion import MXFP8MoEConfig, fallback_counts, is_converted  # noqa: E402
from moe_quant.moe import GroupedExperts, TinyMoEModel  # noqa: E402


def expert_counts(text: str) -> list[int]:
    """``type=`` for --experts: the model routes top-2, so every count is at least 2."""
    counts = cli.positive_int_list(text)
    if min(counts) < 2:
        raise argparse.ArgumentTypeError(f"expert counts must be at least 2 (top-2 routing), got {text!r}")
    return counts


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--experts", type=expert_counts, default=[4, 3],
                   help="comma-separated expert counts, one case each")
    p.add_argument("--steps", type=cli.positive_int, default=6)
    p.add_argument("--tokens", type=cli.positive_int, default=256, help="tokens per rank per step")
    p.add_argument("--dim", type=cli.positive_int, default=64)
    p.add_argument("--hidden", type=cli.positive_int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rtol", type=float, default=1e-3, help="max relative difference fsdp vs reference")
    p.add_argument("--threads", type=cli.positive_int, default=1, help="CPU threads per rank (default 1; the model is tiny)")
    p.add_argument("--timeout", type=float, default=240, help="seconds a collective may wait before it fails")
    return p.parse_args()


def fsdp_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # older PyTorch
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def build(num_experts: int, args, device):
    torch.manual_seed(0)
    model = TinyMoEModel(32, args.dim, args.hidden, num_experts, top_k=2, n_layers=2, out_dim=32).to(device)
    torch.manual_seed(1)
    teacher = TinyMoEModel(32, args.dim, args.hidden, num_experts, top_k=2, n_layers=2, out_dim=32).to(device)
    for mod in teacher.modules():
        if isinstance(mod, GroupedExperts):
            mod.init_weights(std=0.2)
    return model, teacher


def batch(teacher, rank: int, step: int, args, device):
    g = torch.Generator(device="cpu").manual_seed(1000 * step + rank)
    x = torch.randn(args.tokens, 32, generator=g).to(device)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def convert(model):
    from torchao.quantization import quantize_

    quantize_(model, MXFP8MoEConfig(), filter_fn=lambda mod, fqn: "experts" in fqn)
    return model


def run_case(num_experts: int, args, device, rank: int, world: int) -> dict:
    fully_shard, MixedPrecisionPolicy = fsdp_api()
    master, teacher = build(num_experts, args, device)

    # --- FSDP2 model: fp32 sharded parameters, bf16 compute
    fsdp_model = convert(copy.deepcopy(master))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in fsdp_model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(fsdp_model, mp_policy=mp)
    opt_f = torch.optim.AdamW(fsdp_model.parameters(), lr=args.lr, foreach=False)

    seen_types = set()
    mxfp8_calls = [0]
    real_gemm = moe_quant.autograd.mxfp8_grouped_mm
    real_block = moe_quant.autograd.mxfp8_swiglu_experts

    def counting_gemm(*a, **k):  # the conversion looks the GEMM up on each call
        mxfp8_calls[0] += 1
        return real_gemm(*a, **k)

    def counting_block(*a, **k):  # the fused SwiGLU block: its three grouped GEMMs
        mxfp8_calls[0] += 3
        return real_block(*a, **k)

    moe_quant.autograd.mxfp8_grouped_mm = counting_gemm
    moe_quant.autograd.mxfp8_swiglu_experts = counting_block

    def record(mod, inputs):
        seen_types.update(type(getattr(mod, n)).__name__ for n in ("w1", "w2", "w3"))

    hooks = [m.register_forward_pre_hook(record) for m in fsdp_model.modules() if isinstance(m, GroupedExperts)]

    # --- reference: fp32 master + converted bf16 working copy, gradients all-reduced by hand
    ref_master = copy.deepcopy(master)
    ref_work = convert(copy.deepcopy(master).to(torch.bfloat16))
    opt_r = torch.optim.AdamW(ref_master.parameters(), lr=args.lr, foreach=False)

    losses_f, losses_r = [], []
    for step in range(args.steps):
        x, y = batch(teacher, rank, step, args, device)
        loss_f = F.mse_loss(fsdp_model(x).float(), y)
        loss_f.backward()
        opt_f.step()
        opt_f.zero_grad()

        with torch.no_grad():
            for p_w, p_m in zip(ref_work.parameters(), ref_master.parameters()):
                p_w.copy_(p_m)
        loss_r = F.mse_loss(ref_work(x.to(torch.bfloat16)).float(), y)
        loss_r.backward()
        for p_w, p_m in zip(ref_work.parameters(), ref_master.parameters()):
            grad = p_w.grad.float()
            dist.all_reduce(grad)
            p_m.grad = grad / world
            p_w.grad = None
        opt_r.step()
        opt_r.zero_grad()

        pair = torch.stack([loss_f.detach(), loss_r.detach()]).float()
        dist.all_reduce(pair)
        losses_f.append(pair[0].item() / world)
        losses_r.append(pair[1].item() / world)
    for h in hooks:
        h.remove()
    moe_quant.autograd.mxfp8_grouped_mm = real_gemm
    moe_quant.autograd.mxfp8_swiglu_experts = real_block

    # final parameters, gathered
    param_rel = 0.0
    for (name, p_f), p_r in zip(fsdp_model.named_parameters(), ref_master.parameters()):
        full = p_f.full_tensor() if hasattr(p_f, "full_tensor") else p_f
        diff = (full.float() - p_r.float()).abs().max().item()
        param_rel = max(param_rel, diff / max(p_r.float().abs().max().item(), 1e-12))

    sd = fsdp_model.state_dict()
    expert_keys = [k for k in sd if ".experts." in k]
    sd_plain = all(
        type(getattr(sd[k], "_local_tensor", sd[k])) is torch.Tensor for k in expert_keys
    ) and len(expert_keys) == 3 * len(fsdp_model.layers)
    experts = [m for m in fsdp_model.modules() if isinstance(m, GroupedExperts)]
    converted = bool(experts) and all(is_converted(m) for m in experts)
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses_f, losses_r))
    checks = {
        "expert modules converted": converted,
        "unsharded experts are plain parameters in forward": bool(seen_types) and seen_types <= {"Parameter", "Tensor"},
        "MXFP8 grouped GEMM ran (3 per layer and step)": mxfp8_calls[0] >= 3 * len(experts) * len(losses_f),
        "no grouped_mm fallback": not fallback_counts(),
        f"loss fsdp vs reference within rtol={args.rtol}": loss_rel <= args.rtol,
        f"params fsdp vs reference within rtol={args.rtol}": param_rel <= args.rtol,
        "loss decreased": losses_f[-1] < losses_f[0],
        "state_dict holds plain tensors": sd_plain,
    }
    return dict(
        experts=num_experts, losses_f=losses_f, losses_r=losses_r, loss_rel=loss_rel, param_rel=param_rel,
        seen=sorted(seen_types), checks=checks, ok=all(checks.values()),
    )


# Name prefixes (Linux thread names) of the threads a communication backend starts.
_BACKEND_THREADS = {"gloo": ("gloo", "pt_gloo"), "nccl": ("pt_nccl", "nccl")}


def backend_threads(backend: str) -> list[str] | None:
    """Names of this process's threads that belong to ``backend``; None where they cannot be listed."""
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return None
    names = []
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n.startswith(_BACKEND_THREADS.get(backend, ())))


def release_mesh_process_groups() -> int:
    """Drop the ProcessGroup references that outlive ``destroy_process_group``; returns how many meshes held some.

    ``fully_shard`` builds a DeviceMesh, and DTensor's sharding-propagation and redistribution
    caches keep DeviceMesh objects alive for the life of the process. Each mesh keeps its
    ProcessGroup objects (``DeviceMesh._pg_registry`` in torch 2.13), so the backend is
    not destroyed by ``destroy_process_group`` but only during interpreter shutdown, with its
    threads still running. The meshes are not used after teardown, so their groups are dropped
    here and the backend is destroyed now, while every rank is still alive.
    """
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # first free what is garbage already (the cases' models and their FSDP state)
    meshes = [obj for obj in gc.get_objects() if DeviceMesh in type(obj).__mro__]
    held, mesh = 0, None
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict) and registry:
            registry.clear()
            held += 1
    del meshes, mesh  # the loop variable would keep the last mesh alive
    gc.collect()
    return held


def teardown(backend: str, rank: int, clean_exit: bool) -> bool:
    """Barrier (when every rank got here normally), destroy the process group, release it; True if no backend thread is left."""
    if clean_exit:
        dist.barrier()  # no rank still has a collective in flight
    dist.destroy_process_group()
    release_mesh_process_groups()
    left = backend_threads(backend)
    if left is None:
        print(f"[fsdp2_check] rank {rank} teardown: process group destroyed (threads not listed on this OS)", flush=True)
        return True
    if left:
        print(f"[fsdp2_check] rank {rank} teardown: FAILED, {backend} threads still alive: {left}", flush=True)
        return backend != "gloo"  # checked on CPU (CI); reported only for nccl
    print(f"[fsdp2_check] rank {rank} teardown: process group destroyed, no {backend} threads left", flush=True)
    return True


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        require_cuda([])  # one line and exit status 2 where torch sees no GPU
    if "RANK" not in os.environ:
        print("launch with: torchrun --nproc_per_node 2 scripts/fsdp2_check.py [--device cpu|cuda]", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"fsdp2_check.py: --device cuda: {cli.no_cuda_message()}", file=sys.stderr)
        return cli.NO_CUDA_STATUS
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(max(1, args.threads))
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend, device_id=device if use_cuda else None, timeout=datetime.timedelta(seconds=args.timeout)
    )
    rank, world = dist.get_rank(), dist.get_world_size()

    all_ok = True
    finished = False
    try:
        for e in args.experts:
            r = run_case(e, args, device, rank, world)
            ok = torch.tensor([1.0 if r["ok"] else 0.0], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            all_ok &= bool(ok.item() == 1.0)
            if rank == 0:
                verdict = "PASS" if ok.item() == 1.0 else "FAIL"
                print(
                    f"[fsdp2_check] {verdict} experts={e} world={world} device={device.type} "
                    f"loss fsdp {r['losses_f'][0]:.5f} -> {r['losses_f'][-1]:.5f}, "
                    f"reference {r['losses_r'][0]:.5f} -> {r['losses_r'][-1]:.5f}; "
                    f"max rel diff loss {r['loss_rel']:.2e}, params {r['param_rel']:.2e}"
                )
                for name, passed in r["checks"].items():
                    print(f"    [{'ok' if passed else 'FAILED'}] {name}")
        finished = True
    finally:
        if rank == 0:
            print(f"[fsdp2_check] {'PASS' if all_ok and finished else 'FAIL'} overall ({torch.__version__})", flush=True)
        clean = teardown(backend, rank, clean_exit=finished)
    return 0 if all_ok and clean else 1


if __name__ == "__main__":
    sys.exit(main())
