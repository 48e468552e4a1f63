"""Convergence of FP32, DirectQ and AQ-SGD boundaries on the same recipe, seed and data order.

Every sample is revisited once per epoch, so over many epochs AQ-SGD's per-sample buffers have
something to pay off on; DirectQ at the same bits has no memory and keeps its full quantization
error. Each (model, method) is one 2-stage torchrun run of the real recipe; this script reads
their metrics.jsonl, prints the table as markdown, writes JSON and one loss-vs-step PNG per model.

    python -m benchmarks.convergence                       # 14 runs, ~40 min on 2 idle CPU cores
    python -m benchmarks.convergence --models gpt2 --tag ablation --reuse \
        --methods fp32,aqsgd_2_4,aqsgd_2_fp32bw,fp32fw_directq_4bw,directq_2_4
    python -m benchmarks.convergence --models gpt2 --tag pretrained --methods fp32,aqsgd_2_4,directq_2_4 \
        -- --model runs/pretrain_gpt2/model --lr 3e-4          # after an FP32 pretraining run (RESULTS.md)
    python -m benchmarks.convergence --models llama --tag pretrained --methods fp32,aqsgd_2_4,directq_2_4 \
        -- --model runs/pretrain_llama/model --dataset runs/docstrings.txt --lr 3e-4   # pretrained on the plays,
                                                       # fine-tuned on another corpus (benchmarks/docstring_corpus.py)
    python -m benchmarks.convergence --quick --output_dir /tmp/conv   # seconds, for the tests
    python -m benchmarks.convergence --replot                # redraw the PNGs from the JSON only
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aqpipe.config import RunConfig
from aqpipe.settings import build, nest
from aqpipe.flags import build_parser, given
from benchmarks.convergence_plot import plot_model
from benchmarks.recipe_runs import ROOT, read_run, run_recipe

BIT_PAIRS = ((2, 4), (3, 6), (4, 8))


@dataclass(frozen=True)
class Method:
    """One boundary setting: what the forward and backward codecs send, at which bits (None: full precision)."""

    name: str
    label: str
    forward: str
    forward_bits: int | None
    backward: str
    backward_bits: int | None
    extra: tuple[str, ...] = ()  # further recipe flags (e.g. --buffer_bits 8)

    def flags(self) -> list[str]:
        flags = ["--forward_compress", self.forward, "--backward_compress", self.backward]
        for side, bits in (("forward", self.forward_bits), ("backward", self.backward_bits)):
            if bits is not None:  # "none" ignores bits: the config's defaults stay
                flags += [f"--{side}_bits", str(bits)]
        return flags + list(self.extra)


METHODS = [Method("fp32", "FP32", "none", None, "none", None)] + [
    Method(f"{kind}_{fw}_{bw}", f"{label} fw{fw}/bw{bw}", forward, fw, "direct", bw)
    for fw, bw in BIT_PAIRS
    for kind, label, forward in (("directq", "DirectQ", "direct"), ("aqsgd", "AQ-SGD", "aqsgd"))
]
# ablations, only when named in --methods: which side of AQ-SGD fw2/bw4 costs the accuracy
ABLATIONS = [
    Method("aqsgd_2_fp32bw", "AQ-SGD fw2 / FP32 bw", "aqsgd", 2, "none", None),
    Method("fp32fw_directq_4bw", "FP32 fw / DirectQ bw4", "none", None, "direct", 4),
] + [  # beyond the paper: AQ-SGD with quantized buffers
    Method(f"aqsgd_{fw}_{bw}_buf{b}", f"AQ-SGD fw{fw}/bw{bw}, {b}-bit buffers", "aqsgd", fw, "direct", bw,
           ("--buffer_bits", str(b)))
    for fw, bw in BIT_PAIRS[:2] for b in (8, 4)
] + [  # dropout off on every stage (the dropout study: AQ-SGD's change cannot shrink below dropout's noise)
    Method("fp32_nodropout", "FP32, dropout 0", "none", None, "none", None, ("--dropout", "0")),
    Method("aqsgd_2_4_nodropout", "AQ-SGD fw2/bw4, dropout 0", "aqsgd", 2, "direct", 4, ("--dropout", "0")),
] + [  # and the cache-free codec: a randomized Hadamard rotation, then the same quantizer as DirectQ
    Method(f"hadamard_{fw}_{bw}", f"Hadamard fw{fw}/bw{bw}", "hadamard", fw, "direct", bw) for fw, bw in BIT_PAIRS[:2]
]


@dataclass(frozen=True)
class Model:
    """A recipe and the settings that make its study fit the time budget (see RESULTS.md for why)."""

    script: str
    metric: str  # the summary's eval metric besides eval_loss: perplexity or accuracy
    args: tuple[str, ...]


MODELS = {
    # 512 samples x 128 tokens, 10 epochs = 320 steps of 16 samples: every sample seen 10 times; about
    # 3 min a run on 2 idle cores, 7 runs ~20 min. FP32's eval loss still falls (slowly) at epoch 10.
    "gpt2": Model("finetune_gpt2.py", "perplexity",
                  ("--seq_len", "128", "--max_train_samples", "512", "--max_eval_samples", "128", "--epochs", "10")),
    # the same study on the Llama lineage: `aqpipe causal-lm` (without --model: a tiny tied Llama shape)
    "llama": Model("aqpipe causal-lm", "perplexity",
                   ("--seq_len", "128", "--max_train_samples", "512", "--max_eval_samples", "128", "--epochs", "10")),
    # real verse lines vs the same words shuffled; 1024 samples x 64 tokens, 8 epochs = 512 steps of 16,
    # about 2.5 min a run. More samples than GPT2: one label per sample teaches less than one per token
    # (256 samples x 2 epochs stayed at chance accuracy).
    "deberta": Model("finetune_deberta.py", "accuracy",
                     ("--dataset", "acceptability", "--seq_len", "64", "--max_train_samples", "1024",
                      "--max_eval_samples", "256", "--epochs", "8")),
}
QUICK_ARGS = ("--seq_len", "32", "--max_train_samples", "32", "--max_eval_samples", "8", "--epochs", "2",
              "--micro_batch_size", "2", "--num_micro_batches", "2")
QUICK_METHODS = "fp32,aqsgd_2_4"


def flag_value(args: list[str] | tuple[str, ...], flag: str, default: str | None = None) -> str | None:
    """The value of the last `flag` in an argument list (later flags override earlier ones, as argparse does)."""
    value = default
    for i, a in enumerate(args[:-1]):
        if a == flag:
            value = args[i + 1]
    return value


def summarize(records: list[dict[str, Any]], summary: dict[str, Any], metric: str) -> dict[str, Any]:
    """One run's figures: train loss as the mean over its last epoch, eval loss and metric at the end."""
    steps = [r for r in records if "loss" in r]
    per_epoch = max(1, sum(1 for r in steps if r["epoch"] == steps[-1]["epoch"]))
    evals = [r for r in records if "eval_loss" in r]
    return {
        "steps": len(steps), "steps_per_epoch": per_epoch,
        "train_loss": statistics.mean(r["loss"] for r in steps[-per_epoch:]),
        "eval_loss": summary["eval_loss"], f"eval_{metric}": summary[f"eval_{metric}"],
        "fwd_bytes": summary["fwd_bytes"], "bwd_bytes": summary["bwd_bytes"], "seconds": summary["seconds"],
        "step_seconds": statistics.median(r["seconds"] for r in steps),  # the training step alone, no eval
        # AQ-SGD's relative change ||a - m|| / ||a||, the mean over each epoch's steps (none before a first revisit)
        "change_by_epoch": [round(statistics.mean(changes), 4) if changes else None for changes in
                            ([r["fwd_change"] for r in steps if r["epoch"] == e and r.get("fwd_change") is not None]
                             for e in sorted({r["epoch"] for r in steps}))],
        "loss": [round(r["loss"], 4) for r in steps],  # 4 decimals: the JSON stays small enough to commit
        "eval_curve": [[r["step"], r["eval_loss"], r.get(f"eval_{metric}")] for r in evals],
    }


def add_ratios(runs: list[dict[str, Any]], metric: str) -> None:
    """Each run's train loss, eval loss and metric over FP32's (when FP32 is among the runs)."""
    base = next((r for r in runs if r["method"] == "fp32"), None)
    for r in runs:
        for key in ("train_loss", "eval_loss", f"eval_{metric}"):
            r[f"{key}_ratio"] = r[key] / base[key] if base and base[key] else None


def markdown_table(model: str, runs: list[dict[str, Any]], metric: str) -> str:
    """The table RESULTS.md pastes: one row per method, each figure beside its ratio to FP32."""
    head = (f"| {model} boundary | train loss (last epoch) | vs FP32 | eval loss | vs FP32 | eval {metric} "
            f"| vs FP32 | forward MB | backward MB | s/step |")
    lines = [head, "|" + "---|" * 10]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for r in runs:
        lines.append(
            f"| {r['label']} | {r['train_loss']:.3f} | {ratio(r['train_loss_ratio'])} | {r['eval_loss']:.3f} "
            f"| {ratio(r['eval_loss_ratio'])} | {r[f'eval_{metric}']:.{1 if metric == 'perplexity' else 3}f} "
            f"| {ratio(r[f'eval_{metric}_ratio'])} "
            f"| {r['fwd_bytes'] / 1e6:.1f} | {r['bwd_bytes'] / 1e6:.1f} | {r.get('step_seconds', 0):.3f} |")
    return "\n".join(lines)


def goal(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals: AQ-SGD fw2/bw4 within 2% of FP32's eval loss (from scratch), within 0.5% from a pretrained start;
    DirectQ fw2/bw4 visibly worse."""
    by = {r["method"]: r for r in runs}
    aq, dq = by.get("aqsgd_2_4", {}).get("eval_loss_ratio"), by.get("directq_2_4", {}).get("eval_loss_ratio")
    return {"aqsgd_2_4_eval_ratio": aq, "directq_2_4_eval_ratio": dq,
            "aqsgd_within_2pct": None if aq is None else aq <= 1.02,
            "aqsgd_within_half_pct": None if aq is None else aq <= 1.005,
            "directq_worse_than_aqsgd": None if aq is None or dq is None else dq > aq}


def run_model(name: str, model: Model, methods: list[Method], extra: list[str], out: Path,
              seed: int, reuse: bool) -> dict[str, Any]:
    """Every method on one model, same seed and data; returns its JSON block."""
    args = [*model.args, *extra, "--seed", str(seed)]
    per_epoch_eval = _steps_per_epoch(args)
    args += ["--eval_every", str(per_epoch_eval)]  # eval curve once an epoch: shows over-fitting if any
    runs = []
    for method in methods:
        run_dir = out / name / method.name
        if reuse and (run_dir / "summary.json").exists() and _same_config(run_dir, args + method.flags()):
            records, summary = read_run(run_dir)
        else:
            records, summary = run_recipe(model.script, args + method.flags(), run_dir)
        row = {"method": method.name, "label": method.label, "forward": method.forward,
               "forward_bits": method.forward_bits, "backward": method.backward,
               "backward_bits": method.backward_bits, "extra": list(method.extra),
               **summarize(records, summary, model.metric)}
        runs.append(row)
        print(f"  {name:<8} {method.label:<18} train {row['train_loss']:.4f}  eval {row['eval_loss']:.4f}  "
              f"{model.metric} {row[f'eval_{model.metric}']:.3f}  {row['seconds']:.0f} s", flush=True)
    add_ratios(runs, model.metric)
    script = f"recipes/{model.script}" if model.script.endswith(".py") else f"-m {model.script}"
    return {"script": script, "args": args, "metric": model.metric, "runs": runs,
            "goal": goal(runs)}


def _steps_per_epoch(args: list[str]) -> int:
    samples = int(flag_value(args, "--max_train_samples", "0"))
    batch = int(flag_value(args, "--micro_batch_size", "4")) * int(flag_value(args, "--num_micro_batches", "4"))
    return max(1, samples // batch) if samples else 0


def _same_config(run_dir: Path, args: list[str]) -> bool:
    """Whether a finished run used these flags (so --reuse never mixes settings): the flags parsed as the trainer
    parses them, compared with the settings its summary recorded (one written before the settings had sections
    nested as the trainer nests such a file)."""
    config = nest(json.loads((run_dir / "summary.json").read_text())["config"])
    flags = given(build_parser(RunConfig, "").parse_known_args(args)[0])
    wanted = build(config["task"], flags).to_dict()
    for key, value in flags.items():
        keys = value if isinstance(value, dict) else {key: value}
        place, mine = (config.get(key, {}), wanted[key]) if isinstance(value, dict) else (config, wanted)
        if any(json.loads(json.dumps(mine[k])) != place.get(k, mine[k]) for k in keys):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,deberta", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--methods", default=None,
                   help="comma-separated, from " + ",".join(m.name for m in METHODS + ABLATIONS))
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default="runs/convergence", help="run directories go here")
    p.add_argument("--json", default=None, help="results file (default: benchmarks/results/convergence.json, "
                                                 "or <output_dir>/convergence.json with --quick)")
    p.add_argument("--plot_dir", default=None, help="PNG directory (default: benchmarks/plots, or <output_dir>)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, GPT2, FP32 and AQ-SGD 2/4 (for the tests)")
    p.add_argument("--tag", default="", help="a variant's name: results under <model>_<tag>, plot "
                                            "convergence_<model>_<tag>.png (e.g. pretrained)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs whose summary has the same flags")
    p.add_argument("--replot", action="store_true", help="only redraw the PNGs from the JSON")
    p.add_argument("extra", nargs="*", help="recipe flags after --, applied to every run (e.g. -- --lr 5e-4)")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    local = args.quick
    json_path = (Path(args.json) if args.json
                 else (out if local else ROOT / "benchmarks" / "results") / "convergence.json")
    plot_dir = Path(args.plot_dir) if args.plot_dir else (out if local else ROOT / "benchmarks" / "plots")
    if args.replot:
        results = json.loads(json_path.read_text())
        for name, block in results["models"].items():
            print(plot_model(name, block, plot_dir))
        return 0

    names = args.methods or (QUICK_METHODS if args.quick else ",".join(m.name for m in METHODS))
    known = {m.name: m for m in METHODS + ABLATIONS}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        p.error(f"--methods {','.join(unknown)}: expected names from {','.join(known)}")
    methods = [known[n] for n in names.split(",")]
    models = ["gpt2"] if args.quick and args.models == "gpt2,deberta" else args.models.split(",")
    if bad := [m for m in models if m not in MODELS]:
        p.error(f"--models {','.join(bad)}: expected names from {','.join(MODELS)}")

    command = " ".join(["python", "-m", "benchmarks.convergence", *(sys.argv[1:] if argv is None else argv)])
    # one file for every model: a study of some models replaces their blocks and keeps the others'
    results: dict[str, Any] = json.loads(json_path.read_text()) if json_path.exists() else {"models": {}}
    for name in models:
        model = MODELS[name]
        extra = [*QUICK_ARGS, *args.extra] if args.quick else list(args.extra)
        key = f"{name}_{args.tag}" if args.tag else name
        block = run_model(name, model, methods, extra, out / (args.tag or "."), args.seed, args.reuse)
        results["models"][key] = block = {"command": command, **block}
        print("\n" + markdown_table(key, block["runs"], model.metric) + "\n")
        print(f"goal: {json.dumps(block['goal'])}")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))  # after each model: a later failure keeps this one
        print(plot_model(key, block, plot_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
