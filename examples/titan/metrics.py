"""torchtitan's ``MetricsProcessor`` that also writes every logged step to ``<dump_folder>/<jsonl_folder>/rank<r>.jsonl``.

One JSON object per logged step, on every rank: ``step`` and the dict torchtitan's processor logs (global
average loss as the exact float, grad norm, this rank's tokens/s ``throughput(tps)``, the step's wall time
``time_metrics/end_to_end(s)``, this rank's peak memory since the last log ``memory/max_active(GiB)`` /
``memory/max_reserved(GiB)``, ...). Each line is flushed as it is written: a killed job keeps the steps it
finished. torchtitan's own loggers (console, TensorBoard, W&B) work as before.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor


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


def read_jsonl(path: str) -> list[dict]:
    """The rows of one rank's file; a later row of the same step (a resumed job) replaces the earlier."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


__all__ = ["JsonlLogger", "JsonlMetricsProcessor", "read_jsonl"]
