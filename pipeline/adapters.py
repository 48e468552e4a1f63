"""The user's LoRA settings, and a stage's adapters once injected (pipeline/lora.py injects them): their seeded
initial values, the merged model's tensors and the adapter's own, by the names PEFT writes. A leaf: the settings
(aqpipe/config.py) and the stages (`hf_state_dict`) read it without loading the partitioner, the loader and
transformers that lora.py needs to resolve targets."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .seeding import derive_seed


@dataclass(frozen=True)
class LoraSettings:
    """The user's choices; None: PEFT's default (alpha 8, dropout 0, the architecture's target modules)."""

    rank: int
    alpha: float | None = None
    dropout: float | None = None
    target_modules: tuple[str, ...] | None = None  # module names, or ("all-linear",)


ADAPTER = "default"  # PEFT's name for a model's one adapter
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the model's own names


def adapted_paths(model: nn.Module) -> list[str]:
    """The paths of the modules PEFT's LoRA layers replaced."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def seed_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter its initial values (PEFT's: A uniform as nn.Linear's, B zero) from a generator seeded by
    its module's name in `model`: a stage and the unpartitioned model it mirrors draw the same values."""
    for name in adapted_paths(model):
        torch.manual_seed(derive_seed(seed, "lora", name))
        model.get_submodule(name).reset_lora_parameters(ADAPTER, True)


def has_adapters(model: nn.Module) -> bool:
    return ADAPTER in getattr(model, "peft_config", {})


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each adapter folded into its base weight (W + B A scale, in float32), under the
    names the model had before the adapters came; the adapters' own tensors left out."""
    layers = {path: model.get_submodule(path) for path in adapted_paths(model)}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        path, _, leaf = key.rpartition(".")
        owner, _, part = path.rpartition(".")
        if owner in layers and part == "base_layer":
            if leaf == "weight":
                value = value.float() + layers[owner].get_delta_weight(ADAPTER).detach().float()
            out[f"{owner}.{leaf}"] = value
        elif not any(key.startswith(f"{p}.") for p in layers):
            out[key] = value
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What trains, by the names `PeftModel.save_pretrained` writes (the adapter name dropped, `base_model.model.`
    before each): the adapters and the head trained in full."""
    from peft import get_peft_model_state_dict

    out = dict(get_peft_model_state_dict(model, adapter_name=ADAPTER))
    out.update({name: p for name, p in model.named_parameters() if p.requires_grad and ".lora_" not in name})
    return {PEFT_PREFIX + name: value.detach() for name, value in out.items()}
