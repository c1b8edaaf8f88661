"""Command-line argument checks shared by the demo, the benchmarks and the scripts.

The ``argparse`` ``type=`` validators below reject a bad value while the command line is parsed
(``usage`` + one error line, exit status 2), before any work. :func:`device_problem` says why a
``--device`` cannot run here; callers end with that one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os

import torch

NO_CUDA_STATUS = 2  # exit status of a command that needs a GPU it does not have


def no_cuda_message() -> str:
    return f"needs a CUDA GPU, and torch {torch.__version__} sees none (no GPU, or a CPU-only build)"


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


MAX_COUNT = 2**31 - 1  # counts become int32 token offsets and tensor sizes


def positive_int(text: str) -> int:
    """``type=`` for a count that must be at least 1 (and at most :data:`MAX_COUNT`)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT} (2**31 - 1), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """``type=`` for a finite number greater than 0 (a bandwidth, a size in GiB)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """``type=`` for a comma list of positive integers, e.g. ``8192,32768`` (at least one)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    try:
        return [positive_int(item) for item in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None


def comma_choices(*choices: str):
    """``type=`` for a comma list drawn from ``choices`` (at least one), e.g. ``comma_choices("bf16", "mxfp8")``."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {', '.join(choices)}, got {text!r}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else "")
            )
        return items

    parse.__name__ = "comma list"  # argparse names the type in its error messages
    return parse


def writable_file(text: str) -> str:
    """``type=`` for an output file (``--json``): not a directory, in an existing writable directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got an empty string")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {os.path.dirname(text)!r} of {text!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def device_problem(device: str) -> str | None:
    """Why ``device`` (a ``--device`` string) cannot run here, in one line; ``None`` if it can.

    Runnable: ``cpu``, and ``cuda`` / ``cuda:N`` where PyTorch sees that GPU. Anything else (``meta``,
    other device types, text that is no device) is rejected before any work."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"--device {device!r} is not a device; use cpu, cuda or cuda:N"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"--device {device!r}: runs on cpu or cuda[:N], not on {dev.type!r}"
    if not torch.cuda.is_available():
        return f"--device {device}: {no_cuda_message()}"
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return f"--device {device}: torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None


def exit_unless_device_runs(parser: argparse.ArgumentParser, device: str) -> torch.device:
    """``torch.device(device)``, or one line (``prog: reason``) on stderr and exit status 2."""
    problem = device_problem(device)
    if problem is not None:
        parser.exit(NO_CUDA_STATUS, f"{parser.prog}: {problem}\n")
    return torch.device(device)
