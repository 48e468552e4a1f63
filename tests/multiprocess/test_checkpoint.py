"""Checkpoints: a resumed engine is the uninterrupted one under every data-parallel algorithm with
AQ-SGD, and a damaged, unfinished or foreign checkpoint never loads. (The recipe killed mid-run
and resumed: test_faults.py.)"""
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aqpipe import data_parallel
from tests.helpers.processes import spawn
from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups, owned_parameters
from aqpipe.pipeline.adapters import LoraSettings
from aqpipe import checkpoint
from aqpipe.storage import Storage
from aqpipe.world import World
from aqpipe.settings import build, validate
from aqpipe import data
from tests.helpers.toy import ToyStage, toy_dataset, toy_stages, toy_ties

SEQ, MBS, MICRO, SAMPLES, STEPS, RESUME_AT = 8, 4, 2, 32, 6, 3
# the codecs' packed sizes, which the byte checks below count (the entropy stage has tests of its own)
AQSGD = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4, entropy_coding=False)
FIRST_VISITS = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4,
                                 first_visit="hadamard", first_visit_bits=3, entropy_coding=False)
SUBSPACE = CompressionConfig(forward="subspace", forward_bits=3, backward="subspace", backward_bits=3, subspace_rank=4,
                             tie_bits=2, tie_rank=4, entropy_coding=False)  # the tie's gradients in a basis too
# the gradients in a basis of their own with error feedback, and the tie's rows' changes in a basis of theirs
OWN_BASIS = replace(SUBSPACE, backward_basis="own", backward_feedback=True, tie_rows_rank=4)
AUTO_RANK = replace(SUBSPACE, subspace_rank="auto", subspace_energy=0.5, subspace_max_rank=8)  # chosen each refresh
OPTIONS = {
    "allreduce": {},
    "decentralized": {"peer_selection": "shift_one"},
    "low_precision_decentralized": {"bits": 4},
    "qadam": {"warmup_steps": 2, "bits": 4},
    "qsparse_local_sgd": {"local_steps": 2, "topk_ratio": 0.25, "bits": 4},
    "cocktail_sgd": {"random_ratio": 0.5, "topk_ratio": 0.25, "bits": 8},
}


class DrawingStage(ToyStage):
    """A custom stage as a user may write one: dropout from torch's global generator, and a jitter drawn from
    numpy's and python's. A resumed run draws what the uninterrupted one drew only if all three are restored."""

    def __init__(self, stage: ToyStage) -> None:
        embed = stage.embed.detach() if stage.embed is not None else torch.zeros(1, stage.hidden_size)
        super().__init__(stage.stage_index, stage.num_stages, list(stage.blocks), embed)

    def forward(self, hidden, batch, seed=None):
        out = super().forward(hidden, batch, seed)
        if self.is_last or not self.training:
            return out
        jitter = 1 + 0.05 * (np.random.rand() - 0.5) + 0.05 * (random.random() - 0.5)
        return torch.nn.functional.dropout(out, 0.1) * jitter


def _engine(groups, grid, name, compression=AQSGD, keep=None):
    stage = DrawingStage(toy_stages(2)[groups.stage])
    comm = data_parallel.Comm(groups.data_parallel, grid.data_parallel_ranks(groups.stage))
    algo = data_parallel.create(name, owned_parameters(stage, toy_ties(2)), comm, **OPTIONS[name])
    optimizer = algo.wrap_optimizer(torch.optim.Adam(owned_parameters(stage, toy_ties(2)), lr=0.02))
    return PipelineEngine(stage, groups, optimizer,
                          EngineSettings(num_samples=data.shard_size(SAMPLES, grid.replicas), seq_len=SEQ, seed=3,
                                         buffer_keep=keep),
                          compression=compression, ties=toy_ties(2), data_parallel=algo,
                          lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))


def resume_every_algorithm(rank, world, tmp, names=tuple(OPTIONS), compression=AQSGD, resume_at=RESUME_AT,
                           keep=None):
    """Per algorithm: STEPS steps straight, and the same with a save at `resume_at`, a fresh engine and a load
    (`keep`: the samples whose AQ-SGD rows the buffers keep)."""
    grid = Grid.for_world(world, 2)
    groups = build_groups(grid, rank)
    plan = [(epoch, mbs) for epoch in range(STEPS)  # each replica its own shard (2 steps an epoch)
            for mbs in data.micro_batches(toy_dataset(SAMPLES, SEQ), MBS, MICRO, epoch, seed=3,
                                          shard=(groups.replica, grid.replicas))][:STEPS]
    out = {}
    for name in names:
        runs = []
        for resume in (False, True):
            engine, log = _engine(groups, grid, name, compression, keep), []
            torch.manual_seed(rank), np.random.seed(rank), random.seed(rank)  # each run draws alike from here
            for step, (epoch, mbs) in enumerate(plan):
                if resume and step == resume_at:
                    path = Path(tmp) / f"{name}_rank{rank}.pt"
                    checkpoint.write_state(path, {"engine": engine.state_dict(), "rng": checkpoint.rng_state()})
                    engine = _engine(groups, grid, name, compression, keep)  # a new process starts from scratch
                    torch.manual_seed(1234), np.random.seed(1234), random.seed(1234)
                    record = checkpoint.read_state(path)  # weights_only=True
                    engine.load_state_dict(record["engine"])
                    checkpoint.set_rng_state(record["rng"])
                m = engine.train_batch(mbs, epoch).record()
                log.append({k: m[k] for k in ("step", "loss", "fwd_bytes", "bwd_bytes", "tie_bytes", "dp_bytes", "lr")})
            codecs = engine.state_dict()["codecs"]
            forward = codecs.get("next.forward", codecs.get("prev.forward"))
            buffer = forward.get("buffer") or {"rows": forward["subspace"]["basis"], "ids": torch.zeros(0)}
            backward = codecs.get("next.backward", codecs.get("prev.backward"))
            runs.append({"log": log, "params": torch.cat([p.detach().reshape(-1) for p in engine.stage.parameters()]),
                         "backward": {k: backward[k] for k in ("residual", "subspace") if k in backward},
                         "tie_rows": [v["rows_subspace"]["basis"] for k, v in sorted(codecs.items())
                                      if k.endswith(".values") and "rows_subspace" in v],
                         "buffer": buffer["rows"].clone(), "buffer_ids": buffer["ids"].clone(),
                         "batches": [[mb["sample_id"] for mb in mbs] for _, mbs in plan]})
        out[name] = runs
    return out


def assert_resumed_as_straight(ranks, keys=("fwd_bytes", "bwd_bytes", "tie_bytes")):
    """Every rank's allreduce run resumed at RESUME_AT against its uninterrupted one: the losses, the bytes of each wire
    in `keys` each step, the buffer (AQ-SGD's rows, or the forward's basis) bit for bit, and the weights."""
    for rank in ranks:
        straight, resumed_run = rank["allreduce"]
        assert [s["loss"] for s in resumed_run["log"]] == pytest.approx([s["loss"] for s in straight["log"]], rel=1e-6)
        for key in keys:
            assert [s[key] for s in resumed_run["log"]] == [s[key] for s in straight["log"]], key
        assert torch.equal(resumed_run["buffer"], straight["buffer"])
        assert torch.allclose(resumed_run["params"], straight["params"], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return spawn(resume_every_algorithm, 4, str(tmp_path_factory.mktemp("engine_ckpt")))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_engine_resume_equals_uninterrupted_under_every_algorithm(resumed, name):
    for rank in range(4):
        straight, resumed_run = resumed[rank][name]
        assert [s["loss"] for s in resumed_run["log"]] == pytest.approx([s["loss"] for s in straight["log"]], rel=1e-6)
        for key in ("step", "fwd_bytes", "bwd_bytes", "dp_bytes", "lr"):
            assert [s[key] for s in resumed_run["log"]] == [s[key] for s in straight["log"]], key
        assert torch.allclose(resumed_run["params"], straight["params"], rtol=1e-6, atol=0)
        assert torch.equal(resumed_run["buffer"], straight["buffer"])  # AQ-SGD rows, bit for bit
    # after the resume (epoch 1: each replica has seen its whole shard) every sample travels as a 2-bit change
    # of 16 values + 8 bytes of scales and its 8-byte id, on both replicas: 1,664 bytes; a single sample resent
    # whole would add 8 x 64 - 12 x 8 bytes
    log = resumed[0][name][1]["log"]
    assert log[0]["fwd_bytes"] == 2 * MICRO * MBS * (SEQ * 16 * 4 + 8)  # the first visits, in full
    assert log[RESUME_AT]["fwd_bytes"] == 2 * MICRO * MBS * (SEQ * (16 * 2 // 8 + 8) + 8) == 1664


def test_a_resume_inside_the_first_epoch_of_compressed_first_visits_equals_uninterrupted(tmp_path):
    """Saved after step 1 of 2 of the first epoch: step 2's first visits draw the first-visit codec's dither as the
    uninterrupted run's did, and the rows both sides stored before the save carry on."""
    from aqpipe.compression import QuantizedTensor

    ranks = spawn(resume_every_algorithm, 4, str(tmp_path), ("allreduce",), FIRST_VISITS, 1)
    assert_resumed_as_straight(ranks, ("fwd_bytes",))
    rows = MICRO * (QuantizedTensor.wire_nbytes((MBS, SEQ, 16), 3) + MBS * 8)  # a replica's step of first visits
    log = ranks[0]["allreduce"][1]["log"]
    assert [s["fwd_bytes"] for s in log[:2]] == [2 * rows] * 2 and log[2]["fwd_bytes"] == 1664


def test_a_resume_of_subspace_boundaries_with_replicas_equals_uninterrupted(tmp_path):
    """Rank-4 bases of the 16-wide toy boundary and of the tied embedding's gradients, 2 replicas: the basis each side
    holds, the losses and the bytes of every wire of a run resumed after step 3 are the uninterrupted run's, and a
    refresh's basis (steps 0, 1, 2 and 4) is in the forward bytes."""
    from aqpipe.compression import QuantizedTensor, Subspace

    ranks = spawn(resume_every_algorithm, 4, str(tmp_path), ("allreduce",), SUBSPACE, RESUME_AT)
    assert_resumed_as_straight(ranks)  # the basis, bit for bit
    assert torch.equal(ranks[0]["allreduce"][1]["buffer"], ranks[1]["allreduce"][1]["buffer"])  # both sides' basis
    coefficients = QuantizedTensor.wire_nbytes((MBS, SEQ, 4), 3) + MBS * 8  # a micro-batch's, and its ids
    basis = Subspace(4).basis_nbytes(16)
    log = ranks[0]["allreduce"][1]["log"]
    assert [s["fwd_bytes"] for s in log] == [2 * (MICRO * coefficients + basis * (s in (0, 1, 2, 4)))
                                            for s in range(STEPS)]
    assert [s["bwd_bytes"] for s in log] == [2 * MICRO * QuantizedTensor.wire_nbytes((MBS, SEQ, 4), 3)] * STEPS


def test_a_resume_of_a_backward_in_its_own_basis_with_error_feedback_equals_uninterrupted(tmp_path):
    """The gradients in a basis their sender estimates, with error feedback, and the tie's rows in a basis of theirs,
    2 replicas: losses, weights, every wire's bytes, the bases and the kept residual of a run resumed after step 3
    are the uninterrupted run's; the gradient basis's refreshes (steps 0, 1, 2, 4) are in the backward bytes, both
    sides hold each basis bit for bit, and only the gradients' sender keeps a residual."""
    from aqpipe.compression import QuantizedTensor, Subspace

    ranks = spawn(resume_every_algorithm, 4, str(tmp_path), ("allreduce",), OWN_BASIS, RESUME_AT)
    assert_resumed_as_straight(ranks)
    for rank in ranks:
        straight, resumed_run = rank["allreduce"]
        for key in ("basis", "scales"):
            assert torch.equal(resumed_run["backward"]["subspace"][key], straight["backward"]["subspace"][key])
    sender, receiver = ranks[1]["allreduce"][1]["backward"], ranks[0]["allreduce"][1]["backward"]
    assert torch.equal(sender["subspace"]["basis"], receiver["subspace"]["basis"])
    assert receiver["residual"] is None and float(sender["residual"].abs().sum()) > 0
    assert torch.equal(sender["residual"], ranks[1]["allreduce"][0]["backward"]["residual"])  # resumed = straight
    owner, follower = ranks[1]["allreduce"], ranks[0]["allreduce"]  # the tie's owner is the last stage
    assert len(owner[1]["tie_rows"]) == 1 and torch.equal(owner[1]["tie_rows"][0], follower[1]["tie_rows"][0])
    assert torch.equal(owner[1]["tie_rows"][0], owner[0]["tie_rows"][0])
    coefficients = QuantizedTensor.wire_nbytes((MBS, SEQ, 4), 3)
    basis = Subspace(4).basis_nbytes(16)
    log = ranks[0]["allreduce"][1]["log"]
    assert [s["bwd_bytes"] for s in log] == [2 * (MICRO * coefficients + basis * (s in (0, 1, 2, 4)))
                                            for s in range(STEPS)]


def test_a_resume_under_auto_rank_equals_uninterrupted(tmp_path):
    """Auto rank (at most 8 of the toy's 16, half the energy), saved after step 3, when step 3 has announced step
    4's rank: the resumed run's losses, weights, bytes and basis are the uninterrupted run's, and the rank (seen in
    the forward's bytes) moved from the bound to what the energy asks."""
    from aqpipe.compression import QuantizedTensor

    ranks = spawn(resume_every_algorithm, 4, str(tmp_path), ("allreduce",), AUTO_RANK, RESUME_AT)
    assert_resumed_as_straight(ranks)
    backward = [s["bwd_bytes"] for s in ranks[0]["allreduce"][1]["log"]]  # coefficients alone: each replica's rank
    bound = 2 * MICRO * QuantizedTensor.wire_nbytes((MBS, SEQ, 8), 3)  # both replicas at the bound
    assert backward[0] == bound and all(b < bound for b in backward[1:]), (backward, bound)


def test_a_resume_with_rows_kept_for_a_quarter_of_the_samples_equals_uninterrupted(tmp_path):
    """A budget that holds a quarter of the rows: the other samples go whole at every visit, both sides of each
    boundary keep the same rows, and a resume in the second epoch goes on exactly."""
    keep = torch.arange(SAMPLES // 2) < SAMPLES // 8  # each replica's shard of 16: rows for 4
    ranks = spawn(resume_every_algorithm, 4, str(tmp_path), ("allreduce",), AQSGD, RESUME_AT, keep)
    for rank in ranks:
        straight, resumed_run = rank["allreduce"]
        assert [s["loss"] for s in resumed_run["log"]] == pytest.approx([s["loss"] for s in straight["log"]], rel=1e-6)
        for key in ("fwd_bytes", "bwd_bytes"):
            assert [s[key] for s in resumed_run["log"]] == [s[key] for s in straight["log"]], key
        assert torch.equal(resumed_run["buffer"], straight["buffer"])
        assert sorted(straight["buffer_ids"].tolist()) == [0, 1, 2, 3]
    for replica in (0, 1):  # the two sides of each replica's boundary: the same samples, the same rows
        sender, receiver = ranks[2 * replica]["allreduce"][1], ranks[2 * replica + 1]["allreduce"][1]
        assert torch.equal(sender["buffer_ids"], receiver["buffer_ids"])
        assert torch.equal(sender["buffer"], receiver["buffer"])
    # from the second epoch on a kept sample is a 2-bit change and any other float32 rows, in each micro-batch
    whole, change, ids = SEQ * 16 * 4, SEQ * (16 * 2 // 8 + 8), MBS * 8
    log = ranks[0]["allreduce"][1]["log"]
    for step in range(2, STEPS):
        kept = [int(keep[sid].sum()) for r in (0, 2) for sid in ranks[r]["allreduce"][1]["batches"][step]]
        assert log[step]["fwd_bytes"] == sum(k * change + (MBS - k) * whole + ids for k in kept), step
    assert log[0]["fwd_bytes"] == 2 * MICRO * (MBS * whole + ids)


# ---------------------------------------------------------------------- checkpoint files, in one process
def _single_engine():
    grid = Grid.for_world(1, 1)
    stage = toy_stages(1)[0]
    return PipelineEngine(stage, build_groups(grid, 0), torch.optim.SGD(stage.parameters(), lr=0.1),
                          EngineSettings(num_samples=SAMPLES, seq_len=SEQ))


def _cfg(tmp_path, **kw):
    return validate(build("causal_lm", {"output_dir": str(tmp_path / "out"), "compression": CompressionConfig(),
                                        **kw}))


def _save(tmp_path, engine, cfg, step):
    root = tmp_path / "out" / "checkpoints"
    return checkpoint.save(root, step, engine, {"step": step}, cfg, World(0, 1, 0, torch.device("cpu")),
                           Storage(0, (0,)), keep=2)


def test_a_damaged_or_unfinished_checkpoint_never_loads(tmp_path):
    engine, cfg = _single_engine(), _cfg(tmp_path)
    first = _save(tmp_path, engine, cfg, 1)
    assert checkpoint.find("latest", cfg.checkpointing.output_dir) == first
    # a crash after the files but before the manifest: 'latest' still names the complete one
    (first.parent / "step_00000002.partial").mkdir()
    (first.parent / "step_00000002.partial" / "stage0_replica0.pt").write_bytes(b"half")
    assert checkpoint.find("latest", cfg.checkpointing.output_dir) == first
    with pytest.raises(ValueError, match="no checkpoint"):
        checkpoint.find(str(first.parent / "step_00000002.partial"), cfg.checkpointing.output_dir)
    # a file changed after it was written fails its checksum
    with open(first / "stage0_replica0.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="does not match its checksum"):
        checkpoint.load(first, _single_engine(), cfg)


def test_save_total_limit_keeps_the_newest(tmp_path):
    engine, cfg = _single_engine(), _cfg(tmp_path)
    for step in (1, 2, 3):
        newest = _save(tmp_path, engine, cfg, step)
    assert sorted(p.name for p in newest.parent.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (newest.parent / "latest").read_text().strip() == "step_00000003"


def test_a_checkpoint_of_another_configuration_is_refused_naming_what_differs(tmp_path):
    engine, cfg = _single_engine(), _cfg(tmp_path)
    ckpt = _save(tmp_path, engine, cfg, 1)
    other = validate(build("causal_lm", {"output_dir": str(tmp_path / "out"), "seq_len": 64,
                                         "lora": LoraSettings(rank=8),
                                         "compression": CompressionConfig(forward="direct", forward_bits=4)}))
    with pytest.raises(ValueError) as info:
        checkpoint.check_compatible(ckpt, other)
    text = str(info.value)
    assert "forward_compress='none' in the checkpoint, 'direct' in this run" in text
    assert "seq_len=128 in the checkpoint, 64 in this run" in text and "epochs" not in text
    assert "lora_rank=0 in the checkpoint, 8 in this run" in text  # adapters are not resumed into a full run
    assert checkpoint.find("auto", str(tmp_path / "elsewhere")) is None  # auto: nothing saved, start fresh
