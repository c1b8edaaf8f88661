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


DOCS = ["README.md", "CONTRIBUTING.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


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


SOURCES = ["moe_quant", "benchmarks", "scripts", "examples", "tests", "docs"]


def _texts():
    for top in ["README.md", "CONTRIBUTING.md", *SOURCES]:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for ext in ("*.py", "*.md", "*.sh") for p in path.rglob(ext))
        for f in files:
            yield f.relative_to(ROOT).as_posix(), f.read_text()


def test_the_design_doc_is_named_by_its_path():
    old_name = "DESIGN" + ".md"  # spelled so that this file does not name it
    assert (ROOT / "docs" / "design.md").is_file() and not (ROOT / old_name).exists()
    offenders = [name for name, text in _texts() if re.search(r"(?<![/\w])" + re.escape(old_name), text)]
    assert not offenders, f"these name the design doc by a path that does not exist (it is docs/design.md): {offenders}"


def test_files_named_in_the_docs_exist():
    pattern = re.compile(r"\b((?:tests|scripts|examples|benchmarks|moe_quant|docs)/[\w/]+\.(?:py|sh|md|png))")
    missing = set()
    for doc in DOCS:
        for rel in pattern.findall((ROOT / doc).read_text()):
            if not (ROOT / rel).exists():
                missing.add(f"{doc}: {rel}")
    assert not missing, sorted(missing)


def test_every_declared_pytest_marker_is_used():
    import tomllib

    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    unused = [m.split(":")[0] for m in markers if f"mark.{m.split(':')[0]}" not in tests and
              f'"{m.split(":")[0]}" in item.keywords' not in tests]
    assert not unused, f"markers declared in pyproject.toml but used by no test: {unused}"


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    assert f"\n## {title}" in text, f"README has no section {title!r}"
    return text.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_quick_start_installs_from_pypi_alone():
    block = _fenced(_section("Quick start"), "bash")[0]
    first = next(line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    assert 'pip install -e ".[test,demo]"' in first, first
    for other_index in ("--index-url", "--extra-index-url", "download.pytorch.org", "-f ", "--find-links"):
        assert other_index not in first, f"the first command needs more than PyPI ({other_index}): {first}"


def test_readme_use_snippet_converts_the_experts_by_class():
    from moe_quant.conversion import is_converted

    code = _fenced(_section("Use"), "python")[0]
    assert "isinstance(mod, GroupedExperts)" in code and '"experts" in fqn' not in code
    namespace = {}
    exec(compile(code, "README.md (Use)", "exec"), namespace)
    converted = [n for n, m in namespace["model"].named_modules() if is_converted(m)]
    assert converted == ["experts"]


def test_installed_torch_is_in_the_declared_range():
    import tomllib

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    version = Version(torch.__version__.split("+")[0])
    assert req.specifier.contains(version), f"torch {version} is outside pyproject.toml's {req}"


def test_traced_check_messages_bind_no_closure():
    """``torch._check(cond, lambda: msg)`` under ``torch.compile``: dynamo in torch 2.11 (the GPU machine's)
    raises "Can't extract message from torch._check()" when the message lambda reads a closure variable
    (seen in the compiled EP block on the H100); a message bound as a default argument or a literal traces."""
    import re
    from pathlib import Path

    bad = []
    for path in sorted((Path(__file__).resolve().parents[1] / "moe_quant").rglob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"torch\._check\w*\(.*lambda\s*:\s*(.+)\)", line)
            if m and not re.match(r"""['"]""", m.group(1).strip()):
                bad.append(f"{path.name}:{no}: {line.strip()}")
    assert not bad, "message lambdas reading a closure:\n" + "\n".join(bad)
