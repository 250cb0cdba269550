"""The import graph of the repository's modules, and the rules it keeps.

    python scripts/import_graph.py

Modules are the root's scripts (train, sample, prepare, eval, export, bench, speedrun, ...), `model`, the package's
modules (quillgpt.config, ...) and the benchmarks' (benchmarks.common, ...). Every import of one of them counts, also one inside a function (a lazy import hides a
cycle from Python, not from this). Prints each module with what it imports, in layers (a module imports only from
layers below its own), then checks the rules, which tests/test_layout.py checks too:
- no import cycle;
- no module imports an entry script (a root module other than `model`): the scripts are built from the package and
  never from each other;
- the package imports nothing from the root but `model`, and nothing from the benchmarks: what a user's program
  imports (`quillgpt`) never pulls in a measurement.
Exits 1 when a rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "quillgpt"
BENCHMARKS = "benchmarks"
MODEL = "model"


def module_files(root: Path = REPO_ROOT) -> dict[str, Path]:
    """Module name (train, model, quillgpt.trainer, ...) -> its file."""
    files = {p.stem: p for p in root.glob("*.py")}
    for package in (PACKAGE, BENCHMARKS):
        files[package] = root / package / "__init__.py"
        files |= {f"{package}.{p.stem}": p for p in (root / package).glob("*.py") if p.stem != "__init__"}
        for sub in (root / package).glob("*/__init__.py"):
            files[f"{package}.{sub.parent.name}"] = sub
            files |= {
                f"{package}.{sub.parent.name}.{p.stem}": p for p in sub.parent.glob("*.py") if p.stem != "__init__"
            }
    return files


def imported_names(tree: ast.AST) -> set[str]:
    """Every dotted name an import statement could bind a module to: `from a.b import c` gives a.b and a.b.c."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """module name -> the names of the repository's modules it imports."""
    files = module_files(root)
    graph = {}
    for name, path in files.items():
        imported = imported_names(ast.parse(path.read_text(encoding="utf-8")))
        graph[name] = {m for m in imported if m in files and m != name}
    return graph


def entry_scripts(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if "." not in m and m not in (MODEL, PACKAGE, BENCHMARKS)}


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Modules grouped so that each imports only from earlier groups; what is left in a cycle is the last group."""
    placed: set[str] = set()
    out = []
    while len(placed) < len(graph):
        ready = sorted(m for m, deps in graph.items() if m not in placed and deps <= placed)
        if not ready:
            out.append(sorted(set(graph) - placed))
            break
        out.append(ready)
        placed |= set(ready)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m, [m])):
            return cycle
    return None


def script_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every module a that imports an entry script b."""
    scripts = entry_scripts(graph)
    return [f"{m} -> {dep}" for m, deps in sorted(graph.items()) for dep in sorted(deps & scripts)]


def package_root_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every package module a that imports a root module b other than `model`, or a benchmark."""
    return [
        f"{m} -> {dep}"
        for m, deps in sorted(graph.items())
        if m == PACKAGE or m.startswith(f"{PACKAGE}.")
        for dep in sorted(deps)
        if dep not in (MODEL, PACKAGE) and not dep.startswith(f"{PACKAGE}.")
    ]


def main() -> int:
    graph = import_graph()
    for i, group in enumerate(layers(graph)):
        for m in group:
            print(f"layer {i}  {m:<22} imports {', '.join(sorted(graph[m])) or '-'}")
    cycle, wrong, upward = find_cycle(graph), script_imports(graph), package_root_imports(graph)
    print(f"import cycle: {' -> '.join(cycle)}" if cycle else "no import cycle")
    print(f"imports of entry scripts: {'; '.join(wrong)}" if wrong else "no module imports an entry script")
    print(
        f"package imports from the root: {'; '.join(upward)}"
        if upward
        else "the package imports only `model` from outside it (no script, no benchmark)"
    )
    return 1 if cycle or wrong or upward else 0


if __name__ == "__main__":
    sys.exit(main())
