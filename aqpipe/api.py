"""`aqpipe.finetune`: one job from a user's script, as HF's Trainer is called, on every rank alike.

    import aqpipe
    summary = aqpipe.finetune("causal-lm", model="path/to/Qwen2.5-0.5B", dataset=my_dataset,
                              forward_bits=2, dp_algorithm="qadam", output_dir="runs/mine")

Settings are the flags' names with Python values (or text, parsed as the flag parses it); `config` names a
DeepSpeed-style JSON file beneath them. Bad input raises ValueError with the line the command line prints.
"""
from __future__ import annotations

from typing import Any

from . import trainer_flags
from .flags import SECTION_SHORTHANDS, layer, settings
from .tasks import TASKS


def flag_destinations() -> dict[str, str]:
    """Each flag's name, and HF's and TRL's for it (its field's `hf`) -> where it lands ("field", or
    "section.field")."""
    from .config import RunConfig  # deferred: the flag table answers without torch

    return {name: dest for dest, f, _ in settings(RunConfig)
            for name in (f.metadata.get("flag", f.name), *f.metadata.get("hf", ()))}


def as_layer(values: dict[str, Any]) -> dict[str, Any]:
    """Settings by flag name as a config layer: top-level fields by name, section fields as {"section": {...}}."""
    dests = {**flag_destinations(), **{name: name for name in (*SECTION_SHORTHANDS, *trainer_flags.FLAGS,
                                                                "use_peft")}}
    unknown = [name for name in values if name not in dests]
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}: expected a flag's name without its dashes "
                         f"(aqpipe TASK --help lists them), e.g. {', '.join(list(dests)[:4])}")
    seen: dict[str, str] = {}
    for name in values:
        if (other := seen.setdefault(dests[name], name)) != name:
            raise ValueError(f"{other} and {name} are the same setting: expected one of them")
    return layer({dests[name]: "latest" if dests[name].endswith("resume") and value is True else value
                  for name, value in values.items()})


def finetune(task: str, *, model: str | None = None, dataset: Any = None, config: str | None = None,
             **settings_: Any) -> dict[str, Any]:
    """Run one fine-tune and return its summary (the JSON line the command line prints: steps, final_loss, eval
    figures, bytes per wire). `dataset`: a hub name, a local file, a built-in name, or a `datasets.Dataset` /
    `DatasetDict` (its own train and validation splits). Call it on every rank under torchrun or deepspeed, or in
    one process."""
    from . import config_file  # deferred: `import aqpipe` starts without torch
    from .settings import finalize  # deferred: as above
    from .train import run  # deferred: as above

    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    chosen = TASKS[task]
    also = [name for name in settings_ if flag_destinations().get(name) == "data.dataset"]
    if dataset is not None and also:
        raise ValueError(f"dataset and {also[0]} are the same setting: expected one of them")
    named = {"model": model, **({"dataset": dataset} if isinstance(dataset, str) else {})}
    layer = as_layer({**{k: v for k, v in named.items() if v is not None}, **settings_})
    cfg = finalize(chosen.kind, [chosen.defaults, config_file.read(config) if config else {}, layer])
    return run(chosen, cfg, f"aqpipe.finetune({task!r})", data=None if isinstance(dataset, str) else dataset)
