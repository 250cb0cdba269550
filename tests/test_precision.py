"""training.precision = auto on the CPU follows measured matmul rates, natively and on this CPU's AVX2-only path
(oneDNN and ATen capped at AVX2, where bf16 is emulated as on most laptops); forcing bf16 where it is slower warns
with the measured slowdown; a resumed run keeps the precision auto chose."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, X86_ONLY, tiny_overrides

from benchmarks.conditions import ISA_ENV
from quillgpt.precision import BF16_MARGIN, MatmulRates, measure_cpu_rates, settle

DEVICE_LINE = re.compile(r"device: cpu, (fp32|bf16) \(.*: fp32 ([\d,.]+), bf16 ([\d,.]+) GFLOP/s(\)|; )")


def run_train(overrides: dict, isa: str = "native", extra: tuple = ()) -> str:
    env = {**os.environ, **ISA_ENV[isa]}
    args = [f"--{k}={v}" for k, v in overrides.items()]
    out = subprocess.run(
        [sys.executable, "train.py", *args, *extra], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def chosen_and_rates(out: str) -> tuple[str, float, float]:
    found = DEVICE_LINE.search(out)
    assert found, out
    chosen, fp32, bf16, _ = found.groups()
    return chosen, float(fp32.replace(",", "")), float(bf16.replace(",", ""))


def quick(tiny_data, tmp_path, **extra) -> dict:
    return tiny_overrides(
        tiny_data, tmp_path, **{"training.max_iters": 2, "training.eval_interval": 0, "training.eval_iters": 1, **extra}
    )


@pytest.mark.parametrize("isa", ["native", pytest.param("avx2", marks=X86_ONLY)])
def test_auto_picks_the_precision_the_probe_measured_faster(tiny_data, tmp_path, isa):
    """The device line prints both rates and the choice, and the choice is the faster one, whatever this box is;
    on the AVX2 path bf16 is emulated, so auto picks fp32 there."""
    out = run_train(quick(tiny_data, tmp_path, **{"training.precision": "auto"}), isa)
    chosen, fp32, bf16 = chosen_and_rates(out)
    assert "auto picked" in out
    settled = "were not of one mind" in out  # a busy machine: the one-thread readings or the class chose
    if not settled:
        assert chosen == ("bf16" if bf16 > BF16_MARGIN * fp32 else "fp32")
    if isa == "avx2":
        assert chosen == "fp32" and (settled or bf16 < fp32 / 5)


@X86_ONLY
def test_forcing_bf16_where_it_is_emulated_warns_with_the_measured_slowdown(tiny_data, tmp_path):
    out = run_train(quick(tiny_data, tmp_path, **{"training.precision": "bf16"}), "avx2")
    chosen, fp32, bf16 = chosen_and_rates(out)
    slowdown = re.search(r"warning: bf16 runs ([\d,.]+)x slower than fp32 on this CPU \(emulated", out)
    assert chosen == "bf16" and slowdown, out
    one_thread = re.search(r"1[- ]thread(?: readings \(| read )([\d,]+)/([\d,]+), ([\d,]+)/([\d,]+)\)", out)
    if one_thread:  # a busy machine misled the all-thread readings: the warning gives the one-thread ratio
        a, b, c, d = (float(v.replace(",", "")) for v in one_thread.groups())
        fp32, bf16 = max(a, c), max(b, d)
    assert float(slowdown.group(1).replace(",", "")) == pytest.approx(fp32 / bf16, rel=0.05, abs=0.05)


@X86_ONLY
def test_a_resumed_run_keeps_the_precision_auto_chose(tiny_data, tmp_path):
    """A run started on the AVX2 path (auto: fp32) resumes natively in fp32, as recorded, not by a new choice (where
    bf16 is native auto would pick it), so the resumed losses continue the same computation."""
    run_train(quick(tiny_data, tmp_path, **{"training.precision": "auto", "training.save_interval": 1}), "avx2")
    resume = quick(tiny_data, tmp_path, **{"training.max_iters": 3})
    del resume["training.precision"]  # what the run recorded decides
    out = run_train(resume, "native", extra=("--resume", str(tmp_path / "t")))
    assert "device: cpu, fp32 (" in out and "as the run began (the checkpoint's)" in out and "auto picked" not in out


def test_one_thread_readings_choose_and_the_cpu_class_settles_a_tie():
    """All-thread readings give the rates; one-thread readings, which a busy machine does not mislead, the choice;
    where those disagree too, the CPU's class (their majority where the class is unknown); the text says what
    happened wherever the readings were not of one mind."""
    shape = (256, 64, 256)
    native = ("bf16", "this CPU's class: native bf16 matmuls (AMX)")
    calm = settle([(100e9, 400e9), (90e9, 390e9)], [(50e9, 200e9), (48e9, 190e9)], shape, ("fp32", "class"))
    assert (calm.faster, calm.fp32, calm.bf16, calm.settled_by) == ("bf16", 100e9, 400e9, "")
    busy = [(100e9, 400e9), (100e9, 20e9)]  # one says bf16, one fp32
    agreed = settle(busy, [(50e9, 200e9), (48e9, 190e9)], shape, ("fp32", "this CPU's class: emulated"))
    assert (agreed.faster, agreed.fp32, agreed.bf16) == ("bf16", 100e9, 400e9)
    assert agreed.describe().endswith(
        "the readings (fp32/bf16 GFLOP/s: 100/400, 100/20) were not of one mind: bf16 by the 1-thread readings "
        "(50/200, 48/190), which a busy machine does not mislead"
    )
    split = [(50e9, 200e9), (50e9, 10e9)]
    assert settle(busy, split, shape, native).faster == "bf16"
    assert "bf16 by this CPU's class: native bf16 matmuls (AMX) (1 thread read 50/200, 50/10)" in (
        settle(busy, split, shape, native).describe()
    )
    assert settle(busy, split, shape, None).faster == "bf16"  # a tie: the first one-thread reading's
    slow = [(1e9, 4e9), (1e9, 4e9)]  # an AVX2 path's fp32 read below its emulated bf16 by waiting threads
    doubted = settle(slow, [(95e9, 4e9), (94e9, 4e9)], shape, ("fp32", "this CPU's class: emulated"))
    assert doubted.faster == "fp32" and doubted.bf16_slowdown == pytest.approx(95 / 4)
    assert calm.bf16_slowdown == pytest.approx(100 / 400)  # the rates shown, where the readings agreed


# three fresh probes in one process (the cache cleared before each): a process starting beside three hogs is itself
# several seconds of the test
PROBE = "from quillgpt.precision import measure_cpu_rates as m\nfor _ in range(3): m.cache_clear(); print(m(384, 256).faster)"


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["native", pytest.param("avx2", marks=X86_ONLY)])
def test_auto_picks_this_cpus_class_precision_with_the_cores_contended(isa):
    """With three busy-looping processes on the cores, fresh probes still pick what this CPU's class runs fast:
    bf16 where its matmuls are native, fp32 on the AVX2 path (emulated bf16)."""
    env = {**os.environ, **ISA_ENV[isa]}
    expected = subprocess.run(
        [sys.executable, "-c", "from quillgpt.precision import cpu_bf16_class as c; print((c() or ('?',))[0])"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    if expected == "?":
        pytest.skip("this CPU's class is unknown (not x86 Linux): the majority of the readings decides")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        picks = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
        ).stdout.split()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert picks == [expected] * 3


def test_the_probe_is_bounded_and_cached():
    rates = measure_cpu_rates(64, 100_000)
    assert isinstance(rates, MatmulRates) and rates.shape == (256, 64, 256)
    assert rates.fp32 > 0 and rates.bf16 > 0 and measure_cpu_rates(64, 100_000) is rates


@pytest.mark.slow
@X86_ONLY
def test_bench_probe_on_the_avx2_path_shows_the_capped_kernels_and_rates():
    out = subprocess.run(
        [sys.executable, "bench.py", "--probe", "--isa", "avx2", "--width", "128"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "ATen CPU capability: AVX2" in out.stdout and "auto picks fp32" in out.stdout
    assert "'ONEDNN_MAX_CPU_ISA': 'AVX2'" in out.stdout


def test_int8_activations_follow_the_int8_products_rates(tmp_path, monkeypatch):
    """int8's activations are the precision the int8 product itself runs faster with at the model's width (rates
    injected, the rule is what's tested); the real probe reads both, and the label names the activations."""
    import torch
    from test_export import write_char_checkpoint

    from quillgpt import generate, precision

    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt")
    fp32, bf16 = precision.read_int8_rates(64)
    assert fp32 > 0 and bf16 > 0
    for rates, expected in (((100.0, 120.0), torch.float32), ((100.0, 1300.0), torch.bfloat16)):
        monkeypatch.setattr(precision, "read_int8_rates", lambda width, r=rates: r)
        precision.int8_activations.cache_clear()
        model, _, plan = generate.load_for_sampling(ckpt, "cpu", "int8")
        label = plan.label
        assert model.transformer.wte.weight.dtype == expected and model.lm_head.weight.dtype == torch.int8
        assert model.lm_head.scale.dtype == expected
        assert f"int8 ({'bf16' if expected == torch.bfloat16 else 'fp32'} activations)" in label
    precision.int8_activations.cache_clear()


def test_sampling_dtype_is_bf16_where_a_row_runs_clearly_faster_in_it_and_a_batch_no_slower(tmp_path, monkeypatch):
    """sample.py's auto dtype on the CPU is bf16 where one decoding row's products measure DECODING_BF16_MARGIN
    faster in bf16 and a serve.py batch's no slower, else fp32 (speed-ups injected, the rule is what's tested; each
    on a machine with nothing kept yet)."""
    import torch
    from test_export import write_char_checkpoint

    from quillgpt import generate

    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt")
    margin, batch = generate.DECODING_BF16_MARGIN, generate.DECODING_BATCH_ROWS
    cases = [
        ((0.4, 2.0), torch.float32),
        ((margin * 0.95, 2.0), torch.float32),
        ((margin, 0.5), torch.float32),  # an AVX2-only CPU: one row faster, a batch at half speed
        ((margin, 1.0), torch.bfloat16),
    ]
    for i, ((row, rows), expected) in enumerate(cases):
        monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / f"cache-{i}"))
        monkeypatch.setattr(generate, "measure_bf16_speedup", lambda width, n, pays, a=row, b=rows: {1: a, batch: b}[n])
        model, _, _ = generate.load_for_sampling(ckpt, "cpu", "auto")
        assert model.transformer.wte.weight.dtype == expected


def test_decodings_speed_ups_are_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    """The first auto load measures and keeps the speed-ups under the machine's key, the model's width and the rows;
    later loads take the kept ones without measuring (planted ones each way), and an unreadable file is measured
    again."""
    import torch
    from test_export import write_char_checkpoint

    from quillgpt import generate, precision

    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "bf16_decoding_speedup.json"
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt")
    monkeypatch.setattr(generate, "measure_bf16_speedup", lambda width, rows, pays: 2.0)
    model, _, _ = generate.load_for_sampling(ckpt, "cpu", "auto")
    key = f"{precision.machine_key()}|{model.config.n_embd}"
    row, batch = f"{key}|1 rows", f"{key}|{generate.DECODING_BATCH_ROWS} rows"
    assert json.loads(kept.read_text()) == {row: 2.0, batch: 2.0}

    def unmeasured(width, rows, pays):
        raise AssertionError("measured again")

    monkeypatch.setattr(generate, "measure_bf16_speedup", unmeasured)
    for planted, dtype in (((2.0, 1.5), torch.bfloat16), ((2.0, 0.5), torch.float32), ((1.0, 2.0), torch.float32)):
        kept.write_text(json.dumps(dict(zip((row, batch), planted))))
        model, _, plan = generate.load_for_sampling(ckpt, "cpu", "auto")
        label = plan.label
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        assert model.transformer.wte.weight.dtype == dtype and label.endswith(f"{name} on cpu")
    kept.write_text("{not json")
    with pytest.raises(AssertionError, match="measured again"):
        generate.load_for_sampling(ckpt, "cpu", "auto")


def test_decodings_probe_measures_both_precisions_and_auto_follows_it(tmp_path, monkeypatch):
    """The real probe: a row, and a batch, through a model's worth of weights in each precision give positive
    speed-ups, kept under the machine's key and width, and auto's choice is the rule's verdict on them."""
    import torch

    from quillgpt import generate, precision

    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path))
    chosen, why = generate.decoding_precision("auto", torch.device("cpu"), 96)
    kept = json.loads((tmp_path / "bf16_decoding_speedup.json").read_text())
    row = kept[f"{precision.machine_key()}|96|1 rows"]
    batch = kept.get(f"{precision.machine_key()}|96|{generate.DECODING_BATCH_ROWS} rows")  # not where a row is slower
    assert row > 0 and (batch is None or batch > 0)
    bf16 = row >= generate.DECODING_BF16_MARGIN and batch >= 1.0
    assert chosen == ("bf16" if bf16 else "fp32") and f"ran {row:.2f}x as fast in bf16" in why
    assert generate.decoding_precision("fp32", torch.device("cpu"), 96) == ("fp32", "--dtype")


def test_an_unwritable_cache_directory_costs_only_the_probe_again(tmp_path, monkeypatch):
    """Where the cache directory cannot be written (here it lies under a file), auto measures and decodes in what it
    measured; nothing fails."""
    import torch
    from test_export import write_char_checkpoint

    from quillgpt import generate

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(generate, "measure_bf16_speedup", lambda width, rows, pays: 2.0)
    model, _, _ = generate.load_for_sampling(write_char_checkpoint(tmp_path / "ckpt.pt"), "cpu", "auto")
    assert model.transformer.wte.weight.dtype == torch.bfloat16


def test_muon_orthogonalises_in_fp32_where_bf16_measures_slower(tiny_data, tmp_path):
    """Muon's Newton-Schulz matmuls follow the measured rates as training does: fp32 where bf16 is emulated (bf16
    would make the optimizer the slowest part of the step), bf16 where it is fast."""
    from dataclasses import replace

    import torch

    from quillgpt import trainer
    from quillgpt.config import build_config
    from quillgpt.distributed import DistInfo

    cfg = build_config(None, tiny_overrides(tiny_data, tmp_path, **{"optimizer.name": "muon"}))
    rt = trainer.setup(cfg, DistInfo())
    for fp32, bf16, expected in ((100e9, 1e9, torch.float32), (100e9, 400e9, torch.bfloat16)):
        measured = replace(rt, matmul_rates=MatmulRates(fp32, bf16, (128, 32, 128)))
        assert trainer.muon_dtype(cfg, measured) == expected


def test_cpu_mfu_is_measured_against_a_nominal_peak_that_no_busy_moment_moves(tiny_data, tmp_path, monkeypatch):
    """MFU's CPU peak comes from what the CPU is (threads x clock x FLOPs a cycle), not from a probe: a run that
    starts beside other work reads a low matmul rate, and against it reported 143-270%. Two runs, one with the cores
    contended, get the same peak, above every rate the probe read; the step line never shows an MFU over 100%."""
    from quillgpt import trainer
    from quillgpt.config import build_config
    from quillgpt.distributed import DistInfo
    from quillgpt.metrics import format_step_line

    def setup(**extra) -> trainer.Runtime:
        return trainer.setup(build_config(None, tiny_overrides(tiny_data, tmp_path, **extra)), DistInfo())

    quiet = setup()
    measure_cpu_rates.cache_clear()  # a fresh probe, as a new process makes
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        busy = setup()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert quiet.peak_flops == busy.peak_flops >= max(quiet.matmul_rates.fp32, busy.matmul_rates.fp32)
    assert "GFLOP/s: nominal: " in trainer.device_line(busy) and not list(tmp_path.rglob("cpu_peaks.json"))
    rt = setup(**{"logging.peak_tflops": 2.0})
    assert rt.peak_flops == 2e12 and "GFLOP/s: logging.peak_tflops" in trainer.device_line(rt)
    assert "mfu 41.0%" in format_step_line(1, 2, 1.0, 1e-3, 1.0, 0.1, 1000, 0.41, 10)
    assert "mfu over 100%" in format_step_line(1, 2, 1.0, 1e-3, 1.0, 0.1, 1000, 1.43, 10)


def test_a_gpu_that_only_emulates_bf16_trains_in_fp16_and_samples_in_fp32(monkeypatch):
    """torch.cuda.is_bf16_supported() counts emulation, which on a pre-Ampere card (a T4, a V100) is slower than
    fp16 with a GradScaler: auto asks for bf16 in hardware. The card's answer is simulated (no GPU here); the rule
    is what is tested."""
    import torch

    from quillgpt import precision, trainer

    cuda = torch.device("cuda")
    for hardware, training, sampling in ((False, "fp16", "fp32"), (True, "bf16", "bf16")):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True, h=hardware: h or including_emulation
        )
        assert trainer.resolve_precision("auto", cuda) == training
        assert precision.inference_precision("auto", cuda, 64, 1) == sampling
