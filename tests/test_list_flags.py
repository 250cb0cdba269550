"""Command-line flags that take a list accept it both ways, `--x a b` and `--x a --x b`, with the same result: a
repeated flag adds to the list rather than replacing what came before (argparse's nargs="+" alone drops it)."""

import ast
import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, tiny_overrides

import eval as eval_script
import sample
import speedrun
from train import train

SCRIPTS = sorted([*REPO_ROOT.glob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")])


def list_flags_that_drop_a_repeat(path) -> list[str]:
    """The add_argument calls in a script that take several values or repeat, but not with nargs and extend."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
        takes_a_list = kw.get("nargs") in ("+", "*") or kw.get("action") in ("append", "extend")
        if takes_a_list and not (kw.get("nargs") in ("+", "*") and kw.get("action") == "extend"):
            found.append(f"{path.name}:{node.lineno} {node.args[0].value}")
    return found


def test_every_list_flag_of_the_scripts_extends_its_list():
    assert {"eval.py", "prepare.py", "sample.py", "speedrun.py", "bench.py"} <= {p.name for p in SCRIPTS}
    assert [flag for path in SCRIPTS for flag in list_flags_that_drop_a_repeat(path)] == []


def test_the_check_sees_a_list_flag_that_a_repeat_replaces(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        'p.add_argument("--a", nargs="+")\np.add_argument("--b", action="append")\n'
        'p.add_argument("--c", nargs="+", action="extend")\np.add_argument("--d", type=int)\n'
    )
    assert list_flags_that_drop_a_repeat(script) == ["s.py:1 --a", "s.py:2 --b"]


def test_speedrun_lists_take_both_forms_and_keep_their_defaults_when_absent():
    one_flag, _ = speedrun.parse_args(
        ["--configs", "a.toml", "b.toml", "--seeds", "1", "2", "--targets", "2.0", "1.9", "--variant", "x=", "y="]
    )
    each, extra = speedrun.parse_args(
        "--configs a.toml --configs b.toml --seeds 1 --seeds 2 --target 2.0 --target 1.9 --variant x= --variant y= "
        "--model.n_layer 1".split()
    )
    assert vars(one_flag) == vars(each) and extra == ["--model.n_layer", "1"]
    assert (each.configs, each.seeds, each.targets, each.variant) == (
        ["a.toml", "b.toml"],
        [1, 2],
        [2.0, 1.9],
        ["x=", "y="],
    )
    default, _ = speedrun.parse_args([])
    assert (default.configs, default.seeds, default.targets) == (speedrun.CONFIGS, [1337], speedrun.TARGETS)
    assert speedrun.parse_args(["--seeds", "7"])[0].seeds == [7]  # a given list replaces the default


def test_sample_stop_and_eval_tasks_take_both_forms():
    stops = [
        sample.parse_args(["--ckpt", "c", *argv]).stop
        for argv in (["--stop", "a", "\\n"], "--stop a --stop \\n".split())
    ]
    assert stops == [["a", "\n"], ["a", "\n"]]
    tasks = [
        eval_script.parse_args(["--ckpt", "c", *argv])[1].tasks
        for argv in (["--tasks", "a,b", "c"], ["--tasks", "a", "--tasks", "b,c"])
    ]
    assert tasks == [("a", "b", "c"), ("a", "b", "c")]


def test_eval_text_scores_every_file_whether_given_after_one_flag_or_one_flag_each(tiny_data, tmp_path):
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2}))
    corpus = (tiny_data / "tiny.txt").read_text()
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text(corpus[:2000])
    files[1].write_text(corpus[2000:3000])
    reports = {}
    for form, args in (
        ("one flag", ["--text", *map(str, files)]),
        ("one each", ["--text", str(files[0]), "--text", str(files[1])]),
    ):
        proc = subprocess.run(
            [sys.executable, "eval.py", "--ckpt", str(tmp_path / "t"), *args, "--json", str(tmp_path / f"{form}.json")],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        texts = json.loads((tmp_path / f"{form}.json").read_text())["text"]
        reports[form] = [{k: v for k, v in t.items() if k != "seconds"} for t in texts]
    assert reports["one flag"] == reports["one each"]
    scored = [(t["path"], t["bytes"]) for t in reports["one each"]]
    assert scored == [(str(files[0]), 1999), (str(files[1]), 999)]  # each file's first character is context
    assert all(t["bpb"] > 0 for t in reports["one each"])


def test_a_second_glob_is_an_error_not_a_silent_replacement(tmp_path):
    import prepare

    with pytest.raises(SystemExit) as exc:
        prepare.parse_args(["--dataset", "d", "--input", str(tmp_path), "--glob", "*.md", "--glob", "*.txt"])
    assert exc.value.code == 2
    assert prepare.parse_args(["--dataset", "d", "--glob", "*.md"]).glob == "*.md"
