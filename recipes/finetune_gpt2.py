"""Fine-tune GPT2 (causal LM) with pipeline parallelism and AQ-SGD-compressed stage boundaries.

    deepspeed --num_gpus 2 recipes/finetune_gpt2.py [--deepspeed_config recipes/configs/gpt2.json]
    torchrun --nproc_per_node 2 recipes/finetune_gpt2.py --pipeline_stages 2
    python recipes/finetune_gpt2.py --pipeline_stages 1

Defaults need no hub: a tiny GPT2 shape on the Shakespeare plays, 2 stages from the config file.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for any launcher

from recipes.config import resolve  # noqa: E402
from recipes.runner import Task, run  # noqa: E402

TASK = Task(kind="causal_lm", family="gpt2", default_dataset=None)
DEFAULT_CONFIG = Path(__file__).with_name("configs") / "gpt2.json"


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--deepspeed_config", "--config") for a in argv):
        argv = ["--deepspeed_config", str(DEFAULT_CONFIG), *argv]
    return run(TASK, resolve(TASK.kind, argv, __doc__))


if __name__ == "__main__":
    main()
