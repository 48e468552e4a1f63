"""Stage modules per model family, and the registry ``partition`` picks the family from."""
from __future__ import annotations

from .base import FamilyAdapter, PipelineStage, StageOutput
from .deberta import DebertaAdapter, DebertaStage
from .gpt2 import GPT2Adapter, GPT2Stage

ADAPTERS: list[FamilyAdapter] = [GPT2Adapter(), DebertaAdapter()]


def adapter_for(model: object) -> FamilyAdapter:
    """The adapter for ``type(model)`` (exact class match); ValueError naming the class and the supported ones."""
    for adapter in ADAPTERS:
        if type(model) in adapter.supported:
            return adapter
    raise ValueError(
        f"cannot partition {type(model).__name__}: supported model classes are {', '.join(supported_classes())}"
    )


def supported_classes() -> list[str]:
    return [cls.__name__ for adapter in ADAPTERS for cls in adapter.supported]


__all__ = [
    "ADAPTERS", "DebertaStage", "FamilyAdapter", "GPT2Stage", "PipelineStage", "StageOutput", "adapter_for",
    "supported_classes",
]
