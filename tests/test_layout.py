"""The code's layout: the module import graph has no cycle, no module imports an entry script, the package imports
nothing from the root but model, and the config schema loads without torch (scripts/import_graph.py prints the
graph)."""

import subprocess
import sys

from conftest import REPO_ROOT
from import_graph import entry_scripts, find_cycle, import_graph, layers, package_root_imports, script_imports


def test_no_import_cycle_among_the_modules():
    graph = import_graph()
    assert {"train", "quillgpt.trainer", "model", "quillgpt.config", "quillgpt.loading"} <= set(graph)
    assert find_cycle(graph) is None
    assert sum(map(len, layers(graph))) == len(graph)


def test_the_checks_see_a_cycle_and_an_import_of_a_script():
    """Lazy imports count: a module importing train inside a function is caught."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert script_imports({"bench": {"train", "model"}, "train": {"model"}, "model": set()}) == ["bench -> train"]


def test_the_entry_scripts_build_from_the_package_not_from_each_other():
    graph = import_graph()
    scripts = {"train", "sample", "prepare", "eval", "export", "bench", "speedrun", "scaling", "serve"}
    assert scripts <= entry_scripts(graph)
    assert script_imports(graph) == []
    assert "quillgpt.trainer" in graph["train"] and "quillgpt.prepare" in graph["prepare"]


def test_the_package_imports_nothing_from_the_root_but_model_and_no_benchmark():
    graph = import_graph()
    assert package_root_imports(graph) == []
    assert {"benchmarks.common", "benchmarks.training_step"} <= set(graph)
    assert package_root_imports(
        {
            "quillgpt.a": {"model", "train", "benchmarks.common"},
            "train": set(),
            "model": set(),
            "benchmarks.common": set(),
        }
    ) == ["quillgpt.a -> benchmarks.common", "quillgpt.a -> train"]


def test_the_root_holds_only_the_scripts_and_model():
    """Beside them: the package (quillgpt/) and the benchmarks (benchmarks/, under bench.py)."""
    assert sorted(p.name for p in REPO_ROOT.glob("*.py")) == [
        "bench.py",
        "chat.py",
        "eval.py",
        "export.py",
        "model.py",
        "prepare.py",
        "sample.py",
        "scaling.py",
        "serve.py",
        "speedrun.py",
        "tasks.py",
        "train.py",
    ]


def test_the_config_schema_loads_without_torch():
    code = "import sys; from quillgpt import config; config.load_config('configs/base/base.toml'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
