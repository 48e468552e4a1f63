"""Fine-tune DeBERTa (sequence classification) with pipeline parallelism and AQ-SGD-compressed boundaries.

    deepspeed --num_gpus 2 recipes/finetune_deberta.py [--deepspeed_config my.json]
    torchrun --nproc_per_node 2 recipes/finetune_deberta.py --dataset next_line
    python recipes/finetune_deberta.py

Defaults need no hub: a tiny DeBERTa-v2 shape on the built-in acceptability task (real Shakespeare
lines against the same lines with their words shuffled); `--dataset next_line` is the pair task.
The installed package runs the same job from anywhere: `aqpipe deberta` (or `python -m aqpipe deberta`).
"""
import sys

from aqpipe.cli import finetune, leave
from aqpipe.tasks import TASKS

if __name__ == "__main__":
    finetune(TASKS["deberta"], sys.argv[1:], __doc__)
    leave(0)  # finished: skip Python's teardown of torch's and transformers' objects
