"""Settings as a run gets them: defaults < a DeepSpeed-style JSON file < command-line flags (or an API call's
settings), layered, validated for the launcher's world (config.py), then the checks that read files (preflight.py),
frozen from here on. A bad value exits with status 2 and one line naming it."""
from __future__ import annotations

import json
from typing import Any

from . import config_file, preflight, trainer_flags
from .config import SECTIONS, RunConfig, build, nest, validate
from .environment import launch
from .flags import build_parser, given, parse_text
from .speech import speaks


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; the sections merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out.get(key, {}), **value} if key in SECTIONS else value
    return out


def _layered(layers: list[dict[str, Any]]) -> tuple[dict[str, Any], int | None]:
    """The layers merged (each nested: a once-flat key such as seq_len into its section; later wins; text parsed as
    its flag parses it), the trainer's optimizer and schedule
    flags applied to the merged blocks (trainer_flags.py), and DeepSpeed's train_batch_size apart: a key checked
    against the batch, not a setting."""
    edits: dict[str, Any] = {}
    for layer in layers:
        edits.update(trainer_flags.split(layer)[1])
    values = _merge(*(parse_text(RunConfig, nest(trainer_flags.split(layer)[0])) for layer in layers))
    if edits:
        defaults, optim = RunConfig(task="causal_lm").optimization, values.setdefault("optimization", {})
        optim["optimizer"], optim["scheduler"] = trainer_flags.apply(
            optim.get("optimizer", defaults.optimizer), optim.get("scheduler", defaults.scheduler), edits)
    return values, values.pop("_train_batch_size", None)


def settle(task: str, layers: list[dict[str, Any]]) -> RunConfig:
    """Settings layered (later wins; text parsed as its flag parses it), validated for the launcher's world, then
    the checks that read files (preflight); frozen from here on. Raises ValueError naming the first bad value."""
    values, batch = _layered(layers)
    world = launch().world_size
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
            prog: str | None = None) -> RunConfig:
    """The command line: defaults < a --deepspeed_config file < flags, settled.

    Exits with status 2 and one line on bad input; `--print_config` prints the settings as a file and exits 0."""
    parser = build_parser(RunConfig, description, prog, shown=build(task, _layered([defaults or {}])[0]))
    args = parser.parse_args(argv)
    try:
        layers = [defaults or {}, config_file.read(args.deepspeed_config) if "deepspeed_config" in args else {},
                  given(args)]
        if "print_config" in args:  # as given: `auto` stages stay auto
            cfg = build(task, _layered(layers)[0])
            validate(cfg, launch().world_size)
            if speaks():
                print(json.dumps(config_file.write(cfg), indent=2))
            parser.exit(0)
        return settle(task, layers)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    raise AssertionError("unreachable: parser.exit ends the process")
