"""Settings' fields declared and checked alike in every layer: `setting` (a dataclass field with its help,
command-line flag, allowed values and what a resume may do with it, from which the trainer builds its parser, its
checks and its checkpoints' compatibility) and the one integer check (a setting, an option, an argument). A leaf at
the bottom of the import order (compression <- data_parallel <- pipeline <- aqpipe), so each layer imports it and
none repeats it."""
from __future__ import annotations

from dataclasses import field, fields
from typing import Any, Collection

# what a resume may do with a setting (a field's `resume` metadata):
SAME = "same"  # keep the checkpoint's value: a run with another is refused, naming it (the default)
FREE = "free"  # change it: the run's length, its evaluation, saving and logging, how its processes reach each other
KEPT = "kept"  # as SAME, except that `auto` takes the value the checkpoint's run resolved it to
RESHAPES = "reshapes"  # the run's shape (stages, blocks per stage): another reshards the checkpoint as it loads
# (aqpipe/reshape.py); `auto` takes the checkpoint's value where the stage count is the same


class _ThisRun:
    """`older=THIS_RUN`: a checkpoint from before the setting cannot say what it meant, so any value resumes it."""

    def __repr__(self) -> str:
        return "THIS_RUN"


THIS_RUN = _ThisRun()
_ALWAYS = object()  # `older` not given: every checkpoint this aqpipe reads has the setting


def setting(default: Any, text: str, flag: str | None = None, *, choices: Collection[Any] | None = None,
            resume: str = SAME, older: Any = _ALWAYS, **meta: Any) -> Any:
    """A dataclass field with its help, its command-line flag where it differs from the field's name, and:
    `choices`, the values it takes (checked by `check_choices` as its section is made); `resume`, what a resume may
    do with it (SAME, FREE, KEPT or RESHAPES); `older`, what a checkpoint written before the setting existed meant (a
    value, or THIS_RUN; without it, every checkpoint this aqpipe reads has the setting); and other metadata the parser
    reads (`const`: the value a flag given without one takes)."""
    if resume not in (SAME, FREE, KEPT, RESHAPES):
        raise ValueError(f"resume={resume!r}: expected {SAME}, {FREE}, {KEPT} or {RESHAPES}")
    meta = {"help": text, "resume": resume, **({"flag": flag} if flag else {}), **meta}
    if choices is not None:
        meta["choices"] = choices  # a registry stays live: what registers later is a choice too
    if older is not _ALWAYS:
        meta["older"] = older
    return field(default=default, metadata=meta)


def check_choices(section: Any) -> None:
    """Every field of a settings section that declares its `choices` against them; ValueError naming the first
    outside them as its flag does."""
    for f in fields(section):
        allowed = f.metadata.get("choices")
        value = getattr(section, f.name)
        try:
            outside = allowed is not None and value not in allowed
        except TypeError:  # a value a registry cannot look up (a list from a config file)
            outside = True
        if outside:
            raise ValueError(f"{f.metadata.get('flag', f.name)}={value!r}: expected one of "
                             f"{', '.join(str(a) for a in allowed)}")


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


def check_share(label: str, value: Any) -> float:
    """`value` if it is a share in (0, 1]; else ValueError naming it as `label`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{label}={value!r}: expected a share in (0, 1]")
    return value
