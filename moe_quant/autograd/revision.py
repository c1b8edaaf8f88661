"""The revision of a compiled path's custom ops: a hash of the sources that define them and their backward.

A custom op's forward takes it as an argument that nothing reads. torch's compile caches (AOTAutograd's, on by
default with inductor) key a graph by its code, in which an op appears by name, not by what its registered backward
does (which ops, which forms between them), so a graph cached by another version of those modules would run that
version's backward ops (or ops that no longer exist); with the hash in the code, any change to them is a new key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_revision(*names: str) -> int:
    """A 56-bit hash of the modules ``names`` of this package (file names, e.g. ``"grouped_mm.py"``)."""
    h = hashlib.sha256()
    for name in names:
        h.update((Path(__file__).parent / name).read_bytes())
    return int.from_bytes(h.digest()[:7], "little")


__all__ = ["source_revision"]
