"""Stage modules per model family, and the registry that names the HF classes they split.

A family is data (``base.Family``: where the embeddings, blocks, final norm and head live, which weights are read as
lookup tables); the Llama lineage's adapters derive from transformers' own ``base_model_pp_plan``.

Adding a family is one file, as ``gpt2.py``: a ``PipelineStage`` subclass with three hooks (``embed``: stage 0's
embeddings; ``block_arguments``: the masks and positions its blocks take, rebuilt from the batch on every stage;
``head``: final norm, head and loss) and ``run_block`` only where a block returns more than the hidden state (as
DeBERTa's); a ``FAMILIES`` dict naming the HF classes and their ``Family`` data; and its module imported below.
``PipelineStage.forward`` (base.py) is the one forward they all run.
"""
from __future__ import annotations

from typing import Any, Callable

from . import bert, deberta, decoder, gpt2
from .base import Family, PipelineStage, StageOutput
from .bert import BertStage
from .deberta import DebertaStage
from .decoder import DecoderStage
from .gpt2 import GPT2Stage

FAMILIES: dict[str, Callable[[Any], Family]] = {**gpt2.FAMILIES, **decoder.FAMILIES, **bert.FAMILIES,
                                                **deberta.FAMILIES}


def supported_classes() -> list[str]:
    return sorted(FAMILIES)


def family_for(class_name: str, config: Any) -> Family:
    """The family adapter of an HF model class; ValueError naming the class and the supported ones, or what in
    this configuration the family cannot split exactly."""
    if class_name not in FAMILIES:
        raise ValueError(f"cannot partition {class_name}: supported model classes are "
                         f"{', '.join(supported_classes())}")
    family = FAMILIES[class_name](config)
    why = family.stage.check(config)
    if why is not None:
        raise ValueError(f"cannot partition {class_name}: {why} is not supported by the partitioner")
    return family


__all__ = [
    "FAMILIES", "BertStage", "DebertaStage", "DecoderStage", "Family", "GPT2Stage", "PipelineStage", "StageOutput",
    "family_for", "supported_classes",
]
