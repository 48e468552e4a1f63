"""Every task's --help states that task's own defaults: giving a flag the default its help states changes nothing
in the settings the task runs with (--print_config)."""
import json
import re

import pytest

from aqpipe import cli
from aqpipe.tasks import TASKS

def run(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 0, capsys.readouterr().err
    return capsys.readouterr().out


def stated_defaults(help_text: str) -> dict[str, str]:
    """--flag -> the default its help states (a flag's entry runs to the next line that starts a flag)."""
    out = {}
    for entry in re.split(r"\n(?=  -)", help_text):
        flat = " ".join(entry.split())
        m = re.match(r"--(\w+) [A-Z_]+(?:, --\w+ [A-Z_]+)* .*\(default: ([^()]*)\)$", flat)  # HF's names beside
        if m:
            out[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("task", list(TASKS))
def test_every_flag_states_the_tasks_own_default(capsys, task):
    stated = stated_defaults(run(capsys, [task, "--help"]))
    assert {"forward_compress", "lr", "micro_batch_size", "weight_decay"} <= set(stated), sorted(stated)
    assert len(stated) > 40, sorted(stated)
    plain = json.loads(run(capsys, [task, "--print_config"]))
    wrong = {}
    for flag, value in stated.items():
        given = json.loads(run(capsys, [task, f"--{flag}", value, "--print_config"]))
        if given != plain:
            wrong[flag] = value
    assert not wrong, f"{task}: the help states defaults the task does not run with: {wrong}"
