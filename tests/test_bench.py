"""bench.py and speedrun.py on tiny inputs: every mode runs and prints its numbers (timings are never asserted)."""

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, X86_ONLY

import bench
import speedrun
from benchmarks.conditions import llama_cpp_installed
from benchmarks.training_step import LoopBatchSource
from quillgpt.checkpoint import RunDir, load_checkpoint
from quillgpt.data import BatchSource, load_dataset
from quillgpt.errors import UserError
from quillgpt.prepare import prepare_dataset

TEXT = "".join(f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs, said the king.\n" for i in range(600))
TINY_MODEL = [
    "--model.n_layer",
    "1",
    "--model.n_head",
    "2",
    "--model.n_embd",
    "16",
    "--model.block_size",
    "16",
    "--training.batch_size",
    "2",
]


@pytest.fixture
def tiny(tmp_path):
    """Command-line overrides for a one-layer model on a small prepared text."""
    text = tmp_path / "input.txt"
    text.write_text(TEXT)
    return ["--data.dataset", "tiny", "--data.input", str(text), "--data.data_dir", str(tmp_path / "data"), *TINY_MODEL]


def number_after(label: str, out: str) -> float:
    match = re.search(re.escape(label) + r"\s*([\d.,]+)", out)
    assert match, f"{label!r} not in:\n{out}"
    return float(match[1].replace(",", ""))


def table_rows(out: str) -> list[list[str]]:
    """The body rows of the markdown tables in `out`, as lists of cells."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows if not row[0].strip().startswith("---")]


def test_bench_tables_the_optimised_and_baseline_steps_and_the_speed_up(tiny, capsys):
    """Per step: median and best ms/iter, tokens/s, MFU, peak RSS; then the speed-up and the share of the ceiling."""
    # eager: bench builds the step with trainer.build_trainer, whose compiled path test_train.py runs (a cold compile is slow)
    bench.main([*tiny, "--warmup", "2", "--iters", "3", "--repeats", "2", "--baseline", "--training.compile", "false"])
    out = capsys.readouterr().out
    rows = {row[0]: row for row in table_rows(out)}
    assert set(rows) >= {"run", "optimised", "baseline (all off)"}
    assert rows["run"][1:5] == ["ms/iter (median)", "ms/iter (best)", "tokens/s", "MFU"]
    for name in ("optimised", "baseline (all off)"):
        ms_median, ms_best, tokens_per_s = (float(c.replace(",", "")) for c in rows[name][1:4])
        assert 0 < ms_best <= ms_median and tokens_per_s > 0
        assert float(rows[name][5].replace(",", "")) > 0  # peak RSS
    assert number_after("speed-up over the baseline:", out) > 0
    assert "median of 2," in out  # one ceiling per round
    assert 0 < number_after("optimised runs at", out) < 1000  # percent of the ceiling
    assert "load average" in out


def test_json_prints_the_results_as_one_line(tiny, capsys):
    """--json: the measurements as the last line, what bench.py --gpu reads from the bench.py it runs as a child."""
    bench.main([*tiny, "--warmup", "1", "--iters", "2", "--repeats", "1", "--json", "--training.compile", "false"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # eager, as in the table test above
    assert len(result) == 1 and result[0]["name"] == "optimised"
    assert result[0]["tokens_per_s"] > 0 and result[0]["peak_mb"] > 0 and result[0]["first_step_s"] > 0
    assert result[0]["ms_median"] > 0


def test_baseline_batches_equal_vectorised_batches(tiny):
    data_dir = prepare_dataset("tiny", input_path=tiny[3], data_dir=tiny[5], verbose=False)
    dataset = load_dataset(data_dir)
    fast = BatchSource(dataset, 16, 4, seed=3, device=torch.device("cpu"), prefetch=True)
    loop = LoopBatchSource(dataset, 16, 4, seed=3, device=torch.device("cpu"), prefetch=False)
    for index in range(3):
        a, b = fast.get("train", index, next_index=index + 1), loop.get("train", index)
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and a.positions is b.positions is None


def test_a_flag_of_another_mode_is_one_line_naming_its_modes():
    with pytest.raises(UserError, match=r"^--seeds is a flag of --moe, not of --serve \(python bench.py --serve"):
        bench.main(["--serve", "--seeds", "5"])
    with pytest.raises(UserError, match=r"^--baseline is a flag of the training step, not of --moe"):
        bench.main(["--moe", "--baseline"])
    with pytest.raises(UserError, match=r"^--with-compile is a flag of --vs-transformers, not of the training step"):
        bench.main(["--with-compile"])
    with pytest.raises(UserError, match=r"^--probe takes no config overrides: --training.batch_size 2"):
        bench.main(["--probe", "--training.batch_size", "2"])
    with pytest.raises(UserError, match=r"^--moe has no flag --repeat: did you mean --repeats\?"):
        bench.main(["--moe", "--repeat", "3"])
    with pytest.raises(UserError, match="unknown option '--no-such-flag'"):
        bench.main(["--serve", "--no-such-flag", "1"])


def test_help_lists_the_modes_and_each_mode_its_own_flags_and_defaults(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {flag}" in out for flag in ["--moe", "--probe", "--vs-transformers", "--serve", "--gpu"])
    assert "--baseline" in out and "--mode:" not in out and "--with-compile" not in out
    with pytest.raises(SystemExit):
        bench.main(["--serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-tokens MAX_TOKENS" in out and "(default 128)" in out and "--baseline" not in out


@pytest.mark.slow
def test_speedrun_times_rungs_seeds_and_variants(tiny, tmp_path):
    """Two tiny configs and a variant: a row each with the time to every rung reached, the final val loss
    over --final-batches at max_iters, the wall time and the budget beside the measured matmul rate."""
    configs = []
    for name in ("slow", "fast"):
        path = tmp_path / f"{name}.toml"
        path.write_text('[run]\ndevice = "cpu"\n[training]\nmax_iters = 4\neval_iters = 2\neval_interval = 2\n')
        configs.append(str(path))
    result = subprocess.run(
        [
            sys.executable,
            "speedrun.py",
            "--configs",
            *configs,
            "--targets",
            "100",
            "0.01",
            "--seeds",
            "1",
            "--variant",
            "a=--optimizer.learning_rate 1e-2",
            "--final-batches",
            "3",
            "--keep",
            str(tmp_path / "kept"),
            *tiny,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [r for r in table_rows(result.stdout) if r[0] != "config"]
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted((Path(c).name, "a", "1") for c in configs)
    for row in rows:
        assert re.fullmatch(r"[\d.]+s @0", row[3])  # the iter-0 eval is already below 100
        assert row[4] == "—"  # 0.01 is never reached
        assert re.fullmatch(r"[\d.]+ @4", row[5])
        assert re.fullmatch(r"\d+s \([\d,]+ GFLOP/s (fp32|bf16)\)", row[7])
    assert re.search(r"fast.toml / .*slow.toml to 100.0: [\d.]+s / [\d.]+s = [\d.]+ of the wall time", result.stdout)
    for name in ("slow", "fast"):  # --keep: each run's final model stays, to sample from
        assert load_checkpoint(RunDir(tmp_path / "kept" / f"{name}-1-a").latest())["iter_num"] == 4


@pytest.mark.slow
def test_speedrun_stops_a_run_at_its_budget_once_per_seed(tiny, tmp_path):
    config = tmp_path / "long.toml"
    config.write_text('[run]\ndevice = "cpu"\n[training]\nmax_iters = 100000\neval_iters = 2\neval_interval = 5\n')
    result = subprocess.run(
        [
            sys.executable,
            "speedrun.py",
            "--configs",
            str(config),
            "--budget-minutes",
            "0.0001",
            "--seeds",
            "5",
            "6",
            *tiny,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [r for r in table_rows(result.stdout) if r[0] != "config"]
    assert [r[2] for r in rows] == ["5", "6"] and all("over budget (best" in r[-3] for r in rows)


@pytest.mark.slow
@X86_ONLY
def test_speedrun_on_the_avx2_path_trains_in_fp32_and_scales_its_budget_by_fp32s_rate(tiny, tmp_path):
    """--isa avx2: train.py and the budget's probe run under the caps, where bf16 is emulated, so the preset's auto
    trains in fp32 and the budget is scaled by the fp32 rate measured there."""
    config = tmp_path / "auto.toml"
    config.write_text('[run]\ndevice = "cpu"\n[training]\nmax_iters = 2\neval_iters = 1\nprecision = "auto"\n')
    result = subprocess.run(
        [sys.executable, "speedrun.py", "--isa", "avx2", "--configs", str(config), "--final-batches", "1", *tiny],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "speedrun.py on the avx2 path: ONEDNN_MAX_CPU_ISA=AVX2" in result.stdout
    [row] = [r for r in table_rows(result.stdout) if r[0] != "config"]
    budget, gflops = re.fullmatch(r"(\d+)s \(([\d,]+) GFLOP/s fp32\)", row[-1]).groups()
    assert np.isclose(float(budget), speedrun.budget_seconds(10, float(gflops.replace(",", ""))), rtol=0.01)


def test_speedrun_budget_scales_up_on_slower_machines_only():
    """The record's budget: 10 minutes at 800 GFLOP/s (matmuls in the run's precision) or more, twice that at 400; an AMX machine
    measuring 3,600 gets the 10 minutes, not 2.2."""
    assert speedrun.budget_seconds(10, 800) == 600 and speedrun.budget_seconds(10, 400) == 1200
    assert speedrun.budget_seconds(10, 3600) == 600


def test_speedrun_ratio_is_a_bound_when_the_baseline_never_reaches_the_target():
    """'< 0.33' (20 s of 60 s) when the baseline never gets there; swapped, the line says the run did not reach it."""

    def run(config: str, seconds: float | None, total: float) -> speedrun.Run:
        return speedrun.Run(
            config, "", 1, 400.0, 1200.0, {} if seconds is None else {1.88: (seconds, 100)}, seconds=total
        )

    base, fast = run("a.toml", None, 60.0), run("b.toml", 20.0, 20.0)
    line = speedrun.ratio_line([base, fast], 1.88)
    assert "< 0.33" in line and "never reached" in line
    assert "did not reach" in speedrun.ratio_line([fast, base], 1.88)
    assert np.isclose(
        float(re.search(r"= ([\d.]+) of", speedrun.ratio_line([fast, run("c", 20.0, 20.0)], 1.88))[1]), 1.0
    )


def test_vs_nanogpt_reads_both_trainers_iteration_lines_and_gives_nanogpt_our_data(tiny_data, tmp_path, capsys):
    """benchmarks/vs_nanogpt.py times each trainer by the lines it prints: ours from a real run (log_interval 1), and
    nanoGPT's in the format of its train.py; nanoGPT's scratch directory links our train.bin and names the vocab."""
    import pickle

    from conftest import tiny_overrides

    from benchmarks import vs_nanogpt
    from train import train

    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "run", **{"training.max_iters": 6}))
    out = capsys.readouterr().out
    assert len(vs_nanogpt.OUR_ITER.findall(out)) == 6
    assert vs_nanogpt.iteration_ms(out, vs_nanogpt.OUR_ITER, skip=1) > 0
    nano_out = "step 0: train loss 4.2\niter 0: loss 4.2, time 900.00ms, mfu -100.00%\n" + "".join(
        f"iter {i}: loss 3.{i}000, time {30 + i}.50ms, mfu 1.20%\n" for i in range(1, 6)
    )
    assert (
        vs_nanogpt.iteration_ms(nano_out, vs_nanogpt.NANOGPT_ITER, skip=1) == 34.0
    )  # iters 2-5: 32.5, 33.5, 34.5, 35.5

    nanogpt = tmp_path / "nanoGPT"
    (nanogpt / "config").mkdir(parents=True)
    (nanogpt / "configurator.py").write_text("")
    (tmp_path / "scratch").mkdir()
    work = vs_nanogpt.nanogpt_workdir(
        nanogpt, replace(load_dataset(tiny_data / "tiny"), meta={"vocab_size": 77}), tmp_path / "scratch"
    )
    data = work / "data" / "shakespeare_char"
    assert (data / "train.bin").read_bytes() == (tiny_data / "tiny" / "train.bin").read_bytes()
    assert pickle.loads((data / "meta.pkl").read_bytes()) == {"vocab_size": 77}
    assert (work / "configurator.py").resolve() == (nanogpt / "configurator.py").resolve()


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_vs_transformers_decodes_the_same_greedy_tokens_as_transformers_generate(transformers, capsys, batch):
    """Both sides load the same exported directory and decode greedily; the table has both rows and the tokens match.
    At batch 3 every side decodes three rows at once (llama.cpp three sequences in one context)."""
    small = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32"]
    bench.main(["--vs-transformers", "--new-tokens", "12", "--repeats", "1", "--batch", str(batch), *small])
    out = capsys.readouterr().out
    rows = {row[0]: row for row in table_rows(out)}
    assert f"12 new tokens after a 16-token prompt, batch {batch}, greedy" in out
    assert any(name.startswith("sample.py --no-compile") for name in rows) and "transformers generate (fp32)" in rows
    assert "greedy tokens equal: True" in out
    if llama_cpp_installed():  # llama.cpp on the same model's GGUF files, beside them
        assert {"llama.cpp, --gguf f32", "llama.cpp, --gguf bf16"} <= set(rows)
    if batch == 1:
        with pytest.raises(UserError, match="exceed the context 32"):
            bench.main(["--vs-transformers", "--new-tokens", "30", *small])
