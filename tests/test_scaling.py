"""scaling.py: the IsoFLOP fit on points of a known law, and the script on real tiny runs."""

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from scaling import fit


def chinchilla_points(budgets, sizes):
    """Points of L = 1 + 40 N^-0.3 + 80 D^-0.3 with D = C / (6 N), whose optimum at budget C is (C / 6)^0.5 0.5^(1 / 0.6)."""
    points = []
    for c in budgets:
        for n in sizes:
            d = c / (6 * n)
            points.append(
                {"depth": 0, "flops": c, "params": n, "tokens": d, "val_bpb": 1 + 40 * n**-0.3 + 80 * d**-0.3}
            )
    return points


def test_the_fit_finds_each_budgets_optimum_and_the_power_laws():
    budgets = [1e12, 1e13, 1e14]
    sizes = [10**k for k in (4.0, 4.5, 5.0, 5.5, 6.0, 6.5)]
    fitted = fit(chinchilla_points(budgets, sizes))
    for o in fitted["optima"]:
        exact = (o["flops"] / 6) ** 0.5 * 0.5 ** (1 / 0.6)
        assert o["interior"] and abs(math.log(o["params"] / exact)) < 0.35, (o, exact)
    assert fitted["params_law"]["e"] == pytest.approx(0.5, abs=0.08)  # N* grows as C^0.5 for equal exponents
    assert 0 < fitted["loss_law"]["b"] < 0.3


@pytest.mark.slow
def test_scaling_py_trains_each_point_and_draws_the_fit(tiny_data, tmp_path):
    out = tmp_path / "s"
    cmd = [sys.executable, "scaling.py", "--depths", "1", "2", "3", "--flops", "2e9", "6e9"]
    cmd += ["--png", str(out / "law.png"), "--json", str(out / "law.json")]
    cmd += ["--data.dataset", "tiny", "--data.data_dir", str(tiny_data), "--run.device", "cpu"]
    cmd += ["--model.aspect_ratio", "16", "--model.head_dim", "16", "--model.block_size", "32"]
    cmd += ["--training.batch_size", "4", "--training.eval_iters", "4", "--training.precision", "fp32"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "law.json").read_text())
    assert len(result["points"]) == 6 and len(result["optima"]) == 2
    assert {p["depth"] for p in result["points"]} == {1, 2, 3}
    for p in result["points"]:  # each run trained to its budget: FLOPs within a step of it
        assert p["flops_run"] == pytest.approx(p["flops"], rel=0.1)
    assert (out / "law.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fit: val bpb = " in done.stdout
