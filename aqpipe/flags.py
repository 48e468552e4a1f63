"""The command line, built from the settings' own fields: each field with a "help" in its metadata is a flag
(named by its "flag", else the field), parsed by its type. A setting is declared once, where it lives.

Every flag defaults to "not given" (argparse.SUPPRESS), so a value from the config file survives unless the flag
names another; None is then an ordinary value (`--forward_group_size none`: whole rows).

transformers' HfArgumentParser was the first choice; it puts each field's default into argparse, and then a flag
the user left out cannot be told from one they gave, which the config file's layer needs.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, Callable, Iterator

import torch

from . import trainer_flags
from .speech import let_rank_0_speak, speaks
from .environment import launch

# HF's and TRL's flags for things aqpipe does its own way: accepted, and what aqpipe does instead said in one line
HF_NOTED = {
    "logging_steps": "aqpipe writes every step's row to metrics.jsonl and the tracker",
    "eval_strategy": "aqpipe evaluates every --eval_steps (= --eval_every) steps and at the end",
    "save_strategy": "aqpipe saves every --save_steps (= --save_every) steps and at the end",
    "per_device_eval_batch_size": "aqpipe evaluates in micro-batches of --per_device_train_batch_size",
    "push_to_hub": "aqpipe writes the model (and a LoRA run's adapter) to --output_dir and pushes nothing",
}
# TRL's --use_peft: LoRA with TRL's ModelConfig defaults wherever no layer (a file, a flag) sets the value
USE_PEFT = {"rank": 16, "alpha": 32.0, "dropout": 0.05}

SECTION_SHORTHANDS = {  # one flag for several settings; a one-sided flag given beside it wins
    "group_size": ("elements per quantization group on both boundaries, auto, or none for whole rows; sets "
                   "--forward_group_size and --backward_group_size",
                   ("compression.forward_group_size", "compression.backward_group_size")),
}


def int_or_word(text: str) -> int | str | None:
    """A count, or a word (auto; none: None); validation says which words a setting takes."""
    word = text.strip().lower()
    if word == "none":
        return None
    try:
        return int(word)
    except ValueError:
        if not word.isidentifier():
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer or auto") from None
        return word


def switch(text: str) -> bool:
    """A switch's value, where one is written after it as HF's parser takes it (`--packing True`)."""
    word = text.strip().lower()
    if word in ("true", "yes", "1", "on"):
        return True
    if word in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false (or the flag alone for true)")


def integer(text: str) -> int:
    """A count, also written as HF writes its epochs (`3.0`)."""
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not value.is_integer():
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
        return int(value)


def numbers(kind: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {kind.__name__}s") from None
    return parse


def names(text: str) -> list[str]:
    """`q_proj,v_proj`: comma-separated names."""
    out = [v.strip() for v in text.split(",")]
    if not all(out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names")
    return out


def ints_or_word(text: str) -> list[int] | str:
    """`2,2` (block counts) or a word (parameters, uniform)."""
    if text.strip().isidentifier():
        return text.strip()
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a word such as parameters, or block counts like "
                                         "2,2") from None


def dtype(text: str) -> torch.dtype:
    value = getattr(torch, text.strip(), None)
    if not isinstance(value, torch.dtype):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a torch dtype such as float16")
    return value


def parser_for(tp: Any) -> Callable[[str], Any] | None:
    """How a field's text becomes its value, from its type; None for a switch (bool) or a field no flag sets."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(tp) if union else (tp,)) - {type(None)}
    table: list[tuple[set[Any], Callable[[str], Any] | None]] = [
        ({bool}, None), ({int}, integer), ({float}, float), ({str}, str), ({int, str}, int_or_word),
        ({list[float]}, numbers(float)), ({list[int], str}, ints_or_word), ({list[str]}, names),
        ({torch.dtype}, dtype)]
    for match, parse in table:
        if kinds == match:
            return parse
    raise TypeError(f"no flag parser for a field of type {tp}")


def settings(config: type, prefix: str = "") -> Iterator[tuple[str, Field, Any]]:
    """(dotted destination, field, its type) for every flag of `config` and of its sections, in order."""
    hints = typing.get_type_hints(config)
    for f in fields(config):
        if is_dataclass(hints[f.name]):
            yield from settings(hints[f.name], f"{prefix}{f.name}.")
        elif "help" in f.metadata:
            yield f"{prefix}{f.name}", f, hints[f.name]


class Parser(argparse.ArgumentParser):
    """argparse with a bad flag in one line (no usage block), said by rank 0; every rank exits alike."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._nearest(message)} ({self.prog} --help lists the "
                     "flags)\n")

    def _nearest(self, message: str) -> str:
        """`; did you mean --forward_bits?` for the first unrecognized flag that is near one of ours."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        ours = [o for action in self._actions for o in action.option_strings if action.help != argparse.SUPPRESS]
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                near = difflib.get_close_matches(word.split("=", 1)[0], ours, n=1, cutoff=0.75)
                if near:
                    return f"; did you mean {near[0]}?"
        return ""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, after refusing one setting given under two of its names (--lr and --learning_rate)."""
        words = list(sys.argv[1:] if args is None else args)
        by_dest: dict[str, str] = {}
        for word in words:
            action = self._option_string_actions.get(word.split("=", 1)[0]) if word.startswith("--") else None
            if action is None or action.dest in ("help", argparse.SUPPRESS):
                continue
            name = word.split("=", 1)[0]
            first = by_dest.setdefault(action.dest, name)
            if first != name:
                self.error(f"{first} and {name} both set {action.dest.rpartition('.')[2]}: expected one of them")
        return super().parse_known_args(args, namespace)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if status and message and not speaks():
            let_rank_0_speak()
            message = f"{message.rstrip()} (rank {launch().rank})\n"
        super().exit(status, message)

    def print_help(self, file: Any = None) -> None:
        if speaks():
            super().print_help(file)


def as_typed(value: Any) -> str:
    """A value as its flag takes it: lists comma-separated, dtypes by name."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value).removeprefix("torch.")


def value_at(obj: Any, dest: str) -> Any:
    """The value at a dotted destination ("lr", "optimization.lr") of a config."""
    for name in dest.split("."):
        obj = getattr(obj, name)
    return obj


def build_parser(config: type, description: str, prog: str | None = None, shown: Any = None) -> Parser:
    """A flag per field of `config` (and its sections) with a help text; flags set "section.field" destinations.
    `shown`: the settings whose values the help states as defaults (a task's own, where it differs from the
    fields'); without it, the fields' defaults."""
    p = Parser(prog=prog, usage="%(prog)s [flags]", description=description, allow_abbrev=False,
               formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    p.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", help="DeepSpeed-style JSON config")
    p.add_argument("--print_config", action="store_true",
                   help="print the settings as a DeepSpeed-style JSON config (to edit and pass to "
                        "--deepspeed_config) and exit")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    for dest, f, tp in settings(config):
        name, text = f.metadata.get("flag", f.name), f.metadata["help"]
        # HF Trainer's and TRL's names for it (its field's `hf`): aliases of its one flag, shown beside it in --help;
        # the same setting under two names in one command is refused
        names = [f"--{name}", *(f"--{alias}" for alias in f.metadata.get("hf", ()))]
        default = value_at(shown, dest) if shown is not None else f.default
        if default not in (None, MISSING) and not isinstance(default, bool) and "default" not in text:
            text += f" (default: {as_typed(default)})"
        parse = parser_for(tp)
        if parse is not None:
            extra = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}
            p.add_argument(*names, dest=dest, type=parse, help=text, metavar=name.upper(), **extra)
        else:
            p.add_argument(*names, dest=dest, type=switch, nargs="?", const=True, help=text, metavar="BOOL")
            if f.default is not False:  # on by default, or decided by other settings (None)
                p.add_argument(f"--no_{name}", dest=dest, action="store_const", const=False, help=argparse.SUPPRESS)
    for name, (text, _) in SECTION_SHORTHANDS.items():
        p.add_argument(f"--{name}", type=int_or_word, help=text)
    p.add_argument("--use_peft", type=switch, nargs="?", const=True, metavar="BOOL",
                   help="TRL's: train LoRA adapters, with TRL's rank 16, alpha 32 and dropout 0.05 where --lora_r, "
                        "--lora_alpha and --lora_dropout (or a file) do not set them; --lora_r alone also trains "
                        "adapters in aqpipe")
    for name, note in HF_NOTED.items():
        p.add_argument(f"--{name}", dest=f"noted.{name}", help=f"HF's and TRL's flag, taken and not used: {note}",
                       metavar=name.upper(), nargs="?", const=True)  # a switch of theirs (--push_to_hub) too
    now = trainer_flags.shown(shown.optimization.optimizer, shown.optimization.scheduler) if shown is not None else {}
    for name, (parse, text) in trainer_flags.FLAGS.items():
        text += f" (default: {as_typed(now[name])})" if name in now else ""
        p.add_argument(f"--{name}", type=parse, help=text, metavar=name.upper())
    return p


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as settings: top-level fields by name, section fields as {"section": {...}}. An HF flag
    aqpipe does not use (HF_NOTED) is said in one line, on rank 0."""
    values = {dest: value for dest, value in vars(args).items()
              if dest not in ("deepspeed_config", "print_config", "local_rank")}
    for dest in [d for d in values if d.startswith("noted.")]:
        name, value = dest.removeprefix("noted."), values.pop(dest)
        if speaks():
            print(f"note: --{name} {value}: {HF_NOTED[name]}", file=sys.stderr)
    return layer(values)


def layer(values: dict[str, Any]) -> dict[str, Any]:
    """Values by destination ("field", "section.field", or a shorthand's name) as a config layer: top-level fields
    by name, section fields as {"section": {...}}; a shorthand fills the destinations not given beside it."""
    values = dict(values)
    for name, (_, targets) in SECTION_SHORTHANDS.items():
        if name in values:
            value = values.pop(name)
            for dest in targets:
                values.setdefault(dest, value)
    out: dict[str, Any] = {}
    for dest, value in values.items():
        section, _, key = dest.rpartition(".")
        (out.setdefault(section, {}) if section else out)[key] = value
    return out


def parse_text(config: type, values: dict[str, Any]) -> dict[str, Any]:
    """A config file's strings parsed as the flags parse them ("auto", "none", "2,2", "float16"); other values as
    they are."""
    out = dict(values)
    hints = typing.get_type_hints(config)
    for f in fields(config):
        value = out.get(f.name)
        if is_dataclass(hints[f.name]) and isinstance(value, dict):
            out[f.name] = parse_text(hints[f.name], value)
        elif isinstance(value, str) and "help" in f.metadata and parser_for(hints[f.name]) not in (None, str):
            parse = parser_for(hints[f.name])
            try:
                out[f.name] = parse(value)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ValueError(f"{f.metadata.get('flag', f.name)}={value!r}: {exc}") from None
    return out
