"""Settings' fields declared and checked alike in every layer: `setting` (a dataclass field with its help and
command-line flag, from which the trainer builds its parser) and the one integer check (a setting, an option, an
argument). A leaf at the bottom of the import order (compression <- data_parallel <- pipeline <- aqpipe), so each
layer imports it and none repeats it."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, text: str, flag: str | None = None, **meta: Any) -> Any:
    """A dataclass field with its help, its command-line flag where it differs from the field's name, and other
    metadata the parser reads (`const`: the value a flag given without one takes)."""
    return field(default=default, metadata={"help": text, **({"flag": flag} if flag else {}), **meta})


def is_int(value: Any) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(label: str, value: Any, low: int, high: int | None = None, what: str = "") -> int:
    """`value` if it is an integer in [low, high]; else ValueError naming it as `label` (an option, a flag), with
    `what` as the expectation where the default wording would not say it."""
    if not is_int(value) or value < low or (high is not None and value > high):
        expected = what or (f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}")
        raise ValueError(f"{label}={value!r}: expected {expected}")
    return value
