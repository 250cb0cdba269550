"""The code's layout: the module import graph has no cycle, no module imports an entry script, and the config
schema loads without torch (scripts/import_graph.py prints the graph)."""

import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from import_graph import ENTRY_SCRIPTS, find_cycle, import_graph, layers, script_imports  # noqa: E402


def test_no_import_cycle_among_the_modules():
    graph = import_graph()
    assert {"train", "trainer", "model", "config", "load", "checkpoint"} <= set(graph)
    assert find_cycle(graph) is None
    assert sum(map(len, layers(graph))) == len(graph)


def test_the_checks_see_a_cycle_and_an_import_of_a_script():
    """Lazy imports count: a module importing train inside a function is caught."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert script_imports({"bench": {"train", "model"}, "train": {"model"}, "model": set()}) == ["bench -> train"]


def test_the_entry_scripts_build_from_the_modules_not_from_each_other():
    graph = import_graph()
    assert ENTRY_SCRIPTS <= set(graph)
    assert script_imports(graph) == []
    assert "trainer" in graph["train"] and "trainer" in graph["bench"] and "trainer" in graph["validate"]


def test_the_config_schema_loads_without_torch():
    code = "import sys, config; config.load_config('configs/base/base.toml'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
