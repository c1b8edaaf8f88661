"""The torchao names moe_quant uses, imported without torchao's import-time noise.

Importing torchao 0.18 on a machine where its optional C++/CUDA extensions cannot load (any
CPU-only PyTorch, or a Python version the bundled ``.so`` files were not built for) logs
``Failed to load .../torchao/_C_*.so`` once per extension, and on torch 2.13 torchao's
``register_constant`` call on an Enum logs a deprecation warning from
``torch.utils._pytree`` (and, where the root logger has a handler, torchao notes that
Triton is missing). None of it concerns moe_quant, which needs only torchao's
``quantize_`` registry (the extensions are torchao's own kernels), so while torchao is
first imported those messages are held back and re-logged at DEBUG level on the
``moe_quant`` logger, where logging configured at DEBUG level shows them.
Nothing else is filtered, and the filters are removed again after the import.
"""

from __future__ import annotations

import contextlib
import logging
import sys

_log = logging.getLogger("moe_quant")

# (logger name, text the message contains): the only records held back.
_IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass"),
    ("torchao.kernel.intmm", "Detected no triton"),  # shown only where the root logger has a handler
)


class _HoldBack(logging.Filter):
    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if self.needle in msg:
            self.held.append(f"{record.name}: {msg}")
            return False
        return True


@contextlib.contextmanager
def _quiet_import():
    filters = []
    for name, needle in _IMPORT_NOISE:
        f = _HoldBack(needle)
        logging.getLogger(name).addFilter(f)
        filters.append((name, f))
    try:
        yield
    finally:
        for name, f in filters:
            logging.getLogger(name).removeFilter(f)
            for msg in f.held:
                _log.debug("held back while importing torchao: %s", msg)


if "torchao" in sys.modules:  # already imported by the user: nothing left to quiet
    _ctx = contextlib.nullcontext()
else:
    _ctx = _quiet_import()
with _ctx:
    import torchao  # noqa: F401
    from torchao.core.config import AOBaseConfig
    from torchao.quantization import quant_api as _quant_api
    from torchao.quantization import quantize_
    from torchao.quantization.transform_module import register_quantize_module_handler


def default_filter_match(frame) -> str | None:
    """If ``frame`` is ``quantize_``'s call of a config handler on a module that torchao's default filter matched
    (``filter_fn`` omitted or None: every ``nn.Linear``), that module's fqn ("" for the model); else None.

    ``quantize_`` hands the handler the module and the config, not the filter: the filter is a local of the frame
    that calls the handler (torchao 0.18's ``_replace_with_custom_fn_if_matches_filter``)."""
    if frame is None or frame.f_code is not _quant_api._replace_with_custom_fn_if_matches_filter.__code__:
        return None
    local = frame.f_locals
    if local.get("filter_fn") is not _quant_api._is_linear:
        return None
    return local.get("cur_fqn", "")[:-1]


__all__ = ["AOBaseConfig", "default_filter_match", "quantize_", "register_quantize_module_handler"]
