"""Every fine-tune command in the README resolves as written (its flags exist, its values are in range, its
process count fits its stages), and the data-parallel example compresses within the run it starts."""
import re
import shlex
from pathlib import Path

import pytest

from aqpipe.settings import resolve
from aqpipe.tasks import TASKS
from tests.helpers.processes import ROOT

TASK_NAMES = "|".join(TASKS)
LAUNCH = re.compile(r"(?:deepspeed|torchrun|python)\b[^`\n|#]*?(?:recipes/finetune_(\w+)\.py|aqpipe (" + TASK_NAMES
                    + r"))[^`\n#]*")


def readme_commands() -> list[str]:
    """Each launch of a fine-tune in README.md: without its optional parts ([--x a|b]), and with each of their
    choices; a `[flags]` placeholder is dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "README.md").read_text().replace("\\|", "|"))  # lines joined by \\
    commands = set()
    for match in LAUNCH.finditer(text):
        command = match.group(0).replace("[flags]", "")
        options = re.findall(r"\[([^\]]*)\]", command)
        bare = re.sub(r"\[[^\]]*\]", "", command)
        commands.add(" ".join(bare.split()))
        for option in options:  # "--dataset acceptability|next_line": one command per choice
            flag, _, values = option.partition(" ")
            commands.update(" ".join(f"{bare} {flag} {value}".split()) for value in values.split("|"))
    return sorted(commands)


def world_and_flags(command: str) -> tuple[str, int, list[str]]:
    words = shlex.split(command)
    world = 1
    for flag in ("--num_gpus", "--nproc_per_node"):
        if flag in words:
            world = int(words[words.index(flag) + 1])
    if "--nnodes" in words:  # torchrun: so many machines of --nproc_per_node each
        world *= int(words[words.index("--nnodes") + 1].split(":")[-1])
    pattern = r"finetune_(\w+)\.py|^(" + TASK_NAMES + ")$"
    name = next(re.search(pattern, w) for w in words if re.search(pattern, w))
    task = name.group(1) or name.group(2)
    after = words[words.index(name.string) + 1:]
    for flag in ("--model", "--model_name_or_path"):  # a hub name or a path of the reader's: checked by the tests
        if flag in after:  # of models, not here
            del after[after.index(flag):after.index(flag) + 2]
    return task, world, [w for w in after if w != "--help"]


def test_the_readme_names_its_commands():
    commands = readme_commands()
    assert any("--dp_algorithm qadam" in c for c in commands) and any("--dataset next_line" in c for c in commands)
    assert any("--deepspeed_config gpt2.json" in c for c in commands)
    assert len(commands) >= 6, commands


@pytest.mark.parametrize("command", readme_commands())
def test_each_readme_command_resolves(command, monkeypatch, tmp_path, capsys):
    task, world, flags = world_and_flags(command)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.chdir(tmp_path)  # a fresh checkout: no earlier run in the default output_dir
    if "--deepspeed_config" in flags:  # the file the README prints first
        with pytest.raises(SystemExit):
            resolve(TASKS[task].kind, ["--print_config"], "readme", TASKS[task].defaults)
        (tmp_path / flags[flags.index("--deepspeed_config") + 1]).write_text(capsys.readouterr().out)
    for flag in ("--dataset", "--dataset_name"):  # a reader's own file (a hub name is not looked up here)
        if flag in flags and Path(flags[flags.index(flag) + 1]).suffix in (".jsonl", ".json", ".csv"):
            (tmp_path / flags[flags.index(flag) + 1]).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = resolve(TASKS[task].kind, flags, "readme", TASKS[task].defaults)
    samples = cfg.data.max_train_samples or 1024  # all of a user's data: any count shows the plan
    steps = samples // (cfg.micro_batch_size * cfg.num_micro_batches * cfg.replicas) * cfg.epochs
    if cfg.data_parallel.algorithm == "qadam":  # the example must show the effect it names
        assert cfg.data_parallel.warmup_for(steps) < steps
        assert cfg.data_parallel.plan(steps) == (f"qadam: full-precision gradients for the first "
                                                 f"{cfg.data_parallel.warmup_for(steps)} of {steps} steps "
                                                 "(dp_warmup_steps), then 8-bit momentum")
