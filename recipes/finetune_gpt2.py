"""Fine-tune GPT2 (causal LM) with pipeline parallelism and AQ-SGD-compressed stage boundaries.

    deepspeed --num_gpus 2 recipes/finetune_gpt2.py [--deepspeed_config recipes/configs/gpt2.json]
    torchrun --nproc_per_node 2 recipes/finetune_gpt2.py
    python recipes/finetune_gpt2.py

Defaults need no hub: a tiny GPT2 shape on the Shakespeare plays, one pipeline stage per process.
"""
from pathlib import Path

from aqpipe.runner import Task, main

TASK = Task(kind="causal_lm", family="gpt2", default_dataset=None)

if __name__ == "__main__":
    main(TASK, Path(__file__).with_name("configs") / "gpt2.json", __doc__)
