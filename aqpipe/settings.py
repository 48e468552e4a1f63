"""Settings as a run gets them: defaults < a DeepSpeed-style JSON file < command-line flags (or an API call's
settings), layered and built into the sections of config.py (each checking itself as it is made), resolved for the
launcher's world, then the checks that read files (preflight.py), frozen from here on. A bad value exits with status 2
and one line naming it."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields, is_dataclass, replace
from typing import Any

from . import config_file, preflight, trainer_flags
from .config import SECTIONS, RunConfig, destinations
from .environment import launch
from .presets import preset_layer
from .flags import USE_PEFT, build_parser, given, parse_text, switch
from .speech import speaks


# a section's setting by its flag's name ("seq_len", "lora_rank"), as the command line, a call of aqpipe.finetune and a
# task's defaults name it -> (its section, its field)
BY_FLAG = {g.metadata.get("flag", g.name): (dest.split(".")[0], g.name) for dest, g in destinations() if "." in dest}


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """Settings with a section's settings given by their flags' names (`seq_len`, `lora_rank`, as a task's defaults
    and a config file's run block may give them) moved into their section (`{"data": {"seq_len": ...}}`); a key given
    both ways takes the section's."""
    out = {k: (dict(v) if k in SECTIONS and not is_dataclass(v) else v) for k, v in values.items()
           if k not in BY_FLAG}
    for key in [k for k in values if k in BY_FLAG]:
        section, name = BY_FLAG[key]
        given = out.setdefault(section, {})
        if is_dataclass(given):  # every one of its values is given: which would win is not the caller's to guess
            raise ValueError(f"{key} given beside the {section} section given whole: expected it inside the section")
        given.setdefault(name, values[key])
    return out


def build(task: str, values: dict[str, Any]) -> RunConfig:
    """A RunConfig from merged settings (flat or nested); an unknown key is named with the block it came from."""
    values = nest(values)
    top = {f.name for f in fields(RunConfig)} - set(SECTIONS) - {"task"}
    unknown = sorted(set(values) - top - set(SECTIONS))
    if unknown:
        homes = {f.name: f"{name} block key {f.name} (its flag: {f.metadata.get('flag', f.name)})"
                 for name, kind in SECTIONS.items() for f in fields(kind)}
        moved = [f"{k} is {homes[k]}" for k in unknown if k in homes]  # a section's key in the run block
        hint = f" ({'; '.join(moved)})" if moved else ""
        raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the config's run block{hint}")
    defaults = RunConfig(task=task)
    sections = {}
    for name, kind in SECTIONS.items():
        section = values.get(name, {})  # a dict of its settings, or the section itself
        unknown = [] if is_dataclass(section) else sorted(set(section) - {f.name for f in fields(kind)})
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the config's {name} block; expected "
                             f"{', '.join(f.name for f in fields(kind))}")
        sections[name] = section if is_dataclass(section) else replace(getattr(defaults, name), **section)
    return RunConfig(task=task, **{k: v for k, v in values.items() if k not in SECTIONS}, **sections)


def validate(cfg: RunConfig, world_size: int = 1) -> RunConfig:
    """The config with `auto` stages resolved for `world_size` (every process is one stage of one of the replicas),
    after the checks that need the stage count; reading no file. Raises ValueError naming the first bad value."""
    stages = cfg.distributed.pipeline_stages
    if cfg.replicas == "auto":  # an elastic launch: every whole pipeline the world holds
        if stages == "auto":
            raise ValueError("replicas=auto with pipeline_stages=auto: expected a stage count (--pipeline_stages N) "
                             "to divide the world by")
        if world_size % stages:
            raise ValueError(f"replicas=auto: the launcher's {world_size} processes are not a multiple of "
                             f"pipeline_stages={stages}: expected whole pipelines (--nproc_per_node a multiple of the "
                             "stages)")
        cfg = replace(cfg, data_parallel=replace(cfg.data_parallel, replicas=world_size // stages))
    if stages == "auto":
        if world_size % cfg.replicas:
            raise ValueError(f"replicas={cfg.replicas} does not divide the world size {world_size}")
        stages = world_size // cfg.replicas
        cfg = replace(cfg, distributed=replace(cfg.distributed, pipeline_stages=stages))
    rates = cfg.compression.link_mbit
    if rates is not None and len(rates) != stages - 1:
        raise ValueError(f"link_mbit={rates}: expected {stages - 1} rates, one per boundary of {stages} stages")
    partition = cfg.distributed.partition
    if isinstance(partition, list) and len(partition) != stages:
        raise ValueError(f"partition={partition}: expected {stages} block counts, one per stage")
    shares = cfg.data_parallel.shares
    if isinstance(shares, list) and (len(shares) != cfg.replicas or
                                     sum(shares) != cfg.replicas * cfg.num_micro_batches):
        raise ValueError(f"micro_batch_shares={','.join(map(str, shares))}: expected {cfg.replicas} counts, one per "
                         f"replica, summing to replicas x num_micro_batches = "
                         f"{cfg.replicas * cfg.num_micro_batches} (the global batch)")
    return cfg


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; the sections merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out.get(key, {}), **value} if key in SECTIONS else value
    return out


def _layered(layers: list[dict[str, Any]]) -> tuple[dict[str, Any], int | None]:
    """The layers merged in one ordered pass (each nested: a section's setting by its flag's name, such as seq_len,
    into its section; later wins; text parsed as its flag parses it), lowest first: TRL's LoRA defaults where a
    layer gives --use_peft (the last that gives it decides), the task's defaults (the first layer), the compression
    preset a layer names, then the others as given. The trainer's optimizer and schedule flags are applied to the
    merged blocks (trainer_flags.py), and DeepSpeed's train_batch_size kept apart: a key checked against the batch,
    not a setting."""
    edits: dict[str, Any] = {}
    use_peft, parsed = False, []
    for layer in layers:
        plain, flags = trainer_flags.split({k: v for k, v in layer.items() if k != "use_peft"})
        edits.update(flags)
        if "use_peft" in layer:
            use_peft = _switch("use_peft", layer["use_peft"])
        parsed.append(parse_text(RunConfig, nest(plain)))
    preset = next((p["compression_preset"] for p in reversed(parsed) if p.get("compression_preset") is not None),
                  None)
    peft = {"lora": dict(USE_PEFT)} if use_peft else {}
    values = _merge(peft, *parsed[:1], preset_layer(preset), *parsed[1:])
    if edits:
        defaults, optim = RunConfig(task="causal_lm").optimization, values.setdefault("optimization", {})
        optim["optimizer"], optim["scheduler"] = trainer_flags.apply(
            optim.get("optimizer", defaults.optimizer), optim.get("scheduler", defaults.scheduler), edits)
    return values, values.pop("_train_batch_size", None)


def _switch(name: str, value: Any) -> bool:
    """A switch given as a bool or as text ("True", as HF's parser takes it)."""
    if isinstance(value, bool):
        return value
    try:
        return switch(str(value))
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None


def finalize(task: str, layers: list[dict[str, Any]], world_size: int | None = None) -> RunConfig:
    """Settings layered (later wins; text parsed as its flag parses it), validated for the launcher's world (or
    `world_size` ranks: a plan made before the run), then the checks that read files (preflight); frozen from here
    on. Raises ValueError naming the first bad value."""
    values, batch = _layered(layers)
    world = launch().world_size if world_size is None else world_size
    cfg = validate(build(task, values), world)
    if world % cfg.distributed.pipeline_stages:
        raise ValueError(f"pipeline_stages={cfg.distributed.pipeline_stages} does not divide the launcher's {world} "
                         "processes: expected world size = pipeline_stages x replicas")
    if cfg.distributed.pipeline_stages * cfg.replicas != world:
        raise ValueError(f"pipeline_stages={cfg.distributed.pipeline_stages} x replicas={cfg.replicas} needs "
                         f"{cfg.distributed.pipeline_stages * cfg.replicas} processes; the launcher started {world}")
    if batch is not None and batch != cfg.micro_batch_size * cfg.num_micro_batches * cfg.replicas:
        raise ValueError(f"train_batch_size={batch}: expected micro_batch_size x num_micro_batches x replicas = "
                         f"{cfg.micro_batch_size} x {cfg.num_micro_batches} x {cfg.replicas}")
    return preflight.check(cfg)


def resolve(task: str, argv: list[str] | None, description: str, defaults: dict[str, Any] | None = None,
            prog: str | None = None, world_size: int | None = None) -> RunConfig:
    """The command line: defaults < a --deepspeed_config file < flags, finalized.

    Exits with status 2 and one line on bad input; `--print_config` prints the settings as a file and exits 0."""
    parser = build_parser(RunConfig, description, prog, shown=build(task, _layered([defaults or {}])[0]))
    args = parser.parse_args(argv)
    try:
        layers = [defaults or {}, config_file.read(args.deepspeed_config) if "deepspeed_config" in args else {},
                  given(args)]
        if "print_config" in args:  # as given: `auto` stages stay auto
            cfg = build(task, _layered(layers)[0])
            validate(cfg, launch().world_size if world_size is None else world_size)
            if speaks():
                print(json.dumps(config_file.write(cfg), indent=2))
            parser.exit(0)
        return finalize(task, layers, world_size)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    raise AssertionError("unreachable: parser.exit ends the process")
