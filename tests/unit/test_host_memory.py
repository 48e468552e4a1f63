"""keep_freed_memory: a step's large tensors are reused from the heap instead of page-faulted in anew each time."""
import os
import subprocess
import sys

from aqpipe.host_memory import keep_freed_memory

FAULTS = """
import resource, sys, torch
from aqpipe.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():  # two large tensors, freed at once, as a micro-batch's logits and their gradient are
    a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(32 << 20, dtype=torch.uint8).fill_(1)
    del a, b
step()  # the first time faults in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.split()
    return out[0], int(out[1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    kept, with_it = faults("keep")
    _, without = faults("plain")
    assert kept == "True"
    assert without > 10 * 20000  # of the 24,576 pages of 4 KB a step, most are faulted in anew
    assert with_it * 4 < without  # 5x to 30x fewer here, by pattern


def test_the_users_own_allocator_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
