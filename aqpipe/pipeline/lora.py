"""LoRA adapters inside each stage, through PEFT: the base frozen in its checkpoint's dtype, only the adapters train.

    config = lora_config(LlamaForCausalLM, hf_config, LoraSettings(rank=16))  # resolved on the whole model
    add_lora(stage, config, seed=0, dtype=torch.float32)                      # each rank, its stage

`lora_config` resolves PEFT's choices once, on the whole model (on the meta device): its default target modules
per architecture, `all-linear`, a target that matches nothing. Every stage then adapts what PEFT would adapt in the
unpartitioned model. `add_lora` injects PEFT's own LoRA layers into one stage (`peft.inject_adapter_in_model`) and
seeds each adapter by its module's name, so the initial values are the same on any stage count (as
`pipeline.loading` seeds weights). Everything else is frozen except the task's new head (a classifier, which a
base checkpoint lacks: PEFT's `modules_to_save`), and the trainable weights are cast to `dtype`.

The stage's `hf_state_dict()` then folds each adapter into its base weight (the merged model: adapters.py, which
also gives the trained tensors under the names `PeftModel.save_pretrained` writes).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from .adapters import ADAPTER, LoraSettings, adapted_paths, seed_adapters
from .loading import meta_model
from .partitioning import block_ranges, model_family, stage_block_counts



def _linear_names(model: nn.Module) -> list[str]:
    """The last name of every linear layer (nn.Linear, GPT2's Conv1D): what a target may name."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))})


def lora_config(model_class: type, hf_config: Any, settings: LoraSettings, train_head: bool = False,
                stages: int = 1, partition: str | list[int] = "parameters") -> Any:
    """PEFT's `LoraConfig` for `model_class(hf_config)`, its targets resolved on the whole model and kept to the
    blocks (the parts every stage holds: no embedding, tied head or classifier is adapted); `train_head`: the
    family's head (a new classifier) trains in full beside the adapters. ValueError naming the setting when PEFT has
    no default for the architecture, a name matches no module or only modules outside the blocks, or one of the
    `stages` (split by `partition`) would hold no adapter."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import NoMatchingPeftModuleError
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    model = meta_model(model_class, hf_config)
    family = model_family(model)
    ranges = block_ranges(stage_block_counts(model, stages, partition))  # as the stages are cut, before adapters
    linear = _linear_names(model)
    targets = settings.target_modules
    shown = ",".join(targets) if targets else None
    if not targets and not DEFAULTS.get(hf_config.model_type):
        raise ValueError(f"lora_target_modules: PEFT has no default for model type {hf_config.model_type!r}; "
                         f"expected module names of its linear layers ({', '.join(linear)}) or "
                         "all-linear")
    options: dict[str, Any] = {"r": settings.rank}
    if settings.alpha is not None:
        options["lora_alpha"] = settings.alpha
    if settings.dropout is not None:
        options["lora_dropout"] = settings.dropout
    if targets:
        options["target_modules"] = "all-linear" if targets == ("all-linear",) else list(targets)
    config = LoraConfig(task_type="SEQ_CLS" if train_head else "CAUSAL_LM", **options)
    try:
        with warnings.catch_warnings():  # GPT2's Conv1D: PEFT sets fan_in_fan_out itself, with a warning
            warnings.simplefilter("ignore")
            inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    except NoMatchingPeftModuleError:
        pass  # named below
    except ValueError as exc:  # a module PEFT cannot adapt (a norm, say)
        raise ValueError(f"lora_target_modules={shown}: {str(exc).splitlines()[0][:200]}") from None
    resolved = model.peft_config[ADAPTER] if ADAPTER in getattr(model, "peft_config", {}) else config
    adapted = adapted_paths(model)
    inside = [path for path in adapted if path.startswith(f"{family.blocks}.")]
    _check_targets(model, targets, adapted, inside, linear)
    if len(inside) < len(adapted):  # a name matching in the blocks and beside them (BERT's dense): the blocks'
        resolved.target_modules = sorted(inside)
    for s, indices in enumerate(ranges):
        if not any(path.startswith(f"{family.blocks}.{i}.") for i in indices for path in inside):
            raise ValueError(f"lora_target_modules={shown}: stage {s} of {stages} (blocks {indices[0]}-{indices[-1]}) "
                             "holds none of them; expected targets every stage holds")
    resolved.modules_to_save = list(family.head) if train_head else None
    return resolved


def _check_targets(model: nn.Module, targets: tuple[str, ...] | None, adapted: list[str], inside: list[str],
                   linear: list[str]) -> None:
    """Refuse a name no module has (PEFT adapts what matches and says nothing of a misspelt name beside it) and a
    name matching only outside the blocks (an embedding, a head, a weight every stage holds a copy of)."""
    shown = ",".join(targets) if targets else None

    def matching(name: str, paths: list[str]) -> list[str]:
        return [path for path in paths if path == name or path.endswith(f".{name}")]

    names = [t for t in targets or () if t != "all-linear"]
    unmatched = [t for t in names if not matching(t, adapted)]
    if unmatched:
        raise ValueError(f"lora_target_modules={shown}: no module of {type(model).__name__} is named "
                         f"{', '.join(unmatched)} (its linear layers: {', '.join(linear)})")
    outside = [t for t in names if not matching(t, inside)]
    if outside:
        paths = [p for t in outside for p in matching(t, adapted)]
        raise ValueError(f"lora_target_modules={shown}: {', '.join(outside)} only outside the blocks "
                         f"({', '.join(paths[:3])}); expected modules inside the blocks, which every stage holds")


def add_lora(stage: nn.Module, config: Any, seed: int, dtype: torch.dtype) -> None:
    """Inject `config`'s adapters into `stage` (PEFT's layers), seeded by module name; freeze all but them and
    `config.modules_to_save`; cast what trains to `dtype`. ValueError when the stage holds no target."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import NoMatchingPeftModuleError

    injected = copy.copy(config)
    injected.modules_to_save = None  # the head trains as it is: no PEFT wrapper renaming its weights
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inject_adapter_in_model(injected, stage)
    except NoMatchingPeftModuleError:  # lora_config checks every stage of the split it was given
        targets = config.target_modules
        shown = targets if isinstance(targets, str) else ",".join(sorted(targets))
        raise ValueError(f"lora_target_modules={shown}: stage {getattr(stage, 'stage_index', 0)} holds none of "
                         "them; expected targets every stage holds (in its blocks)") from None
    for path in config.modules_to_save or ():  # the stages without the head have none of it
        for name, p in stage.named_parameters():
            if name.startswith(f"{path}."):
                p.requires_grad_(True)
    with torch.no_grad():
        for p in stage.parameters():
            if p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)
    seed_adapters(stage, seed)  # drawn in the adapters' own dtype (PEFT makes them the base's first)
