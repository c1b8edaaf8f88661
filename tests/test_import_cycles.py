"""Every import arrow inside moe_quant and benchmarks runs one way: no module imports, at any depth (a function's
lazy import counts), a module that imports it back. Kernels sit below what uses them, clients (``ep/titan``,
``conversion/hf``) above what they adapt.

The graph is read from the sources (``ast``), not by importing: an arrow goes from a module to each module it
names in an ``import`` or ``from ... import`` (``from pkg import name`` to ``pkg.name`` where that is a module,
else to ``pkg``). A package's ``__init__`` runs before its submodules, but that implicit arrow is not counted:
``moe_quant/__init__.py`` gathers the public API from everything below it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_quant", "benchmarks")


def _modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for top in packages:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """Module name -> the modules of ``packages`` it imports (see the module doc)."""
    modules = _modules(root, packages)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        arrows = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                arrows |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    if target in modules:
                        arrows.add(target)
        arrows.discard(name)
        graph[name] = arrows
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(out)


def test_cycles_finds_a_circle_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_relative_lazy_and_module_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import VALUE\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import g\n")
    (pkg / "top.py").write_text("from .sub import leaf\nimport pkg\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf", "pkg"}}
    assert cycles(graph) == [["pkg.sub.leaf", "pkg.top"]]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["moe_quant.quantize"], "the graph was not read"
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)
