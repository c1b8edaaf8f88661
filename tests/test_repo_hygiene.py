"""Quiet test output."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tests_do_not_bypass_output_capture():
    """Progress dots only: a test reports through assertions, logging or -v, not around pytest's capture."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        if re.search(r"\b(capsys|capfd)\.disabled\(|sys\.__std(out|err)__", text):
            offenders.append(path.name)
    assert not offenders, offenders

