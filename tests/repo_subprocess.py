"""Run Python from the repository root as a user would, for the tests of entry points and imports."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(*args, pythonpath=True, timeout=240):
    """Run ``python *args`` from the repository root, as a user would (``PYTHONPATH`` = the root, or unset)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
