"""torchtitan's ``MetricsProcessor`` that also writes every logged step to ``<dump_folder>/metrics/rank<r>.jsonl``
(``jsonl_folder``, default ``metrics``).

One JSON object per logged step, on every rank: ``step`` and the dict torchtitan's processor logs (global
average loss as the exact float, grad norm, this rank's tokens/s ``throughput(tps)``, the step's wall time
``time_metrics/end_to_end(s)``, this rank's peak memory since the last log ``memory/max_active(GiB)`` /
``memory/max_reserved(GiB)``, ...). Each line is flushed as it is written: a killed job keeps the steps it
finished. torchtitan's own loggers (console, TensorBoard, W&B) work as before. Metrics added per step:
``moe_quant/fallbacks`` (expert GEMMs MXFP8 could not serve so far, :func:`moe_quant.fallback_counts`) and
``moe_quant/dropped_rows`` (sync-free dispatchers: token copies past capacity so far, read at the log's host
sync; with ``overflow="error"`` those steps' losses are NaN and torchtitan stops); on CUDA a third,
``moe_quant/outside_allocator(GiB)``: the device memory in use that torch's allocator does not hold (its
``max_reserved`` plus this is what the rank needs of the GPU). With ``--moe_quant.wire_gbps``, the EP exchanges
held on the emulated wire so far and their bytes to the other ranks: ``moe_quant/wire_exchanges``,
``moe_quant/wire_bytes`` (:data:`benchmarks.slow_wire.LEDGER`).

Fault injection (:mod:`examples.titan.checks`): with ``MOE_QUANT_TITAN_KILL="<rank>:<step>"`` in the environment,
that rank kills itself (``SIGKILL``: no clean-up, as a crashed host) right after logging that step, in the
job's first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0 or unset).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor
from torchtitan.models.common.moe import RoutedExperts

from moe_quant import fallback_counts


class JsonlLogger(BaseLogger):
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # a resumed job appends to the interrupted one's lines

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step}
        for key, value in metrics.items():
            value = float(value) if hasattr(value, "__float__") and not isinstance(value, (int, float)) else value
            row[key] = repr(value) if isinstance(value, float) and not math.isfinite(value) else value
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class JsonlMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_folder: str = "metrics"
        """Folder of the per-rank JSONL files, relative to the dump folder."""

    def __init__(self, config: Config, *, parallel_dims, dump_folder: str = "./outputs", **kwargs):
        MetricsProcessor.__init__(self, config, parallel_dims=parallel_dims, dump_folder=dump_folder, **kwargs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        container = LoggerContainer()
        container.add_logger(self.logger)
        container.add_logger(JsonlLogger(os.path.join(dump_folder, config.jsonl_folder, f"rank{rank}.jsonl")))
        self.logger = container

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        extra.update(moe_quant_metrics(self.model_parts or []))
        MetricsProcessor.log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        _maybe_kill(step)


def _maybe_kill(step: int) -> None:
    target = os.environ.get("MOE_QUANT_TITAN_KILL")
    if not target or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, at = (int(x) for x in target.split(":"))
    if step == at and (dist.get_rank() if dist.is_initialized() else 0) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def moe_quant_metrics(model_parts) -> dict:
    dropped = [d.dropped_rows for m in model_parts for r in m.modules() if isinstance(r, RoutedExperts)
               for d in (r.token_dispatcher,) if getattr(d, "dropped_rows", None) is not None]
    out = {"moe_quant/fallbacks": sum(fallback_counts().values()),
           "moe_quant/dropped_rows": int(sum(int(t) for t in dropped))}
    outside = outside_allocator_gib()
    if outside is not None:
        out["moe_quant/outside_allocator(GiB)"] = outside
    wire = sys.modules.get("benchmarks.slow_wire")  # --moe_quant.wire_gbps: the held exchanges so far
    if wire is not None and wire.HeldExchanges.active is not None:
        out["moe_quant/wire_exchanges"] = wire.LEDGER["exchanges"]
        out["moe_quant/wire_bytes"] = wire.LEDGER["bytes"]
    return out


def outside_allocator_gib() -> float | None:
    """GiB in use on this rank's device that torch's caching allocator does not hold (the CUDA context, NCCL's
    buffers, other processes): the device's used memory less the allocator's reserved bytes. None without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


__all__ = ["JsonlLogger", "JsonlMetricsProcessor", "moe_quant_metrics", "outside_allocator_gib"]
