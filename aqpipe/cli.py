"""The command line: `aqpipe {causal-lm,classify,gpt2,deberta} [flags]` (or `python -m aqpipe ...`), any launcher,
and `aqpipe plan [TASK] --cluster cluster.yaml [flags]` (aqpipe/plan/command.py).

    deepspeed --num_gpus 2 --module aqpipe gpt2 [flags]
    torchrun --nproc_per_node 2 -m aqpipe deberta [flags]
    aqpipe gpt2 --help

The recipes in the checkout (recipes/finetune_*.py) call `finetune` with their task, then `leave`.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from . import interrupts
from .speech import let_rank_0_speak, speaks
from .environment import show_tracebacks
from .tasks import TASKS, Task

USAGE = (f"usage: aqpipe {{{','.join(TASKS)}}} [flags]   (aqpipe TASK --help lists the flags)\n"
         "       aqpipe plan [TASK] --cluster cluster.yaml [flags]   (a placement before the run: aqpipe/plan)")


def main(argv: list[str] | None = None) -> int:
    """`aqpipe TASK [flags]`; deepspeed's `--local_rank=N` may come before the task."""
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if not a.startswith("--local_rank")]
    if not words or words[0] in ("-h", "--help"):
        if speaks():
            print(USAGE + "\n\n" + "\n".join(f"  {t.name:9} {t.summary}" for t in TASKS.values()))
        return 0 if words else 2
    if words[0] == "plan":  # a placement for the machines a cluster file describes, before anything runs
        from .plan.command import main as plan  # deferred: `aqpipe --help` answers before torch loads

        return plan(words[1:])
    if words[0] not in TASKS:
        let_rank_0_speak()
        print(f"aqpipe: error: task {words[0]!r}: expected one of {', '.join(TASKS)} ({USAGE})", file=sys.stderr)
        return 2
    task = TASKS[words[0]]
    rest = list(argv)
    rest.remove(task.name)
    finetune(task, rest, prog=f"aqpipe {task.name}")
    return 0


def entry() -> NoReturn:
    """The `aqpipe` command: `main`, then `leave`."""
    leave(main())


def leave(code: int) -> NoReturn:
    """End the process of a command that has finished: its files are closed and, in a multi-process run, every peer
    has passed the run's last barrier and said its last word to the store rank 0 holds (Watchdog.stop). What is left
    is Python's teardown of torch's and transformers' module objects, a second a process that buys nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def finetune(task: Task, argv: list[str], description: str | None = None, prog: str | None = None) -> dict[str, Any]:
    """Resolve the settings (task defaults < a --deepspeed_config file < flags) and run."""
    from .settings import resolve  # deferred: `aqpipe --help` answers before torch and transformers load

    cfg = resolve(task.kind, argv, description or task.summary, defaults=task.defaults, prog=prog)
    from .train import run  # deferred: a bad flag or value, --help and --print_config answer before transformers loads
    try:
        return run(task, cfg, prog)  # a multi-process run handles its own failures (world.stop_after_failure)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM in one process (a multi-process run ends in stop_after_failure)
        if show_tracebacks():
            raise
        print(interrupts.line(prog or Path(sys.argv[0]).name), file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, FileNotFoundError, FloatingPointError) as exc:  # one line: bad input found late, NaN/inf
        if show_tracebacks():
            raise
        print(f"{prog or Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(1 if isinstance(exc, FloatingPointError) else 2) from None
