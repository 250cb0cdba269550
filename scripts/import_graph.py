"""The import graph of the repository's top-level modules, and the rules it keeps.

    python scripts/import_graph.py

Every import of one of our modules counts, also one inside a function (a lazy import hides a cycle
from Python, not from this). Prints each module with what it imports, in layers (a module imports
only from layers below its own), then checks the rules, which tests/test_layout.py checks too:
- no import cycle;
- no module imports an entry script: train.py, sample.py, eval.py, bench.py, speedrun.py and export.py are
  built from the modules and never from each other.
Exits 1 when a rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRY_SCRIPTS = {"train", "sample", "bench", "speedrun", "export", "eval"}


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """module name -> the names of the repository's modules it imports."""
    modules = {p.stem: p for p in root.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


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
                return path[path.index(dep):] + [dep]
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
    return [f"{m} -> {dep}" for m, deps in sorted(graph.items()) for dep in sorted(deps & ENTRY_SCRIPTS)]


def main() -> int:
    graph = import_graph()
    for i, group in enumerate(layers(graph)):
        for m in group:
            print(f"layer {i}  {m:<12} imports {', '.join(sorted(graph[m])) or '-'}")
    cycle, wrong = find_cycle(graph), script_imports(graph)
    print(f"import cycle: {' -> '.join(cycle)}" if cycle else "no import cycle")
    print(f"imports of entry scripts: {'; '.join(wrong)}" if wrong else "no module imports an entry script")
    return 1 if cycle or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
