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
            # the value table Enum keeps (``cls(text)`` looks it up too, through EnumMeta.__call__: a few µs of
            # host time per call, and every quantize call parses its mode)
            member = cls._value2member_map_.get(value.lower())
            if member is not None:
                return member
        raise ValueError(f"{argname or cls.__argname__} must be one of {[m.value for m in cls]}, got {value!r}")
