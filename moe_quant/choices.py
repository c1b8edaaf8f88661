"""One home for the string-valued options (scale mode, GEMM backend, EP wire format) and their parsing."""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A string option: a member, or its value in any letter case. Anything else is a ``ValueError`` that
    names the argument (``argname``, default the subclass's ``__argname__``) and lists the choices."""

    @classmethod
    def parse(cls, value, argname: str | None = None):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"{argname or cls.__argname__} must be one of {[m.value for m in cls]}, got {value!r}")
