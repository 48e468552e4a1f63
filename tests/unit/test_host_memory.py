"""keep_freed_memory: a step's large tensors are reused from the heap instead of page-faulted in anew each time."""
import os
import subprocess
import sys

from aqpipe.host_memory import keep_freed_memory
from tests.helpers.processes import checkout_env

FAULTS = """
import resource, sys, torch
from aqpipe.host_memory import keep_freed_memory
def step():  # two large tensors, freed at once, as a micro-batch's logits and their gradient are
    a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(32 << 20, dtype=torch.uint8).fill_(1)
    del a, b
def faults():
    step()  # the first time faults in either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
without = faults()
kept = keep_freed_memory()
print(kept, without, min(faults(), faults()))  # the steady state: a first pass may still fault some pages in
"""


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    """In one fresh process (mallopt is process-wide): 10 steps as glibc comes, then 10 after keep_freed_memory."""
    malloc = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = checkout_env({k: v for k, v in os.environ.items() if k not in malloc})
    kept, without, with_it = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True,
                                            check=True, env=env).stdout.split()
    without, with_it = int(without), int(with_it)
    assert kept == "True"
    assert without > 10 * 20000  # of the 24,576 pages of 4 KB a step, most are faulted in anew
    assert with_it * 10 < without  # none once the heap holds the blocks (a first pass may still fault some in)


def test_the_users_own_allocator_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


HEAP = """
import sys, torch
from aqpipe.config import RunConfig
from aqpipe.pipeline.adapters import LoraSettings
from aqpipe.world import init_world
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10
if sys.argv[1] == "4-bit":  # a 4-bit base's run, as its process starts
    init_world(RunConfig(task="causal_lm", lora=LoraSettings(rank=4, load_in_4bit=True)))
torch.empty(30 << 20, dtype=torch.uint8).fill_(1)  # a mapped block freed: glibc raises its threshold to it
before = rss()
blocks = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(20)]  # dequantized weights, as a step
del blocks[:-1]  # makes them; the last one still alive, as the next layer's is
print(before, rss())
"""


def test_a_4_bit_bases_dequantized_weights_leave_nothing_behind_once_freed():
    """glibc's default: after a mapped block is freed, blocks below 32 MB come from the heap, whose freed middle is
    kept while a later block lives (80 MB here). A 4-bit base's run, as init_world starts it, maps each
    (map_large_blocks), and freed is gone."""
    malloc = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = checkout_env({k: v for k, v in os.environ.items() if k not in malloc})
    held = {}
    for how in ("default", "4-bit"):
        before, after = map(int, subprocess.run([sys.executable, "-c", HEAP, how], capture_output=True, text=True,
                                                check=True, env=env).stdout.split())
        held[how] = after - before
    assert held["default"] >= 70 and held["4-bit"] <= 10, held
