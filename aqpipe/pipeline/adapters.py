"""The user's LoRA settings, and a stage's adapters once injected (aqpipe/pipeline/lora.py injects them): their seeded
initial values, the merged model's tensors and the adapter's own, by the names PEFT writes. A leaf: the settings
(aqpipe/config.py) and the stages (`hf_state_dict`) read it without loading the partitioner, the loader and
transformers that lora.py needs to resolve targets."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.compression.fields import FREE, check_choices, check_int, setting

from .quantized_base import QUANT_TYPES, plain_state_dict
from .seeding import derive_seed


@dataclass(frozen=True)
class LoraSettings:
    """The user's choices, the run's `lora` section (its flags --lora_rank, ...; a config file's "lora" block);
    None: PEFT's default (alpha 8, dropout 0, the architecture's target modules). Checked as it is made: a
    ValueError names the first bad value."""

    rank: int = setting(0, "train LoRA adapters of this rank (PEFT's layers, in every stage's blocks) instead of "
                           "every weight: the base frozen in its checkpoint's dtype (a bfloat16 base computes "
                           "under bf16 autocast; a float16 one is held in float32), only the adapters (and a new "
                           "classification head) get gradients, optimizer state and data-parallel traffic; "
                           "exports <output_dir>/adapter beside the merged model (0: off)", "lora_rank", older=0,
                           hf=("lora_r",))
    alpha: float | None = setting(None, "LoRA's scale numerator (the adapters' update is scaled by alpha / rank); "
                                        "default: PEFT's, 8", "lora_alpha", older=None)
    dropout: float | None = setting(None, "dropout on the adapters' input; default: PEFT's, 0", "lora_dropout",
                                  older=None)
    target_modules: list[str] | None = setting(None, "the modules to adapt, inside the blocks: comma-separated "
                                                     "names, or all-linear; default: PEFT's for the architecture "
                                                     "(q_proj,v_proj for the Llama lineage, c_attn for GPT2, "
                                                     "query_proj,value_proj for DeBERTa, query,value for BERT)",
                                               "lora_target_modules", older=None)
    load_in_4bit: bool = setting(False, "QLoRA: hold the frozen base's block linears in 4 bits (bitsandbytes), each "
                                        "stage quantizing its own as it reads them from the shards; embeddings, "
                                        "the head and norms stay in the checkpoint's dtype; needs --lora_rank",
                                 "load_in_4bit", older=False)
    bnb_4bit_quant_type: str = setting("nf4", "the 4-bit type with --load_in_4bit: nf4 (normal float) or fp4",
                                       "bnb_4bit_quant_type", choices=QUANT_TYPES, older="nf4")
    merge: bool | None = setting(None, "with adapters, also write the merged model (each adapter folded into its "
                                       "weight) in <output_dir>/model; default: yes for a base in its checkpoint's "
                                       "dtype, no for a 4-bit base (its merge dequantizes the stage to bf16)",
                                 "merge", resume=FREE)  # what the run exports at its end
    use_bnb_nested_quant: bool = setting(False, "with --load_in_4bit, quantize the 4-bit blocks' scales too "
                                                "(double quantization: about 0.4 bits a weight fewer)",
                                         "use_bnb_nested_quant", older=False)

    def __post_init__(self) -> None:
        check_int("lora_rank", self.rank, 0)
        check_choices(self)
        if (self.load_in_4bit or self.use_bnb_nested_quant) and not self.rank:
            raise ValueError("--load_in_4bit without --lora_rank: a 4-bit base cannot train; expected a LoRA rank "
                             ">= 1 for the adapters that do")
        if self.use_bnb_nested_quant and not self.load_in_4bit:
            raise ValueError("--use_bnb_nested_quant without --load_in_4bit: expected both, or neither")
        if not self.rank:
            others = [f"lora_{name}={getattr(self, name)!r}" for name in ("alpha", "dropout", "target_modules")
                      if getattr(self, name) is not None]
            if others:
                raise ValueError(f"{', '.join(others)} without --lora_rank: expected a LoRA rank >= 1 to adapt with")
            return
        if self.alpha is not None and (not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool)
                                       or not 0 < self.alpha < math.inf):
            raise ValueError(f"lora_alpha={self.alpha!r}: expected a positive number")
        if self.dropout is not None and not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"lora_dropout={self.dropout!r}: expected a probability in [0, 1)")
        targets = self.target_modules
        if targets is not None and (not isinstance(targets, (list, tuple)) or not targets or
                                    not all(isinstance(t, str) and t.strip() for t in targets)):
            raise ValueError(f"lora_target_modules={targets!r}: expected module names such as q_proj,v_proj, or "
                             "all-linear")
        if targets is not None and "all-linear" in targets and len(targets) > 1:
            raise ValueError(f"lora_target_modules={','.join(targets)}: all-linear stands alone")
        if targets is not None:
            object.__setattr__(self, "target_modules", tuple(targets))  # frozen: one form whatever the source

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def merges(self) -> bool:
        """Whether the run writes the merged model beside the adapter."""
        return self.merge if self.merge is not None else not self.load_in_4bit


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
    for key, value in plain_state_dict(model).items():  # a 4-bit base's weights dequantized
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
