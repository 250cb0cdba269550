"""Training telemetry: the console lines, train_log.json, wandb, the loss-curve PNG, and MFU's peak.

Only rank 0 creates a MetricsLog: it prints each step and evaluation line and records the point. train_log.json is rewritten atomically at each evaluation, each
checkpoint and the end, so it always matches a loadable checkpoint; loss_curve.png is redrawn then
too, atomically, by a background child process.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from quillgpt.errors import UserError, WriteError, run_main
from quillgpt.files import atomic_write, atomic_write_json

if TYPE_CHECKING:
    import torch

# Dense bf16/fp16 tensor-core peaks of common accelerators (FLOP/s), by a part of the name torch.cuda.get_device_name
# gives, the first match wins: the PCIe and NVL cards come before the SXM ones whose names theirs contain ("NVIDIA
# H100 PCIe" against "NVIDIA H100 80GB HBM3"), the L40S and L40 before the L4. fp32 is taken as half.
CUDA_PEAKS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "4090": 165e12,
    "3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}
CUDA_PEAK_UNKNOWN = 100e12
NOT_TASKS = (
    "task_acc",
    "train_acc",
    "val_acc",
    "hellaswag_acc",
)  # the evaluation's *_acc figures that are no task's  # a card not in the table: set logging.peak_tflops for a true MFU


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def default_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """A device's nominal peak FLOP/s for MFU when logging.peak_tflops is not set, and what it is. On a CPU it comes
    from what the CPU is, never from a measurement: a probe that ran beside other work read a low rate, and MFU then
    read 143-270%."""
    import torch  # here, so that `python -m quillgpt.metrics --plot` starts without torch

    if device.type == "cuda":
        peak = cuda_peak_flops(torch.cuda.get_device_name(device))
        return (peak if precision in ("bf16", "fp16") else peak / 2), "the card's nominal dense peak"
    # CPU: threads x clock x FLOPs per cycle. fp32: the vector FMA units (two 512-bit FMAs: 64; AVX2, or AMD Zen 4's
    # AVX-512 executed on 256-bit units: 32); bf16 dot products (AVX512-BF16) double it, and Intel's AMX tiles
    # (Sapphire Rapids on) do 1,024 bf16 FLOPs per cycle; elsewhere bf16 is emulated, at fp32's peak at best
    cpuinfo = read_cpuinfo()
    threads, clock = torch.get_num_threads(), cpu_clock_hz(cpuinfo)
    if precision == "bf16" and has_amx_bf16(cpuinfo):
        flops_per_cycle, unit = 1024, "AMX bf16"
    else:
        full_width_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" and not is_amd_zen4(cpuinfo)
        flops_per_cycle, unit = (64, "AVX-512 FMA") if full_width_avx512 else (32, "256-bit FMA")
        if precision == "bf16" and "avx512_bf16" in cpu_flag_set(cpuinfo):
            flops_per_cycle, unit = 2 * flops_per_cycle, "AVX512-BF16 dot products"
    why = f"nominal: {threads} threads x {clock / 1e9:.1f} GHz x {flops_per_cycle} FLOPs a cycle ({unit})"
    return threads * clock * flops_per_cycle, why


def cpu_clock_hz(cpuinfo: str) -> float:
    """The fastest clock this CPU reports (cpufreq's maximum, else /proc/cpuinfo's MHz), at least 3 GHz: MFU's peak
    must bound what the cores can do, boost included."""
    mhz = [float(line.split(":", 1)[1]) for line in cpuinfo.splitlines() if line.startswith("cpu MHz")]
    try:
        mhz.append(int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000)
    except (OSError, ValueError):
        pass
    return max([3000.0, *mhz]) * 1e6


def cpu_flag_set(cpuinfo: str) -> set[str]:
    return set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))


def cuda_peak_flops(name: str) -> float:
    """The dense bf16 peak FLOP/s of the card torch.cuda.get_device_name calls `name` (CUDA_PEAKS)."""
    return next((peak for part, peak in CUDA_PEAKS.items() if part in name), CUDA_PEAK_UNKNOWN)


def matmul_flops(
    width: int, rows: int, dtype: torch.dtype, device: torch.device, repeats: int = 10, max_seconds: float = math.inf
) -> float:
    """FLOP/s of (rows, width) @ (width, 4 * width), a transformer MLP's shape: the best of `repeats` after two
    warm-ups, or of the calls made until `max_seconds` have passed (at least one: a single call that long makes
    start-up costs a rounding error). Every FLOP a model counts is a matmul, so this bounds tokens/s from above."""
    import torch

    a = torch.randn(rows, width, dtype=dtype, device=device)
    b = torch.randn(width, 4 * width, dtype=dtype, device=device)
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        best = min(best, now - t0)
        if now - start > max_seconds:
            break
    return 2 * rows * width * 4 * width / best


def matmul_ceiling(precision: str = "bf16") -> tuple[float, str]:
    """This machine's CPU matmul FLOP/s at the GPU preset's MLP shape ((2048, 384) @ (384, 1536)) in the precision a
    run uses, and that precision ("auto": the one training's auto picks here): the figure speed targets and budgets
    are scaled by. Bounded in time: where bf16 is emulated (no AVX512-BF16 or AMX) each such matmul is hundreds of
    times slower, and a fixed count of them would hold up every run it is measured for."""
    import torch

    from quillgpt.precision import PRECISIONS, measure_cpu_rates

    if precision == "auto":
        precision = measure_cpu_rates(384, 2048).faster
    flops = matmul_flops(384, 2048, PRECISIONS[precision], torch.device("cpu"), repeats=34, max_seconds=1.0)
    return flops, precision


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def is_amd_zen4(cpuinfo: str) -> bool:
    """AMD family 25 (Zen 3/4; only Zen 4 has AVX-512) from /proc/cpuinfo's text."""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:30] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"


def has_amx_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's flags list Intel's AMX bf16 tiles."""
    return "amx_bf16" in cpu_flag_set(cpuinfo)


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        json_log: bool = True,
        plot: bool = True,
        history: list[dict] | None = None,
        assistant_only: bool = False,
        dpo: bool = False,
        loss_name: str | None = None,
    ):
        self.run_dir = run_dir
        self.json_log, self.plot = json_log, plot
        self.assistant_only = assistant_only  # chat data: every loss counts the assistant's tokens only
        self.dpo = dpo  # preference pairs: the loss is DPO's, the evaluations its reward figures
        # what the step lines call the loss (an RL run's: "policy loss"); None: loss, assistant loss on chat data,
        # dpo loss on preference pairs
        self.loss_name = loss_name or ("dpo loss" if dpo else "assistant loss" if assistant_only else "loss")
        self.history: list[dict] = history or []
        self.wandb = None
        self._plotter: subprocess.Popen | None = None

    @classmethod
    def resume(cls, run_dir: Path, upto_iter: int, **kw) -> MetricsLog:
        """Reload train_log.json, dropping points logged after the checkpoint we resume from."""
        history = []
        path = run_dir / "train_log.json"
        if path.is_file():
            try:
                history = [p for p in json.loads(path.read_text())["history"] if p.get("iter", 0) <= upto_iter]
            except (ValueError, KeyError, TypeError):
                history = []
        return cls(run_dir, history=history, **kw)

    def start_wandb(self, project: str, run_name: str, run_id: str | None, config: dict) -> str:
        try:
            import wandb
        except ImportError:
            raise UserError("logging.wandb_project is set but wandb is not installed: pip install '.[wandb]'") from None
        run_id = run_id or uuid.uuid4().hex[:8]  # stored in the checkpoint so a resumed run continues it
        self.wandb = wandb.init(
            project=project, name=run_name, id=run_id, resume="allow", config=config, dir=str(self.run_dir)
        )
        return run_id

    def step(
        self,
        it: int,
        max_iters: int | None,
        loss: float,
        lr: float,
        grad_norm: float,
        seconds_per_step: float,
        tokens_per_s: float,
        mfu: float,
        tokens: int,
        extra: dict[str, float] | None = None,
        eta_s: float | None = None,
    ) -> None:
        """extra: more figures of the step (an RL run's reward), added to the line and the record. max_iters None: no
        step count ends the run (a time budget does, and eta_s says when)."""
        extra = extra or {}
        print(
            format_step_line(
                it,
                max_iters,
                loss,
                lr,
                grad_norm,
                seconds_per_step,
                tokens_per_s,
                mfu,
                (max_iters - it) * seconds_per_step if eta_s is None else eta_s,
                self.loss_name,
            )
            + "".join(f" | {k.replace('_', ' ')} {v:.4g}" for k, v in extra.items()),
            flush=True,
        )
        self.record(
            {
                "kind": "train",
                "iter": it,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "ms_per_iter": seconds_per_step * 1000,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "tokens": tokens,
                **extra,
            }
        )

    def evaluation(self, it: int, metrics: dict[str, float], improved: bool, tokens: int) -> None:
        hellaswag = f" | hellaswag {metrics['hellaswag_acc_norm']:.4f}" if "hellaswag_acc_norm" in metrics else ""
        hellaswag += f" | CORE {metrics['core']:.4f}" if "core" in metrics else ""
        if "task_acc" in metrics:  # an RL run's validation accuracy, per task
            tasks = [k.removesuffix("_acc") for k in metrics if k.endswith("_acc") and k not in NOT_TASKS]
            hellaswag += (
                f" | val acc {metrics['task_acc']:.3f} ("
                + ", ".join(f"{t} {metrics[t + '_acc']:.3f}" for t in tasks)
                + ")"
            )
        print(
            (dpo_evaluation_line(it, metrics) if self.dpo else evaluation_line(it, metrics, self.assistant_only))
            + hellaswag
            + (" *best" if improved else ""),
            flush=True,
        )
        self.record({"kind": "eval", "iter": it, **metrics, "tokens": tokens})

    def record(self, point: dict) -> None:
        self.history.append(point)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in point.items() if k not in ("iter", "kind")}, step=point["iter"])

    def flush(self) -> None:
        """Write train_log.json and the loss curve (atomically). A failed write (disk full) is only a warning:
        the log is not training state, the old files stay intact and the next flush rewrites them whole."""
        try:
            if self.json_log:
                atomic_write_json(self.run_dir / "train_log.json", {"history": self.history})
            if self.plot:
                self.write_plot()
        except (WriteError, OSError) as e:  # OSError: the plotting child could not be started
            print(f"warning: training log not saved: {e}", file=sys.stderr, flush=True)

    def write_plot(self) -> None:
        """Redraw loss_curve.png (and an MoE run's router_balance.png) in a child process (`python -m quillgpt.metrics
        --plot`), in the background.

        matplotlib's renderer grows a long-lived process's resident memory with each redraw of a lengthening
        curve (a soak of train.py showed it; docs/LOG.md); a child's memory goes with it, and training
        doesn't wait for the drawing. While a redraw is under way, later ones are skipped (each draws the whole
        history; finish() draws the last). Its own session: Ctrl-C in the terminal is for train.py alone."""
        if self._plotter is not None and self._plotter.poll() is None:
            return
        points = [p for p in self.history if p["kind"] in ("train", "eval")]
        png = (self.run_dir / "loss_curve.png").resolve()
        cmd = [sys.executable, "-m", "quillgpt.metrics", "--plot", str(png), self.run_dir.name]
        self._plotter = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).resolve().parents[1]
        )
        with self._plotter.stdin as pipe:  # the child reads it all before importing matplotlib
            pipe.write(json.dumps(points))

    def wait_for_plot(self) -> None:
        if self._plotter is not None:
            self._plotter.wait()
            self._plotter = None

    def finish(self) -> None:
        self.wait_for_plot()
        self.flush()
        self.wait_for_plot()
        if self.wandb is not None:
            self.wandb.finish()


def evaluation_line(it: int, metrics: dict[str, float], assistant_only: bool) -> str:
    return (
        f"eval {it}{' (assistant tokens)' if assistant_only else ''}: train {metrics['train_loss']:.4f} | "
        f"val {metrics['val_loss']:.4f} "
        f"(ppl {metrics['val_ppl']:.2f}, acc {metrics['val_acc']:.3f}, {metrics['val_bpb']:.4f} bits/byte)"
    )


def dpo_evaluation_line(it: int, metrics: dict[str, float]) -> str:
    """An evaluation on preference pairs: the DPO losses, and val's rewards (beta x each side's log-prob gain over
    the reference): how often the chosen one's is higher, the mean margin, each side's mean."""
    return (
        f"eval {it} (DPO pairs): train {metrics['train_loss']:.4f} | val {metrics['val_loss']:.4f} (reward acc "
        f"{metrics['val_reward_acc']:.3f}, margin {metrics['val_reward_margin']:.4f}; chosen "
        f"{metrics['val_chosen_reward']:+.4f}, rejected {metrics['val_rejected_reward']:+.4f})"
    )


def render_loss_curve(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display, no browser
    import matplotlib.pyplot as plt

    train = [(p["iter"], p["loss"]) for p in history if p["kind"] == "train"]
    evals = [p for p in history if p["kind"] == "eval"]
    rewards = [(p["iter"], p["reward"]) for p in history if p["kind"] == "train" and "reward" in p]
    scores = [
        (key, label)
        for key, label in (
            ("val_bpb", "val bits per byte"),
            ("val_reward_acc", "val reward accuracy (DPO)"),
            ("hellaswag_acc_norm", "HellaSwag acc_norm"),
            ("core", "CORE (centred)"),
        )
        if any(key in p for p in evals)
    ]
    if rewards:  # an RL run: its reward and held-out accuracy, against steps
        scores = [("rl", "reward and held-out accuracy")]
    fig, axes = plt.subplots(1, 1 + bool(scores), figsize=(7 + 5 * bool(scores), 4), dpi=100, squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train (step)", alpha=0.4, linewidth=1)
    if evals:
        ax.plot([p["iter"] for p in evals], [p["train_loss"] for p in evals], "o-", label="train (eval)")
        ax.plot([p["iter"] for p in evals], [p["val_loss"] for p in evals], "o-", label="val")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    if rewards:
        draw_rl(axes[0][1], rewards, evals)
    elif scores:  # the figures runs are compared by, each on its own axis
        draw_scores(axes[0][1], evals, scores)
    save_png(fig, path)


def render_router_balance(history: list[dict], path: Path, title: str) -> None:
    """An MoE run's router at each logged step (trainer.step_figures): the most tokens an expert got over the mean
    (the worst layer's; 1 is an even load), and the layers' mean aux loss and z-loss (unweighted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in history if p["kind"] == "train" and "expert_load" in p]
    steps = [p["iter"] for p in points]
    fig, (load, losses) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
    load.plot(steps, [p["expert_load"] for p in points], linewidth=1, label="busiest expert / mean (worst layer)")
    load.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="even load")
    load.set(xlabel="iteration", ylabel="tokens per expert, max / mean", title=f"{title}: router balance")
    for key, label in (("aux_loss", "aux loss (Switch; k when even)"), ("z_loss", "router z-loss")):
        losses.plot(steps, [p[key] for p in points], linewidth=1, label=label)
    losses.set(xlabel="iteration", title="router losses (unweighted, mean over layers)")
    for ax in (load, losses):
        ax.grid(alpha=0.3)
        ax.legend()
    save_png(fig, path)


def save_png(fig, path: Path) -> None:
    """Write a figure as a PNG, atomically (a reader never sees half a file), and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    with atomic_write(path, "wb") as f:
        f.write(buf.getvalue())


def draw_rl(ax, rewards: list[tuple[int, float]], evals: list[dict]) -> None:
    """An RL run's mean reward (each logged step) and held-out accuracy per task (each evaluation), on one axis."""
    ax.plot(*zip(*rewards), label="mean reward (sampled replies)", alpha=0.6, linewidth=1)
    tasks = sorted({k for p in evals for k in p if k.endswith("_acc") and k not in NOT_TASKS})
    for i, key in enumerate(tasks):
        points = [(p["iter"], p[key]) for p in evals if key in p]
        ax.plot(*zip(*points), "o-", color=f"C{i + 2}", label=f"held-out {key.removesuffix('_acc')} accuracy (greedy)")
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("reward and held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend()


def draw_scores(ax, evals: list[dict], scores: list[tuple[str, str]]) -> None:
    axis = ax
    for i, (key, label) in enumerate(scores):
        if i:
            axis = ax.twinx()
        points = [(p["iter"], p[key]) for p in evals if key in p]
        axis.plot(*zip(*points), "o-", color=f"C{i + 2}", label=label)
        axis.set_ylabel(label, color=f"C{i + 2}")
    ax.set_xlabel("iteration")
    ax.set_title("evaluations")
    ax.grid(alpha=0.3)


def format_step_line(
    it: int,
    max_iters: int | None,
    loss: float,
    lr: float,
    grad_norm: float,
    dt: float,
    tokens_per_s: float,
    mfu: float,
    eta_s: float,
    loss_name: str = "loss",
) -> str:
    return (
        f"iter {it:>6}{f'/{max_iters}' if max_iters else ''} | {loss_name} {loss:.4f} | lr {lr:.2e} | norm {grad_norm:.2f} | "
        f"{dt * 1000:.1f} ms | {tokens_per_s:,.0f} tok/s | {mfu_text(mfu)} | eta {format_duration(eta_s)}"
    )


def mfu_text(mfu: float) -> str:
    """`mfu 41.3%`; never above 100%, which would say the peak is wrong (logging.peak_tflops below the device's)."""
    return f"mfu {mfu * 100:.1f}%" if mfu <= 1 else "mfu over 100% (logging.peak_tflops is below this device's peak)"


def rss_mb() -> float:
    """Resident set size of this process in MB (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 1e6


def main() -> None:
    """`python -m quillgpt.metrics --plot PNG TITLE < history.json`: what MetricsLog.write_plot runs."""
    if sys.argv[1:2] != ["--plot"] or len(sys.argv) != 4:
        raise UserError("usage: python -m quillgpt.metrics --plot PNG TITLE < history.json")
    history = json.load(sys.stdin)
    png = Path(sys.argv[2])
    try:
        render_loss_curve(history, png, sys.argv[3])
        if any("expert_load" in p for p in history):  # an MoE run: router_balance.png beside the loss curve
            render_router_balance(history, png.with_name("router_balance.png"), sys.argv[3])
    except WriteError as e:
        print(f"warning: loss curve not saved: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_main(main)
