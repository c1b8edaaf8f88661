"""Run Python from the repository root as a user would, for the tests of entry points and imports."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(*args, pythonpath=True, timeout=240, extra_paths=()):
    """Run ``python *args`` from the repository root, as a user would (``PYTHONPATH`` = the root, or unset).

    ``extra_paths`` go on ``PYTHONPATH`` after the root (where an optional package lies outside site-packages).
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    paths = ([str(ROOT)] if pythonpath else []) + [str(p) for p in extra_paths]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
