"""Two machines without a shared filesystem, as two `torchrun --nnodes 2` launches each in a directory of its own
(`--output_dir out`, relative) and, where namespaces can be built, a network namespace of its own on a shaped link:
each holds only its own rank's checkpoint files, a machine killed mid-run leaves the two with different latest
checkpoints, the resume takes the newest both hold, and the merged model arrives complete on node 0, streamed from
node 1. The losses and the model are those of the run on one machine. With a copy of each machine's files on the
other, a machine that comes back empty gets its files from its peer; with none, it is refused in one line."""
import json
import re
import subprocess
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.netns import Network, can_build
from tests.helpers.killed_recipe import FLAGS, RECIPE
from tests.helpers.processes import checkout_env, free_port

MACHINE_FLAGS = [*FLAGS, "--save_every", "2", "--output_dir", "out"]  # each machine's own out/


@pytest.fixture(scope="module")
def network():
    """Two machines as two network namespaces joined by a shaped 200 Mbit/s link (benchmarks/netns.py) where they
    can be built (root, iproute2); else both on loopback, which still keeps their directories apart."""
    why_not = can_build()
    if why_not is not None:
        print(f"two machines on loopback: {why_not}")
        yield None
        return
    with Network(2) as net:
        net.shape("200mbit")
        yield net


def two_machines(nodes, network, *flags, fault=""):
    """Node i's launcher started in nodes[i] (in namespace i where there is a network); (status, stderr) of each."""
    port = free_port()
    procs = []
    for i, directory in enumerate(nodes):
        directory.mkdir(exist_ok=True)
        env, prefix, master = checkout_env(AQPIPE_FAULT=fault), [], "127.0.0.1"
        if network is not None:
            env["GLOO_SOCKET_IFNAME"] = network.interface(i)
            prefix, master = network.exec_prefix(i), network.address(0)
        cmd = [*prefix, "torchrun", "--nnodes", "2", "--node_rank", str(i), "--nproc_per_node", "1", "--master_addr",
               master, "--master_port", str(port), RECIPE, *MACHINE_FLAGS, *flags]
        procs.append(subprocess.Popen(cmd, cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    deadline, ended = time.monotonic() + 300, [None] * len(procs)
    while None in ended and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [Ended(p.wait(), p.stderr.read(), t) for p, t in zip(procs, ended)]


class Ended(tuple):
    """A machine's launcher: (status, stderr), and `at`, when it ended (time.monotonic)."""

    def __new__(cls, status, stderr, at):
        made = super().__new__(cls, (status, stderr))
        made.at = at
        return made


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_machines_without_a_shared_filesystem_checkpoint_resume_and_export_on_node_0(tmp_path, network,
                                                                                         reference_run):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    # no copies (--no_copy_checkpoints): what each machine holds is its own; node 1's rank dies before step 5
    (rc0, err0), (rc1, _) = two_machines(nodes, network, "--no_copy_checkpoints", fault="kill:1:5")
    assert rc0 != 0 and rc1 != 0 and "stopping: rank 1 (stage 1, replica 0)" in err0, err0[-2000:]
    for rank, node in enumerate(nodes):  # each machine holds its own rank's files, and a manifest naming both
        for step in ("step_00000002", "step_00000004"):
            directory = node / "out" / "checkpoints" / step
            assert sorted(p.name for p in directory.glob("*.pt")) == [f"stage{rank}_replica0.pt"]
            assert [f["file"] for f in json.loads((directory / "manifest.json").read_text())["files"]] == [
                "stage0_replica0.pt", "stage1_replica0.pt"]
    # node 1 stopped before finalizing step 4 (the directory unrenamed, no manifest, latest still at step 2)
    stopped = nodes[1] / "out" / "checkpoints"
    (stopped / "step_00000004" / "manifest.json").unlink()
    (stopped / "step_00000004").rename(stopped / "step_00000004.partial")
    (stopped / "latest").write_text("step_00000002\n")

    (rc0, err0), (rc1, err1) = two_machines(nodes, network, "--no_copy_checkpoints", "--resume")
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "model: stage 1's" in err0 and "received from rank 1" in err0  # streamed, not read from a shared disk
    want, got = records(reference_run), records(nodes[0] / "out")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 6]  # resumed at step 2, the newest both machines hold
    for a, b in zip(want, got):
        for key in ("loss", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6), (key, a, b)
    assert not (nodes[1] / "out" / "model").exists()
    ref, merged = (AutoModelForCausalLM.from_pretrained(d / "model").state_dict()
                   for d in (reference_run, nodes[0] / "out"))
    assert set(ref) == set(merged)
    for key, value in ref.items():
        assert torch.allclose(merged[key], value, rtol=1e-6, atol=0), key

    # with no copy anywhere, a machine that lost its files is refused in one line on each machine
    held = sorted(int(p.parent.name.split("_")[1]) for p in nodes[0].glob("out/checkpoints/step_*/stage0_replica0.pt"))
    assert held and not list(nodes[0].glob("out/checkpoints/step_*/stage1_replica0.pt"))
    for path in sorted((nodes[1] / "out").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (rc0, err0), (rc1, err1) = two_machines(nodes, network, "--no_copy_checkpoints", "--resume", "auto")
    assert rc0 != 0 and rc1 != 0, err0[-2000:] + err1[-2000:]  # torchrun's status for a worker's 2 is 1
    for err in (err0, err1):  # naming what each rank holds
        said = [line for line in err.splitlines() if "a machine that lost its files has no copy" in line]
        assert len(said) == 1 and f"steps by rank: [{held}, []]" in said[0], err[-2000:]
    assert not re.search(r'File "[^"]*/aqpipe/', err0 + err1), err0[-2000:]  # no rank's traceback


def test_a_machine_that_comes_back_empty_gets_its_checkpoint_from_the_peer_holding_a_copy(tmp_path, network,
                                                                                           reference_run):
    """Also: the survivor stops within a bound, naming the dead rank, and AQ-SGD's buffers kept in files (each
    machine's own --buffer_dir) resume with the run, nothing resent whole, no buffer file left behind."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    died = two_machines(nodes, network, "--buffer_dir", "buffers", fault="kill:1:5")  # node 1's rank, before step 5
    (rc0, err0), (rc1, _) = died
    assert rc0 != 0 and rc1 != 0, err0[-2000:]
    assert "stopping: rank 1 (stage 1, replica 0)" in err0, err0[-2000:]
    assert not re.search(r'File "[^"]*/aqpipe/', err0), err0[-2000:]  # no traceback of ours (torchrun prints its own)
    assert died[0].at - died[1].at < 20, f"rank 0 took {died[0].at - died[1].at:.1f} s to stop after rank 1 died"
    held = nodes[0] / "out" / "checkpoints" / "step_00000004"  # machine 0 holds machine 1's files too (a copy)
    assert sorted(p.name for p in held.glob("*.pt")) == ["stage0_replica0.pt", "stage1_replica0.pt"]
    assert "copied to rank 0 on another machine" in err0 or "copied to rank 1 on another machine" in err0, err0[-2000:]
    for wiped in (nodes[1] / "out",):  # a new machine in its place: nothing of the run on its disk
        for path in sorted(wiped.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        wiped.rmdir()

    (rc0, err0), (rc1, err1) = two_machines(nodes, network, "--buffer_dir", "buffers", "--resume", "auto")
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "step_00000004's stage1_replica0.pt and its files" in err1 and "received by rank 1 from rank 0" in err1, \
        err1[-2000:]
    want, got = records(reference_run), records(nodes[0] / "out")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 6]  # resumed at step 4: nothing redone but step 5's start
    for a, b in zip(want, got):
        for key in ("loss", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6), (key, a, b)
        assert (b.get("fwd_bytes"), b.get("bwd_bytes")) == (a.get("fwd_bytes"), a.get("bwd_bytes"))
    # step 6: four samples seen before the kill, each a 2-bit change of 32 tokens of 128 in groups of 64 (48 bytes a
    # token), with their ids, coded (at most a byte more a message): none resent whole (a float32 row is 16 kB)
    assert got[5]["fwd_bytes"] <= 4 * 32 * 48 + 4 * 8 + 2
    last = [node / "out" / "checkpoints" / "step_00000006" for node in nodes]
    for rank, (side, directory) in enumerate(zip(("send", "recv"), last)):  # the last checkpoint took each
        assert f"boundary0_{side}_replica0.buf" in [p.name for p in directory.glob("*.buf")]  # machine's own file
        assert not list((nodes[rank] / "buffers").glob("*.buf"))  # and none is left behind
    manifest = json.loads((last[0] / "manifest.json").read_text())
    assert manifest["buffer_plan"]["rows"] == 8  # the samples steps 5-6 visit again: what a later resume keeps
