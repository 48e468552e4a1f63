"""Loss-vs-step PNG for one model of the convergence study (benchmarks/convergence.py).

Two panels: training loss per step (smoothed over a quarter epoch, since single steps of 16
samples are noisy; the axis fits the epochs after the first) and eval loss (accuracy for a
classifier) at the end of each epoch. FP32 is black, DirectQ red and AQ-SGD
blue, darker and solid at fewer bits, so the eye finds "AQ-SGD 2/4 on FP32, DirectQ 2/4 above".

    python -m benchmarks.convergence --replot      # redraw from benchmarks/results/convergence.json
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on the benchmark machines
import matplotlib.pyplot as plt  # noqa: E402

LINES = {2: ("-", 1.0), 3: ("--", 0.75), 4: (":", 0.6)}  # forward bits -> line style, colour strength
COLOURS = {"none": "black", "direct": "tab:red", "aqsgd": "tab:blue", "hadamard": "tab:purple"}  # by forward codec
MAIN = ("fp32", "aqsgd_2_4", "directq_2_4")


def line_style(run: dict[str, Any]) -> dict[str, Any]:
    """Colour by forward codec, dash by bits; ablations (one side at full precision) green or grey, dash-dot."""
    if (run["forward"] == "none") != (run["backward"] == "none"):
        dash, alpha = "-.", 1.0
        colour = "tab:green" if run["forward"] == "aqsgd" else "tab:gray"
    else:
        dash, alpha = LINES.get(run["forward_bits"] or 2, ("-", 1.0))
        colour = COLOURS[run["forward"]]
        if run.get("extra"):  # a variant of the codec (quantized buffers, dropout off): a lighter shade
            colour = {"tab:blue": "tab:cyan", "black": "tab:gray"}.get(colour, colour)
    return {"color": colour, "linestyle": dash, "alpha": alpha, "label": run["label"],
            "linewidth": 1.6 if run["method"] in MAIN else 1.1}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (shorter at the start), so the curve starts at step 1."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_model(name: str, block: dict[str, Any], plot_dir: Path) -> Path:
    """Write <plot_dir>/convergence_<name>.png from the model's JSON block; returns its path."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    accuracy = block.get("metric") == "accuracy"
    later = []  # the curves after the first epoch, whose differences the plot is for
    for run in block["runs"]:
        kw = line_style(run)
        window = max(1, run["steps_per_epoch"] // 4)
        curve = smooth(run["loss"], window)
        later += curve[run["steps_per_epoch"]:]
        train_ax.plot(range(1, len(run["loss"]) + 1), curve, **kw)
        if run["eval_curve"]:  # classification: accuracy, since an over-fit classifier's eval loss swings
            steps, values = zip(*[(s, metric if accuracy else loss) for s, loss, metric in run["eval_curve"]])
            eval_ax.plot(steps, values, marker="o", markersize=2.5, **kw)
    train_ax.set(title=f"{name}: training loss (mean of {window} steps)", xlabel="step", ylabel="loss")
    if later:  # the first epoch's steep fall would flatten everything else
        low, high = min(later), max(later)
        train_ax.set_ylim(low - 0.05 * (high - low), high + 0.25 * (high - low))
    shown = "eval accuracy" if accuracy else "eval loss"
    eval_ax.set(title=f"{name}: {shown}, once an epoch", xlabel="step", ylabel=shown)
    for ax in (train_ax, eval_ax):
        ax.grid(alpha=0.3)
    eval_ax.legend(fontsize=8)
    fig.tight_layout()
    path = plot_dir / f"convergence_{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
