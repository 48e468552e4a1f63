"""The HF Trainer's optimizer and schedule flags (`--optim`, `--weight_decay`, `--adam_beta1`, `--adam_beta2`,
`--adam_epsilon`, `--lr_scheduler_type`, `--warmup_steps`, `--warmup_ratio`), with HF's names and meanings.

The run keeps one home for them: its DeepSpeed-style `optimizer` and `scheduler` blocks (a --deepspeed_config file
sets them whole). These flags are edits of those blocks, applied after every layer is merged, so a flag changes one
value of a block a file set and keeps the rest. `--lr_scheduler_type` chooses one of transformers' own schedules
(`transformers.get_scheduler`: linear warm-up from 0, then constant, linear or cosine to 0); the DeepSpeed ones
stay available through the file.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
HF_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
ADAM = ("Adam", "AdamW")

# flag -> (its parser, its help): each is an edit of the optimizer or scheduler block
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "optim": (str, f"the optimizer: {', '.join(OPTIMIZER_NAMES)} (torch's)"),
    "weight_decay": (float, "the optimizer's weight decay (AdamW's decoupled; L2 in Adam and SGD)"),
    "adam_beta1": (float, "Adam(W)'s beta1"),
    "adam_beta2": (float, "Adam(W)'s beta2"),
    "adam_epsilon": (float, "Adam(W)'s epsilon"),
    "lr_scheduler_type": (str, f"the learning-rate schedule, transformers' own: {', '.join(HF_SCHEDULES)} "
                               "(all but constant after a linear warm-up); without it the config file's, by "
                               "default DeepSpeed's WarmupDecayLR warming up over a tenth of the steps"),
    "warmup_steps": (int, "steps of linear warm-up from 0 to --lr (HF's meaning; wins over --warmup_ratio; "
                          "alone, the schedule is linear)"),
    "warmup_ratio": (float, "warm-up as a fraction of the run's optimizer steps, rounded up"),
}


def shown(optimizer: dict[str, Any], scheduler: dict[str, Any] | None) -> dict[str, Any]:
    """Each flag's value as the blocks set it (what --help states as its default), where they set one."""
    kind, params = optimizer.get("type"), optimizer.get("params", {})
    out: dict[str, Any] = {"optim": {v: k for k, v in OPTIMIZER_NAMES.items()}.get(kind)}
    out["weight_decay"] = params.get("weight_decay")
    betas = params.get("betas")
    if kind in ADAM:
        out.update(adam_beta1=betas[0] if betas else None, adam_beta2=betas[1] if betas else None,
                   adam_epsilon=params.get("eps"))
    if scheduler is not None and scheduler.get("type") in HF_SCHEDULES:
        sp = scheduler.get("params", {})
        out.update(lr_scheduler_type=scheduler["type"], warmup_steps=sp.get("warmup_steps"),
                   warmup_ratio=sp.get("warmup_ratio"))
    return {k: v for k, v in out.items() if v is not None}


def split(layer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the layer without these flags, the flags it gives, text parsed as the flag parses it: an API call's "0.9")."""
    given = {}
    for k, v in layer.items():
        if k in FLAGS and isinstance(v, str):
            try:
                v = FLAGS[k][0](v)
            except ValueError:
                raise ValueError(f"--{k} {v!r}: expected a number") from None
        if k in FLAGS:
            given[k] = v
    return {k: v for k, v in layer.items() if k not in FLAGS}, given


def apply(optimizer: dict[str, Any], scheduler: dict[str, Any] | None, edits: dict[str, Any]
          ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The blocks with the flags' edits. Raises ValueError naming a flag whose value does not fit."""
    optimizer, scheduler = copy.deepcopy(optimizer), copy.deepcopy(scheduler)
    params = optimizer.setdefault("params", {})
    if "optim" in edits:
        name = str(edits["optim"]).lower()
        if name not in OPTIMIZER_NAMES:
            raise ValueError(f"--optim {edits['optim']}: expected one of {', '.join(OPTIMIZER_NAMES)}")
        kind = OPTIMIZER_NAMES[name]
        if (kind in ADAM) != (optimizer.get("type") in ADAM):  # another family: its own arguments' defaults
            params = {"weight_decay": params["weight_decay"]} if "weight_decay" in params else {}
            if kind in ADAM:
                params.update(betas=[0.9, 0.999], eps=1e-8)
            optimizer["params"] = params
        optimizer["type"] = kind
    for flag in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        if flag in edits and optimizer.get("type") not in ADAM:
            raise ValueError(f"--{flag} with optimizer {optimizer.get('type')}: expected Adam or AdamW (--optim)")
    if "weight_decay" in edits:
        params["weight_decay"] = _at_least(edits, "weight_decay", 0.0)
    if "adam_beta1" in edits or "adam_beta2" in edits:
        betas = list(params.get("betas", [0.9, 0.999]))
        for i, flag in enumerate(("adam_beta1", "adam_beta2")):
            if flag in edits:
                betas[i] = edits[flag]
                if not 0.0 <= betas[i] < 1.0:
                    raise ValueError(f"--{flag} {betas[i]}: expected a number in [0, 1)")
        params["betas"] = betas
    if "adam_epsilon" in edits:
        params["eps"] = _at_least(edits, "adam_epsilon", 0.0)
    if "lr_scheduler_type" in edits:
        kind = str(edits["lr_scheduler_type"]).lower()
        if kind not in HF_SCHEDULES:
            raise ValueError(f"--lr_scheduler_type {edits['lr_scheduler_type']}: expected one of "
                             f"{', '.join(HF_SCHEDULES)}")
        kept = scheduler["params"] if scheduler is not None and scheduler.get("type") in HF_SCHEDULES else {}
        scheduler = {"type": kind, "params": {"warmup_steps": 0, "warmup_ratio": 0.0, **kept}}  # a file's warm-up kept
    warm = {k: edits[k] for k in ("warmup_steps", "warmup_ratio") if k in edits}
    if warm:
        if scheduler is not None and scheduler.get("type") == "WarmupDecayLR":  # the same family: HF's linear
            scheduler = {"type": "linear", "params": {"warmup_steps": 0, "warmup_ratio": 0.0}}
        if scheduler is None or scheduler.get("type") not in HF_SCHEDULES:
            kind = "none" if scheduler is None else scheduler.get("type")
            raise ValueError(f"--{next(iter(warm))} with the config file's {kind} schedule: expected "
                             f"--lr_scheduler_type ({', '.join(HF_SCHEDULES)}; a DeepSpeed schedule sets its own "
                             "warmup_num_steps)")
        if scheduler["type"] == "constant":
            raise ValueError(f"--{next(iter(warm))} with --lr_scheduler_type constant, which has no warm-up (as in "
                             "transformers): expected constant_with_warmup")
        if "warmup_steps" in warm:
            warm["warmup_steps"] = int(_at_least(warm, "warmup_steps", 0))
        if "warmup_ratio" in warm and not 0.0 <= warm["warmup_ratio"] <= 1.0:
            raise ValueError(f"--warmup_ratio {warm['warmup_ratio']}: expected a fraction in [0, 1]")
        if "warmup_ratio" in warm and "warmup_steps" not in warm:
            warm["warmup_steps"] = 0  # the flag wins over a file's warmup_steps, which would win over any ratio
        scheduler["params"].update(warm)
    return optimizer, scheduler


def _at_least(edits: dict[str, Any], flag: str, low: float) -> float:
    value = edits[flag]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"--{flag} {value!r}: expected a number >= {low:g}")
    return value


def warmup_steps(params: dict[str, Any], total_steps: int) -> int:
    """A transformers schedule's warm-up in steps: warmup_steps where given (> 0), else ceil(ratio x steps)."""
    steps = int(params.get("warmup_steps") or 0)
    if steps > 0:
        return steps
    ratio = float(params.get("warmup_ratio") or 0.0)
    return math.ceil(ratio * total_steps)
