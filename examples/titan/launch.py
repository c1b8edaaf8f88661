"""``python -m examples.titan.launch <torchtitan.train's arguments>``: torchtitan's own ``torchtitan.train.main()``,
after what a released torch, or a machine without GPU, lacks of what torchtitan 0.3.0 (written against
PyTorch nightly) uses. Where torch has all of it on CUDA, this is exactly ``python -m torchtitan.train``::

    torchrun --nproc_per_node 2 -m examples.titan.launch --module examples.titan.config_registry \\
        --config deepseek_v3_16b_mxfp8 --compile.enable

* torch < 2.12 lacks ``torch.distributed.fsdp.DataParallelMeshDims``, which torchtitan 0.3.0 imports at module
  level (its FSDP uses it only with ``spmd_backend`` ``"full_dtensor"`` / ``"spmd_types"``; the configs here use
  ``"partial_dtensor"``, which never makes one): a placeholder stands under that name and raises if made.
* ``torch.distributed.set_timeout`` (added to PyTorch in June 2026, pytorch/pytorch#187387; in no release up to
  2.13), which torchtitan's trainer calls after the first step to shorten the process groups' timeouts:
  torch's own ``torch.distributed.distributed_c10d._set_pg_timeout`` (what torchtitan called before) stands
  under that name.
* ``torch.compiler._is_non_strict_tracing`` (not in torch 2.11), which torchtitan's all-to-all token dispatcher
  calls to ask whether ``torch.export`` traces it: a function returning False (nothing here exports).
* No accelerator (the CPU tests): torchtitan picks its device type once, at import, as ``"cuda"`` wherever no
  accelerator is present, and builds its meshes, process group backend and memory monitor with it. Here it is
  set to ``"cpu"`` (process groups: gloo) with a CPU device module (no memory statistics: torchtitan logs -1).
"""

from __future__ import annotations

import os
import sys
import types

import torch

STUBBED_NAME = "torch.distributed.fsdp.DataParallelMeshDims"
SHIMS_ENV = "MOE_QUANT_TITAN_SHIMS"  # what main() put in place in this process, comma separated (for the setup file)


def stub_missing_fsdp_names() -> list[str]:
    """Give ``torch.distributed.fsdp`` the names torchtitan 0.3.0 imports but this torch lacks (only
    ``DataParallelMeshDims``, added after torch 2.11). Returns the names it stubbed."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return []

    class DataParallelMeshDims:
        """Placeholder for torch versions without it; any use is an error."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{STUBBED_NAME} is a placeholder here (torch {torch.__version__} lacks it): use "
                               "parallelism.spmd_backend='partial_dtensor', or torch >= 2.12")

    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return [STUBBED_NAME]


def torchtitan_imports_alone() -> bool:
    """Whether torchtitan 0.3.0 imports on this torch without :func:`stub_missing_fsdp_names` (torch >= 2.12 has
    the real name; not this module's placeholder)."""
    import torch.distributed.fsdp as fsdp

    return getattr(getattr(fsdp, "DataParallelMeshDims", None), "__module__", __name__) != __name__


def provide_set_timeout() -> list[str]:
    """``torch.distributed.set_timeout`` where torch lacks it: torch's ``_set_pg_timeout``. Returns the names it set."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if hasattr(dist, "set_timeout"):
        return []
    dist.set_timeout = c10d._set_pg_timeout
    return ["torch.distributed.set_timeout"]


def provide_is_non_strict_tracing() -> list[str]:
    """``torch.compiler._is_non_strict_tracing`` where torch lacks it: always False. Returns the names it set."""
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        return []
    torch.compiler._is_non_strict_tracing = lambda: False
    return ["torch.compiler._is_non_strict_tracing"]


def provide_missing_torch_names() -> list[str]:
    """Every stand-in above that this torch needs (the torch-level ones; not the CPU device): what a process that
    imports torchtitan 0.3.0 on a released torch runs first. Returns the names it put in place."""
    return stub_missing_fsdp_names() + provide_set_timeout() + provide_is_non_strict_tracing()


def _cpu_device_module() -> types.SimpleNamespace:
    """``torch.cpu`` with the CUDA-module functions torchtitan calls (device 0, no memory statistics)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=lambda device: None,
        synchronize=torch.cpu.synchronize, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total),
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None)


def use_cpu_device() -> None:
    """Make torchtitan use the CPU (gloo process groups): its device type and device module, in
    ``torchtitan.tools.utils`` and in every torchtitan module that copied them at import."""
    import torchtitan.tools.utils as utils

    old = (utils.device_type, utils.device_module)
    module = _cpu_device_module()
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and mod is not None:
            if getattr(mod, "device_module", None) is old[1]:
                mod.device_module = module
            if isinstance(getattr(mod, "device_type", None), str) and mod.device_type == old[0]:
                mod.device_type = "cpu"
    utils.device_type, utils.device_module = "cpu", module


def has_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def main() -> None:
    applied = provide_missing_torch_names()
    if not has_accelerator():
        use_cpu_device()
        applied.append("cpu device")
    os.environ[SHIMS_ENV] = ",".join(applied)
    import torchtitan.train

    torchtitan.train.main()


if __name__ == "__main__":
    main()
