"""Fine-tune GPT2 (causal LM) with pipeline parallelism and AQ-SGD-compressed stage boundaries.

    deepspeed --num_gpus 2 recipes/finetune_gpt2.py [--deepspeed_config my.json]
    torchrun --nproc_per_node 2 recipes/finetune_gpt2.py
    python recipes/finetune_gpt2.py

Defaults need no hub: a tiny GPT2 shape on the Shakespeare plays, one pipeline stage per process.
The installed package runs the same job from anywhere: `aqpipe gpt2` (or `python -m aqpipe gpt2`).
"""
import sys

from aqpipe.cli import finetune, leave
from aqpipe.tasks import TASKS

if __name__ == "__main__":
    finetune(TASKS["gpt2"], sys.argv[1:], __doc__)
    leave(0)  # finished: skip Python's teardown of torch's and transformers' objects
