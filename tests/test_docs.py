"""The README's commands and the guides' code blocks keep working (README.md, docs/*.md).

The conventions (CONTRIBUTING.md, "Code blocks in the documentation"):

* A ``python`` block runs on the CPU, in a fresh namespace, in this process.
* In a ``bash`` block every command that runs this repository's code (``python -m M``, ``python path.py``,
  ``torchrun ... path.py``) has its arguments parsed by the command's own ``argparse`` parser, and stops
  there; any other command's repository paths must exist.
* ``<!-- doc-test: run -->`` on the line before a ``bash`` block: its commands also run (CPU, exit status 0).
* ``<!-- doc-test: torchrun -->`` before a ``python`` block: a script for ``torchrun`` (it calls
  ``dist.init_process_group()``); it runs in this process as rank 0 of a world of 1, with the environment
  variables torchrun sets, and must leave no process group behind.
* ``<!-- doc-test: gpu -->`` (needs a CUDA GPU), ``long`` (too long or too big for CI: a download, the demo's
  full run) and ``fragment`` (uses names the text around it defines) before a block: nothing runs; a python
  block is still compiled and the names it imports must exist, a bash block's arguments are still parsed.
* Links to files of the repository resolve, ``#anchors`` to a heading of the file they name (in the pages above, in
  ``docs/lab/*.md``, CONTRIBUTING.md and ``scripts/probes/README.md``).
* Every number, device and date in a row of the README's results table appears in a section the row links.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
# docs/lab/: the dated measurement sessions, for developers. Their links must resolve; their code blocks are records
# of what was run then (the commands of today are in the pages above), so they are not run or parsed.
LAB = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "lab").glob("*.md"))
MARKERS = {"run", "gpu", "long", "fragment", "torchrun"}
OURS = ("moe_quant", "benchmarks", "examples", "scripts")
RUN_TIMEOUT_S = 120


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str) -> list[Block]:
    """The fenced code blocks of a markdown page, with the doc-test marker of the line before each."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{start + 1}: code block without a closing fence")
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = re.match(r"^<!--\s*doc-test:\s*(\S+)\s*-->$", before.strip())
        if mark and mark.group(1) not in MARKERS:
            raise ValueError(f"{page}:{start}: unknown doc-test marker {mark.group(1)!r}; known: {sorted(MARKERS)}")
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", mark and mark.group(1)))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks((ROOT / page).read_text(), page)]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


# ----------------------------------------------------------------------------- python blocks

PYTHON = [b for b in all_blocks() if b.lang == "python"]


def imported_names(code: str):
    """``(module, name or None)`` for every import of ``code``."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield from ((node.module, a.name) for a in node.names)


def unusable(module: str) -> str | None:
    """Why a third-party ``module`` cannot be imported here (not installed, or it fails to import, as
    torchtitan 0.3.0 does under torch 2.11), else None. This repository's own modules must import."""
    if module.split(".")[0] in OURS:
        return None
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "not installed"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def has_name(module: str, name: str | None) -> bool:
    """``import module`` works and, for ``from module import name``, gives ``name`` (an attribute or a
    submodule)."""
    mod = importlib.import_module(module)
    if name is None or hasattr(mod, name):
        return True
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except ModuleNotFoundError:  # module is not a package
        return False


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block(block, monkeypatch):
    code = compile(block.code, block.id, "exec")
    missing = {m: unusable(m) for m, _ in imported_names(block.code)}
    missing = {m: why for m, why in missing.items() if why}
    for module, name in imported_names(block.code):
        if module not in missing:
            assert has_name(module, name), f"{block.id}: {module} has no {name}"
    if block.marker not in (None, "torchrun"):
        return
    if missing:
        pytest.skip(f"{block.id} imports what cannot be imported here: {missing}")
    monkeypatch.chdir(ROOT)
    if block.marker == "torchrun":
        run_as_torchrun_rank(code, monkeypatch)
    else:
        exec(code, {"__name__": "__doc_block__"})


def run_as_torchrun_rank(code, monkeypatch) -> None:
    """``code`` as rank 0 of ``torchrun --nproc_per_node 1``: the env:// variables set, no process group before."""
    import socket

    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group is left from an earlier test"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    try:
        exec(code, {"__name__": "__main__"})
    finally:
        left = dist.is_initialized()
        if left:
            dist.destroy_process_group()
    assert not left, "the block leaves its process group initialized: end it with dist.destroy_process_group()"


AFTER_README = """
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from moe_quant.conversion.hf import experts_forward
assert model.config._experts_implementation == "moe_quant_mxfp8"
assert ALL_EXPERTS_FUNCTIONS["moe_quant_mxfp8"] is experts_forward
ids = torch.randint(0, 128, (2, 16))
model(input_ids=ids, labels=ids).loss.backward()
assert not moe_quant.fallback_counts(), moe_quant.fallback_counts()
print("ok")
"""


def test_readme_transformers_block_runs_in_a_fresh_process():
    """The README's transformers block as a user runs it -- ``import moe_quant`` first, transformers after, in a fresh
    interpreter (issue 56: the implementation was registered only where transformers had been imported before
    moe_quant) -- then a training step on the model it built."""
    from repo_subprocess import run_python

    pytest.importorskip("transformers")
    (block,) = [b for b in PYTHON if b.page == "README.md" and 'experts_implementation="moe_quant_mxfp8"' in b.code]
    assert block.code.lstrip().startswith("import moe_quant"), block.code  # the order under test
    assert "register_experts_implementation" not in block.code  # the import alone registers
    proc = run_python("-c", block.code + AFTER_README)  # a fresh interpreter: nothing imported before the block
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ----------------------------------------------------------------------------- shell commands

BASH = [b for b in all_blocks() if b.lang in ("bash", "sh", "shell")]


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: continuation lines joined, comments dropped, ``&&``
    chains split, leading ``VAR=value`` assignments left out."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            cmd, words = words[:cut], words[cut + 1:]
            while cmd and re.match(r"^\w+=", cmd[0]):
                cmd = cmd[1:]
            if cmd:
                out.append(cmd)
    return out


def our_target(cmd: list[str]):
    """``("module", name, args)`` or ``("path", path, args)`` where ``cmd`` runs this repository's code, else
    None."""
    if cmd[0] in ("python", "python3") and len(cmd) > 1:
        if cmd[1] == "-m" and cmd[2].split(".")[0] in OURS:
            return "module", cmd[2], cmd[3:]
        if cmd[1].endswith(".py"):
            return "path", cmd[1], cmd[2:]
    if cmd[0] == "torchrun":
        for i, word in enumerate(cmd[1:], 1):
            if word.endswith(".py"):
                return "path", word, cmd[i + 1:]
            if word == "-m":
                return "module", cmd[i + 1], cmd[i + 2:]
    return None


class _Parsed(Exception):
    pass


# torchtitan's command line (``--module`` / ``--config`` and tyro, no argparse): parsed by torchtitan's ConfigManager
TITAN_TRAIN = ("torchtitan.train", "examples.titan.launch")


def parse_titan(args: list[str], monkeypatch) -> None:
    """Parse a ``torchtitan.train`` command line as the trainer does (its ConfigManager loads ``--config`` from
    ``--module`` and tyro parses the rest; SystemExit on an argument it rejects), after the stand-ins the
    launcher puts in place where this torch lacks a name torchtitan 0.3.0 uses (undone after the test)."""
    from examples.titan import launch

    for applied in launch.provide_missing_torch_names():  # dotted names, e.g. "torch.distributed.set_timeout"
        module_name, _, name = applied.rpartition(".")
        module = importlib.import_module(module_name)
        value = getattr(module, name)
        delattr(module, name)
        monkeypatch.setattr(module, name, value, raising=False)  # undone: deleted again
    try:
        from torchtitan.config import ConfigManager
    except ImportError as e:
        pytest.skip(f"torchtitan not importable here: {e}")
    try:
        ConfigManager().parse_args(list(args))
    except SystemExit as exit:
        raise AssertionError(f"torchtitan.train {' '.join(args)}: exit status {exit.code} while parsing") from None


def parse_only(kind: str, target: str, args: list[str]) -> None:
    """Run ``target`` as ``__main__`` with ``args`` until its parser has parsed them (SystemExit 2 on an
    argument it rejects), then stop: nothing past the parser runs."""
    source = (ROOT / target).read_text() if kind == "path" else Path(importlib.util.find_spec(target).origin).read_text()
    # argparse in the module, or through examples.titan.runs.parser (the titan scripts' shared arguments)
    assert "argparse" in source or "runs.parser(" in source, \
        f"{target} parses no arguments; the doc test cannot stop it before it runs"
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [target, *args]
    try:
        with _patched(argparse.ArgumentParser, "parse_args", parse_and_stop), warnings.catch_warnings():
            # run_module of a module another test imported already: runpy warns that it runs a second copy
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
            try:
                if kind == "path":
                    runpy.run_path(str(ROOT / target), run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=False)
            except _Parsed:
                return
            except SystemExit as exit:
                raise AssertionError(f"{target} {' '.join(args)}: exit status {exit.code} while parsing") from None
        raise AssertionError(f"{target} returned without parsing its arguments")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def repo_paths(cmd: list[str]) -> list[str]:
    """The arguments of ``cmd`` that name files of this repository (``tests/x.py::test`` -> ``tests/x.py``)."""
    out = []
    for word in cmd[1:]:
        path = word.split("::")[0]
        if "/" in path and path.split("/")[0] in (*OURS, "tests", "docs", ".ci"):
            out.append(path)
    return out


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_shell_block(block, monkeypatch, capsys, request):
    monkeypatch.chdir(ROOT)
    cmds = commands(block.code)
    assert cmds, f"{block.id}: no command"
    for cmd in cmds:
        target = our_target(cmd)
        if target is None:
            missing = [p for p in repo_paths(cmd) if not (ROOT / p).exists()]
            assert not missing, f"{block.id}: {' '.join(cmd)} names {missing}, which do not exist"
            continue
        kind, name, args = target
        if kind == "path":
            assert (ROOT / name).is_file(), f"{block.id}: {name} does not exist"
        else:
            assert importlib.util.find_spec(name), f"{block.id}: no module {name}"
        if name in TITAN_TRAIN:
            parse_titan(args, monkeypatch)
            continue
        parse_only(kind, name, args)
    capsys.readouterr()  # a parser's own output (none expected) stays out of the report
    if block.marker != "run":
        return
    for cmd in cmds:
        if cmd[0] == "torchrun":
            request.getfixturevalue("warm_torchrun")  # its ranks warm: conftest
        argv = executable(cmd)
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, f"{block.id}: {' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}"


def executable(cmd: list[str]) -> list[str]:
    """``cmd`` with ``python`` and ``torchrun`` as this interpreter's."""
    if cmd[0] in ("python", "python3"):
        return [sys.executable, *cmd[1:]]
    if cmd[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
    return cmd


# ----------------------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Anchor -> the text of its section (its heading to the next heading of the same or a higher level)."""
    lines, heads, seen = prose(text).splitlines(), [], {}
    for i, line in enumerate(lines):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            heads.append((i, len(m.group(1)), base if n == 0 else f"{base}-{n}"))
    out = {}
    for k, (i, level, anchor) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out[anchor] = "\n".join(lines[i:end])
    return out


def anchors(path: Path) -> set[str]:
    return set(sections(path.read_text()))


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_links_to_repository_files_resolve():
    assert LAB, "docs/lab/ holds no page"
    broken = []
    for page in [*PAGES, *LAB, "CONTRIBUTING.md", "scripts/probes/README.md"]:
        path = ROOT / page
        for target in LINK.findall(prose(path.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def linked_text(target: str) -> str:
    """The text a link of the README points at: the section of its anchor, else the whole file."""
    file, _, anchor = target.partition("#")
    text = (ROOT / file).read_text()
    return sections(text)[anchor] if anchor else text


def test_results_table_quotes_the_pages_it_links():
    """The README's headline numbers are quotes: each number, device and date of a row is in the section (or
the page) a link of the row points at."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("|") and not re.match(r"^\|[-| ]+\|$", r)][1:]
    assert len(rows) >= 5, rows
    problems = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        measured, device_date, details = cells[1], cells[2], cells[3]
        pages = [linked_text(t) for t in LINK.findall(details)]
        assert pages, f"a results row links nothing: {row}"
        quoted = re.findall(r"\d+(?:\.\d+)?", measured) + re.findall(r"H\d00|\d{4}-\d\d-\d\d", device_date)
        for q in quoted:
            if not any(re.search(rf"(?<![\d.]){re.escape(q)}(?![\d])", p) for p in pages):
                problems.append(f"{q!r} of row {cells[0]!r} is in none of its linked pages")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the reader itself

def test_reader_finds_blocks_markers_and_commands():
    text = "a\n<!-- doc-test: gpu -->\n```python\nx = 1\n```\n\n```bash\nA=1 python -m m --k 2 \\\n  --j && pip x\n```\n"
    got = blocks(text, "p.md")
    assert [(b.lang, b.marker, b.line) for b in got] == [("python", "gpu", 3), ("bash", None, 7)]
    assert commands(got[1].code) == [["python", "-m", "m", "--k", "2", "--j"], ["pip", "x"]]
    with pytest.raises(ValueError, match="unknown doc-test marker"):
        blocks("<!-- doc-test: cpu -->\n```python\n```\n", "p.md")
    assert slug("torchtitan's graph passes") == "torchtitans-graph-passes"
    assert slug("Convert with `quantize_`") == "convert-with-quantize_"
    assert slug("Is a GEMM that reads MXFP8 worth building on Hopper?") == "is-a-gemm-that-reads-mxfp8-worth-building-on-hopper"
