"""TRL's step metrics beside aqpipe's on the same batch: loss, mean_token_accuracy and num_tokens of step 1.

One batch holds every row (64 conversational prompt/completion rows, chatml, the loss on the completion), so the
data order cannot differ; a tiny tied Llama with the built-in BPE tokenizer, random weights, float32, one process.
TRL 1.x's SFTTrainer (`pip install trl`, not a dependency of aqpipe) against `aqpipe.finetune` on a 1-stage and a
2-stage pipeline (uncompressed, so the figures are the model's). Prints one JSON object.

    python -m benchmarks.trl_metrics --json benchmarks/results/trl_metrics.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = 64
JOB = '''
import json, sys
import datasets, aqpipe
rows = [json.loads(line) for line in open(sys.argv[2])]
aqpipe.finetune("causal-lm", model=sys.argv[1], dataset=datasets.Dataset.from_list(rows), seq_len=128,
                micro_batch_size=len(rows) // int(sys.argv[4]), num_micro_batches=int(sys.argv[4]), max_steps=1,
                lr=1e-9, output_dir=sys.argv[3], eval_dataset=sys.argv[2], forward_compress="none",
                backward_compress="none", lr_scheduler_type="constant")
'''


def rows() -> list[dict]:
    """Conversational prompt/completion rows of words from the built-in plays, of varied lengths."""
    from aqpipe import data

    words = data.fetch_shakespeare().read_text().split()[:5000]
    out = []
    for i in range(ROWS):
        ask, say = words[i * 37: i * 37 + 5 + i % 11], words[i * 53 + 9: i * 53 + 12 + i % 17]
        out.append({"prompt": [{"role": "user", "content": " ".join(ask)}],
                    "completion": [{"role": "assistant", "content": " ".join(say)}]})
    return out


def model_dir(path: Path, pretrained: str | None) -> Path:
    """`pretrained` (a causal LM's directory) with a chatml template on its tokenizer, else a tiny random Llama."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe import data

    if pretrained is not None:
        shutil.copytree(pretrained, path)
        tok = data.apply_chat_template_setting(data.load_tokenizer(str(path)), "chatml")
        tok.save_pretrained(path)
        return path
    tok = data.apply_chat_template_setting(data.load_tokenizer(None), "chatml")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def trl_step(model: Path, data_file: Path, out: Path) -> dict:
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    table = datasets.load_dataset("json", data_files=str(data_file), split="train")
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=ROWS, gradient_accumulation_steps=1,
                     max_steps=1, learning_rate=1e-9, logging_steps=1, report_to="none", max_length=128,
                     use_cpu=True, save_strategy="no", lr_scheduler_type="constant", dataloader_drop_last=False)
    trainer = SFTTrainer(model=str(model), args=args, train_dataset=table,
                         processing_class=AutoTokenizer.from_pretrained(model))
    trainer.train()
    logged = trainer.state.log_history[0]
    return {k: logged[k] for k in ("loss", "mean_token_accuracy", "num_tokens")}


def aqpipe_step(model: Path, data_file: Path, out: Path, stages: int) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    script = out.parent / "job.py"
    script.write_text(JOB)
    launch = [sys.executable] if stages == 1 else ["torchrun", "--nproc_per_node", str(stages), "--master_port",
                                                   "29533"]
    proc = subprocess.run([*launch, str(script), str(model), str(data_file), str(out), "1"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"aqpipe at {stages} stages failed:\n{proc.stderr[-3000:]}")
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {k: first[k] for k in ("loss", "mean_token_accuracy", "num_tokens", "target_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--model", help="a causal LM's directory (default: a tiny random Llama, whose argmax predicts "
                                        "almost nothing)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data_file = model_dir(root / "model", args.model), root / "rows.jsonl"
        data_file.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        result = {"rows": ROWS, "model": args.model or "tiny random Llama", "trl": trl_step(model, data_file,
                                                                                          root / "trl")}
        for stages in (1, 2):
            result[f"aqpipe_{stages}_stage"] = aqpipe_step(model, data_file, root / f"aqpipe{stages}" / "out", stages)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
