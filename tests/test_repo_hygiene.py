"""Quiet test output, and documentation that stands on its own."""

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


DOCS = ["README.md", "CONTRIBUTING.md", "docs/design.md"]


def test_docs_exist_and_reference_nothing_outside_the_repository():
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for banned in ("../shared", "shared folder", ".gpu/", "/work/"):
            assert banned not in text, f"{doc} mentions {banned!r}"
    readme = (ROOT / "README.md").read_text()
    assert "docs/design.md" in readme and "CONTRIBUTING.md" in readme


def test_ci_runs_the_readme_test_command():
    command = "HYPOTHESIS_PROFILE=ci python -m pytest -q"
    assert command in (ROOT / "README.md").read_text()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-1] == command
