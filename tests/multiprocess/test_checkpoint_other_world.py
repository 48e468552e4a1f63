"""A checkpoint written by another world (4 ranks) found by a 2-rank run whose machines hold it unevenly: the ranks
agree on the newest step every old rank's files exist for somewhere, and a machine that holds none of it receives
its manifest (and one file) before anything reads it; the files each new rank reads come after, by name
(checkpoint_copies.fetch_slots). Before, a step counted as whole only when as many old ranks as new ones held it."""
import json

import torch

from aqpipe import checkpoint
from aqpipe.checkpoint_copies import fetch_slots
from aqpipe.storage import Storage
from aqpipe.world import World
from tests.helpers.processes import spawn

OLD_WORLD = 4


def write_old(root, step):
    """A finalized step of a 4-rank run (one stage file each), as the machine that kept them all holds it."""
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    files = []
    for rank in range(OLD_WORLD):
        name = checkpoint.rank_file(rank, 0)
        sha = checkpoint.write_state(directory / name, {"rank": rank, "payload": torch.arange(4) + rank})
        files.append({"rank": rank, "file": name, "sha256": sha, "external_buffers": {}})
    (directory / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "step": step,
                                                            "world_size": OLD_WORLD, "files": files}))
    (root / checkpoint.LATEST).write_text(directory.name)


def resume(rank, world, base):
    from pathlib import Path

    root = Path(base) / f"machine{rank}" / "checkpoints"
    root.mkdir(parents=True)
    if rank == 0:  # machine 0 kept every file of step 4; machine 1 came back empty
        write_old(root, 4)
    here = World(rank, world, rank, torch.device("cpu"))
    found = checkpoint.find("latest", str(root.parent), allow_missing=True)
    agreed = checkpoint.agree(found, root, here, Storage(rank, (rank,)))
    manifest = checkpoint.read_manifest(agreed)  # every machine reads the manifest
    fetch_slots(agreed, [checkpoint.rank_file(2 * rank, 0), checkpoint.rank_file(2 * rank + 1, 0)], here,
                Storage(rank, (rank,)))
    read = [checkpoint.read_state(agreed / checkpoint.rank_file(s, 0))["payload"].tolist()
            for s in (2 * rank, 2 * rank + 1)]
    return agreed.name, manifest["world_size"], read


def test_a_run_of_another_size_agrees_on_the_step_and_fetches_what_each_rank_reads(tmp_path):
    out = spawn(resume, 2, str(tmp_path))
    assert out[0] == ("step_00000004", OLD_WORLD, [[0, 1, 2, 3], [1, 2, 3, 4]])
    assert out[1] == ("step_00000004", OLD_WORLD, [[2, 3, 4, 5], [3, 4, 5, 6]])
