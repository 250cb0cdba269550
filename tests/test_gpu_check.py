"""bench.py --gpu, the one command a GPU session runs, end to end at toy shapes on the CPU (tests never time anything:
they check that every part runs and reports)."""

import json

import pytest
from conftest import tiny_corpus

import bench
from benchmarks.conditions import NANOGPT


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_at_toy_shapes_on_the_cpu(tmp_path, capsys):
    """--tiny --device cpu: pytest -m cuda (all skipped here), 124M's step at a toy shape with a lever, decoding
    against transformers, serving, and the tiny Shakespeare race of gpu.toml and speedrun_gpu.toml, with nanoGPT's
    arms where a checkout is at hand (QUILLGPT_NANOGPT, or .gpu_inputs/nanoGPT); one JSON report with every part."""
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    text = tmp_path / "input.txt"
    text.write_text(tiny_corpus(300_000), encoding="utf-8")
    out = tmp_path / "report.json"
    nanogpt = ["--nanogpt", str(NANOGPT)] if (NANOGPT / "train.py").is_file() else []
    bench.main(["--gpu", "--tiny", "--device", "cpu", "--out", str(out), "--data.input", str(text), *nanogpt])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["machine"]["torch"] and "commit" in report["machine"]
    assert report["tests"]["counts"].get("skipped", 0) > 0 and not report["tests"]["failed"]
    arms = {row["arm"]: row for row in report["gpt2_124m"]}
    assert arms["ours, 124M.toml"]["tokens_per_s"] > 0 and arms["ours, 124M.toml"]["micro_batch"] == 4
    assert [r["arm"] for r in report["levers"]["gpt2_124m"]] == ["ours + loss_chunks 8"]
    assert report["levers"]["gpt2_124m"][0]["tokens_per_s"] > 0
    sides = report["decoding"]["sides"]
    assert sides[0]["name"].startswith("sample.py --no-compile") and all(s["tokens_per_s"] > 0 for s in sides)
    assert [level["clients"] for level in report["serving"]["levels"]] == [1, 2]
    race = {r["arm"]: r for r in report["shakespeare"]}
    assert {"ours, gpu.toml", "ours, speedrun_gpu.toml"} <= set(race)
    assert all(not r["error"] and r["evaluations"] for r in race.values())
    if nanogpt:
        assert (
            race["nanoGPT, train_shakespeare_char.py"]["evaluations"]
            and arms["nanoGPT, train_gpt2.py"]["tokens_per_s"] > 0
        )
    else:
        assert "nanoGPT: not run (no --nanogpt DIR)" in printed
    for heading in ("a. pytest -m cuda", "b. tiny Shakespeare to val", "c. 124M's step", "d. batch-1 greedy decoding"):
        assert heading in printed
