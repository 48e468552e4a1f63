"""The engine across processes (gloo): same losses as one process, AQ-SGD bytes, tied weights, desync."""
import pytest
import torch

from aqpipe.compression import SampleBuffer
from tests.helpers.buffers import by_sample
from tests.helpers.processes import spawn
from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups
from aqpipe.pipeline.compression_config import AUTO_GROUP_SIZE
from tests.helpers.toy import VOCAB, ToyStage, toy_batches, toy_stages, toy_ties

SEQ, MBS, MICRO, SAMPLES = 8, 4, 2, 32


def train(rank, world, compression, epochs, schedule="1f1b", shuffle_stage=None, hidden=16, bf16=False,
          weights=torch.float32, relabel_stage=None, nudge_tie_stage=None):
    stages = [s.to(weights) for s in toy_stages(world, hidden=hidden)]
    grid = Grid.for_world(world, world)
    groups = build_groups(grid, rank)
    stage = stages[groups.stage]
    if rank == nudge_tie_stage:  # this stage's copy of the tied weight differs from the others'
        with torch.no_grad():
            for p in stage.tied_parameters().values():
                p.add_(1e-3)
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5),
                            EngineSettings(num_samples=SAMPLES, seq_len=SEQ, schedule=schedule, gradient_clipping=1.0,
                                           bf16=bf16),
                            compression=compression, ties=toy_ties(world))
    log, collectives = [], []
    originals = {name: getattr(torch.distributed, name) for name in ("all_reduce", "all_to_all_single")}

    def counting(name):  # every collective the engine calls goes through one of these
        def counted(*args, **kwargs):
            collectives[-1] += 1
            return originals[name](*args, **kwargs)
        return counted

    for name in originals:
        setattr(torch.distributed, name, counting(name))
    try:
        for epoch in range(epochs):
            for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, epoch + (100 if rank == shuffle_stage else 0)):
                if rank == relabel_stage:  # the same tokens under other sample ids
                    mbs = [{**mb, "sample_id": (mb["sample_id"] + 1) % SAMPLES} for mb in mbs]
                collectives.append(0)
                log.append(engine.train_batch(mbs, epoch).record())
        collectives.append(0)
        evaluation = engine.eval_batch(next(toy_batches(SAMPLES, SEQ, MBS, MICRO, 0)))
    finally:
        for name, original in originals.items():  # this worker process's, put back
            setattr(torch.distributed, name, original)
    tied = {k: p.detach().clone() for k, p in stage.tied_parameters().items()}  # after eval: rows it read are current
    return {"log": log, "tied": tied, "eval": evaluation, "collectives": collectives}


def step_rows(epoch: int = 0) -> torch.Tensor:
    """The embedding rows the first step of `epoch` reads: what the owner sends the follower."""
    return torch.unique(torch.cat([mb["input_ids"].reshape(-1) for mb in next(toy_batches(SAMPLES, SEQ, MBS, MICRO,
                                                                                           epoch))]))


@pytest.fixture(scope="module")
def single():
    """The unpartitioned toy model in a plain PyTorch loop, no engine: the loss / M backwarded per micro-batch,
    `clip_grad_norm_`, SGD. Every pipeline shape below must reproduce it."""
    model = toy_stages(1)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    log = []
    for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, 0):
        optimizer.zero_grad()
        losses = []
        for mb in mbs:
            loss = model(None, mb).loss
            (loss / len(mbs)).backward()
            losses.append(float(loss.detach()))
        log.append({"loss": sum(losses) / len(losses),
                    "grad_norm": float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))})
        optimizer.step()
    with torch.no_grad():
        evaluation = [float(model(None, mb).loss) for mb in next(toy_batches(SAMPLES, SEQ, MBS, MICRO, 0))]
    return {"log": log, "tied": {"embed": model.embed.detach().clone()},
            "eval": {"loss": sum(evaluation) / len(evaluation)}}


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (3, "gpipe"), (3, "1f1b"), (3, "zb1")])
def test_uncompressed_pipeline_matches_one_process(single, world, schedule):
    multi = spawn(train, world, CompressionConfig(), 1, schedule)
    ref = [s["loss"] for s in single["log"]]
    for rank in range(world):  # every stage reports the same loss and gradient norm
        got = [s["loss"] for s in multi[rank]["log"]]
        assert got == pytest.approx(ref, rel=1e-5)
        assert [s["grad_norm"] for s in multi[rank]["log"]] == pytest.approx([s["grad_norm"] for s in single["log"]],
                                                                              rel=1e-5)
        # one small collective a step carries the non-finite verdict, the gradient norm, the loss and the bytes
        assert multi[rank]["collectives"] == [1] * (len(ref) + 1)  # each training step, then the eval step
    assert ref[-1] < ref[0]
    # the owner (last stage) steps the tied embedding; stage 0 holds exactly its rows where it reads them
    rows = step_rows()
    follower, owner = multi[0]["tied"]["embed"], multi[-1]["tied"]["embed"]
    assert torch.equal(follower[rows], owner[rows])
    torch.testing.assert_close(owner, single["tied"]["embed"], rtol=1e-5, atol=1e-6)
    assert multi[0]["eval"]["loss"] == pytest.approx(single["eval"]["loss"], rel=1e-5)
    # fp32 activations: B*T*H*4 bytes (+ 8 per sample id) per micro-batch and boundary
    per_mb = MBS * SEQ * 16 * 4
    step = multi[0]["log"][0]
    assert step["fwd_bytes"] == (world - 1) * MICRO * (per_mb + 8 * MBS)
    assert step["bwd_bytes"] == (world - 1) * MICRO * per_mb
    # the tie: a 16-byte header and the step's rows exactly, owner -> follower, and the follower's gradient at
    # them, back (the dense exchange was 2 x 40 x 16 x 4)
    assert 0 < rows.numel() < 40 and step["tie_bytes"] == 16 + 2 * rows.numel() * 16 * 4


def test_aqsgd_sends_2_bit_changes_in_groups_after_the_first_epoch_and_learns():
    cfg = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4,
                            entropy_coding=False)  # packed sizes, counted below
    log = spawn(train, 2, cfg, 3, "1f1b", None, 128)[0]["log"]  # hidden 128: rows of 512 fp32 bytes
    per_epoch = {}
    for s in log:
        per_epoch[s["epoch"]] = per_epoch.get(s["epoch"], 0) + s["fwd_bytes"]
    steps, elements, ids = SAMPLES // (MBS * MICRO), MBS * SEQ * 128, 8 * MBS  # per epoch; per micro-batch
    assert per_epoch[0] == steps * MICRO * (4 * elements + ids)  # first visits: fp32
    # then 2-bit codes and, by default ("auto"), a min and a step per group of 64 (rows of 128 are wider)
    assert per_epoch[1] == per_epoch[2] == steps * MICRO * (elements // 4 + 8 * elements // AUTO_GROUP_SIZE + ids)
    assert per_epoch[1] * 10 < per_epoch[0]
    losses = [s["loss"] for s in log]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 * 0.8
    # ||a - m|| / ||a||: nothing sent as a change in the first epoch, then every step reports it
    assert [s["fwd_change"] is None for s in log] == [s["epoch"] == 0 for s in log]


def test_warmup_epochs_send_full_precision_then_compress():
    cfg = CompressionConfig(forward="direct", forward_bits=2, backward="direct", backward_bits=4, warmup_epochs=1,
                            entropy_coding=False)  # packed sizes, counted below
    log = spawn(train, 2, cfg, 2)[0]["log"]
    first = [s for s in log if s["epoch"] == 0]
    later = [s for s in log if s["epoch"] == 1]
    assert all(s["phase"] == "warmup" for s in first) and all(s["phase"] == "train" for s in later)
    rows, ids = MICRO * MBS * SEQ, MICRO * MBS * 8  # activation rows of 16 per step, sample-id bytes
    assert (first[0]["fwd_bytes"], first[0]["bwd_bytes"]) == (rows * 64 + ids, rows * 64)  # fp32
    assert later[0]["fwd_bytes"] == rows * (16 * 2 // 8 + 8) + ids  # 2-bit codes + min/step per row
    assert later[0]["bwd_bytes"] == rows * (16 * 4 // 8 + 8)


def test_hadamard_boundaries_send_directs_bytes_and_learn(single):
    cfg = CompressionConfig(forward="hadamard", forward_bits=4, backward="hadamard", backward_bits=4,
                            entropy_coding=False)  # packed sizes, counted below
    log = spawn(train, 2, cfg, 1)[0]["log"]
    rows, ids = MICRO * MBS * SEQ, MICRO * MBS * 8
    assert log[0]["fwd_bytes"] == rows * (16 * 4 // 8 + 8) + ids  # 4-bit codes + min/step per row, as direct
    assert log[0]["bwd_bytes"] == rows * (16 * 4 // 8 + 8)
    losses, exact = [s["loss"] for s in log], [s["loss"] for s in single["log"]]
    assert losses != pytest.approx(exact, rel=1e-4)  # the rotated, quantized wires tell from the start...
    assert losses == pytest.approx(exact, rel=0.05) and losses[-1] < losses[0]  # ...and follow the exact run


def test_stages_with_different_data_orders_fail_loudly():
    with pytest.raises(RuntimeError, match="data orders differ"):
        spawn(train, 2, CompressionConfig(), 1, "1f1b", 1, timeout=120)  # imports are slow on a loaded machine


def test_activations_under_other_sample_ids_are_refused_naming_both():
    """The same tokens (so the tied rows agree) under other ids: the ids that travel with each activation, read
    together after the schedule, catch it."""
    with pytest.raises(RuntimeError, match=r"received sample ids \[\d+, \d+, \d+, \d+\] but this stage loaded"):
        spawn(train, 2, CompressionConfig(forward="aqsgd", forward_bits=2), 1, "1f1b", None, 16, False, torch.float32,
              1, timeout=120)


def test_bf16_halves_the_boundary_bytes_and_tracks_fp32(single):
    """bf16 autocast, and bf16 weights (--param_dtype bfloat16), each send bf16 activations and gradients."""
    autocast = spawn(train, 2, CompressionConfig(), 1, "1f1b", None, 16, True)[0]["log"]
    weights = spawn(train, 2, CompressionConfig(), 1, "1f1b", None, 16, False, torch.bfloat16)[0]["log"]
    per_mb = MBS * SEQ * 16
    for log in (autocast, weights):
        assert log[0]["fwd_bytes"] == MICRO * (per_mb * 2 + 8 * MBS) and log[0]["bwd_bytes"] == MICRO * per_mb * 2
        assert [s["loss"] for s in log] == pytest.approx([s["loss"] for s in single["log"]], rel=3e-2)


class Recording(ToyStage):
    """A toy stage that notes, per micro-batch, what it computed with and the gradients at its two ends."""

    def __init__(self, stage: ToyStage) -> None:
        super().__init__(stage.stage_index, stage.num_stages, list(stage.blocks), stage.embed.detach()
                         if stage.embed is not None else torch.zeros(VOCAB, stage.hidden_size))
        self.notes: list[dict] = []

    def forward(self, hidden, batch, seed=None):
        note = {"sample_id": batch["sample_id"].clone()}
        if hidden is not None:
            note["input"] = hidden.detach().clone()
            hidden.register_hook(lambda g: note.__setitem__("input_grad", g.detach().clone()))
        out = super().forward(hidden, batch, seed)
        if not self.is_last:
            note["output"] = out.detach().clone()
            out.register_hook(lambda g: note.__setitem__("output_grad", g.detach().clone()))
        self.notes.append(note)
        return out


def recorded_aqsgd(rank, world, epochs=2, buffer_bits=None):
    """2 stages, AQ-SGD 2-bit forward, exact backward: the last step's notes, weights before it, the buffers."""
    stage = Recording(toy_stages(world)[rank])
    groups = build_groups(Grid.for_world(world, world), rank)
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5),
                            EngineSettings(num_samples=SAMPLES, seq_len=SEQ), ties=toy_ties(world),
                            compression=CompressionConfig(
                                forward="aqsgd", forward_bits=2, backward="none", tie="none",
                                buffer_bits=buffer_bits))
    batches = [(epoch, mbs) for epoch in range(epochs) for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, epoch)]
    for epoch, mbs in batches[:-1]:
        engine.train_batch(mbs, epoch)
    before = {k: v.detach().clone() for k, v in stage.state_dict().items()}
    stage.notes.clear()
    engine.train_batch(*reversed(batches[-1]))
    codecs = engine.state_dict()["codecs"]
    side = "next.forward" if rank == 0 else "prev.forward"
    return {"notes": stage.notes, "before": before, "buffer": codecs[side]["buffer"], "batch": batches[-1][1]}


@pytest.fixture(scope="module")
def recorded():
    return spawn(recorded_aqsgd, 2)


def test_aqsgd_buffers_stay_bit_identical_on_both_sides_of_a_real_run(recorded):
    sender, receiver = recorded[0]["buffer"], recorded[1]["buffer"]
    assert torch.equal(sender["ids"], receiver["ids"]) and torch.equal(sender["rows"], receiver["rows"])
    seen, rows = by_sample(receiver, SAMPLES)
    assert bool(seen.all())  # two epochs: every sample visited, later visits as 2-bit changes
    # and the receiver computed with exactly those rows: m[ξ] after this step's update
    for note in recorded[1]["notes"]:
        assert torch.equal(note["input"], rows[note["sample_id"]].float())


def test_quantized_buffers_stay_bit_identical_and_are_what_the_receiver_computes_with():
    first, last = spawn(recorded_aqsgd, 2, 2, 8)
    sender, receiver = first["buffer"], last["buffer"]
    assert sender["rows"].dtype == torch.uint8 and sender["ids"].numel() == SAMPLES
    assert torch.equal(sender["rows"], receiver["rows"]) and torch.equal(sender["ids"], receiver["ids"])
    held = SampleBuffer(SAMPLES, tuple(last["notes"][0]["input"].shape[1:]), bits=8)
    assert held.row_nbytes == receiver["rows"].shape[1]  # 8-bit codes, a min and step per token
    held.load_state_dict(receiver)
    for note in last["notes"]:  # the receiver computed with the rows as the buffer holds them, decoded
        assert torch.equal(note["input"], held.rows(note["sample_id"]))


def test_the_gradient_sent_back_is_taken_at_what_the_receiver_computed_with(recorded):
    first, last = recorded
    for sent, got in zip(last["notes"], first["notes"]):
        assert torch.equal(sent["sample_id"], got["sample_id"])
        assert torch.equal(got["output_grad"], sent["input_grad"])  # backward "none": the wire is exact
        assert not torch.equal(got["output"], sent["input"])  # m[ξ] is not the sender's activation a
    # recompute stage 1's gradient from its weights before the step, at m[ξ] and at a
    stage = toy_stages(2)[1]
    stage.load_state_dict(last["before"])
    mbs = {int(mb["sample_id"][0]): mb for mb in last["batch"]}
    for sent, got in zip(last["notes"], first["notes"]):
        mb = mbs[int(sent["sample_id"][0])]

        def grad_at(x):
            x = x.clone().requires_grad_(True)
            (stage(x, mb).loss / MICRO).backward()
            return x.grad

        at_m, at_a = grad_at(sent["input"]), grad_at(got["output"])
        torch.testing.assert_close(sent["input_grad"], at_m, rtol=1e-5, atol=1e-7)
        assert (at_a - sent["input_grad"]).abs().max() > 100 * (at_m - sent["input_grad"]).abs().max() + 1e-7


def channels_in_use(rank, world):
    from aqpipe.pipeline.topology import BOUNDARY, TIE

    groups = build_groups(Grid.for_world(world, world), rank)
    stage = toy_stages(world)[groups.stage]
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.1),
                            EngineSettings(num_samples=SAMPLES, seq_len=SEQ), ties=toy_ties(world))
    mine = {key: g for key, g in groups.channels.items() if groups.stage in key[1:]}
    boundary = engine.next or engine.prev
    link = engine.tied.links[0].boundary
    ahead, back = (0, 1), (1, 0)
    out, into = (ahead, back) if groups.stage == 0 else (back, ahead)
    return {"distinct": len({id(g) for g in mine.values()}) == len(mine) == 4,
            "boundary": (boundary.outgoing is groups.channel(BOUNDARY, *out),
                         boundary.incoming is groups.channel(BOUNDARY, *into)),
            "tie": (link.outgoing is groups.channel(TIE, *out), link.incoming is groups.channel(TIE, *into)),
            "all_set": all(g is not None for g in (boundary.outgoing, boundary.incoming, link.outgoing, link.incoming))}


def test_every_message_kind_travels_on_its_own_group_each_way():
    """The construction that keeps NCCL from deadlocking (tests/unit/test_schedule.py): boundary activations,
    boundary gradients, tied rows and tied gradients each have a process group of their own."""
    for result in spawn(channels_in_use, 2):
        assert result == {"distinct": True, "boundary": (True, True), "tie": (True, True), "all_set": True}


def test_entropy_coding_sends_fewer_bytes_and_changes_no_value():
    """The entropy stage is lossless: the same losses and tied rows to the bit, each quantized wire shorter than its
    packed codes (3-bit forward codes take the mod-3 layout, 4-bit gradients the thirds)."""
    runs = {}
    for coded in (True, False):
        cfg = CompressionConfig(forward="hadamard", forward_bits=3, backward="direct", backward_bits=4,
                                entropy_coding=coded)
        runs[coded] = spawn(train, 2, cfg, 1, "1f1b", None, 512)  # messages of 6-8 KB: a table pays for itself
    on, off = runs[True][0], runs[False][0]
    assert [s["loss"] for s in on["log"]] == [s["loss"] for s in off["log"]]
    assert all(torch.equal(on["tied"][k], off["tied"][k]) for k in off["tied"])
    assert on["eval"]["loss"] == off["eval"]["loss"]
    for wire, most in (("fwd_bytes", 0.93), ("bwd_bytes", 0.95), ("tie_bytes", 1.0)):
        coded, packed = (sum(s[wire] for s in run["log"]) for run in (on, off))
        assert coded < most * packed, (wire, coded, packed)


def test_bfloat16_scales_reach_every_wire_and_learn_as_float32_scales_do():
    logs = {}
    for scales in ("float32", "bfloat16"):
        cfg = CompressionConfig(forward="hadamard", forward_bits=4, backward="direct", backward_bits=4,
                                scale_dtype=scales, entropy_coding=False)  # packed sizes, counted below
        logs[scales] = spawn(train, 2, cfg, 1)[0]["log"]
    rows, ids, tied_rows = MICRO * MBS * SEQ, MICRO * MBS * 8, step_rows().numel()
    step = logs["bfloat16"][0]
    assert step["fwd_bytes"] == rows * (16 * 4 // 8 + 4) + ids  # 4-bit codes + a bfloat16 min and step per row
    assert step["bwd_bytes"] == rows * (16 * 4 // 8 + 4)
    # the tie's first step: its rows as 8-bit changes from the copy both stages loaded (primed, no first visit) and
    # their 8-bit gradients, each 4 scale bytes a row fewer
    assert logs["float32"][0]["tie_bytes"] - step["tie_bytes"] == tied_rows * 4 * 2
    losses = {k: [s["loss"] for s in v] for k, v in logs.items()}
    assert losses["bfloat16"] != losses["float32"]  # other scales, other codes...
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.02)  # ...the same learning


def test_a_tied_weight_both_stages_loaded_alike_never_sends_a_row_whole():
    """The copies agree (one checkpoint): the first step sends each row as an 8-bit change against the copy both
    hold. A follower whose copy differs gets each row whole at its first visit, as before, and ends with the
    owner's rows all the same."""
    cfg = CompressionConfig(forward="direct", forward_bits=8, backward="direct", backward_bits=8, tie="aqsgd",
                            tie_bits=8, entropy_coding=False)  # packed sizes, counted below
    alike, nudged = spawn(train, 2, cfg, 1), spawn(train, 2, cfg, 1, "1f1b", None, 16, False, torch.float32, None, 0)
    rows = step_rows().numel()
    # a row whole is 16 float32 values; a change 16 codes and a float32 min and step
    assert nudged[0]["log"][0]["tie_bytes"] - alike[0]["log"][0]["tie_bytes"] == rows * (16 * 4 - (16 + 8))
    # and each row the epoch reads later pays its whole row once, at its first visit
    seen = torch.unique(torch.cat([mb["input_ids"].reshape(-1) for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, 0)
                                   for mb in mbs]))
    extra = [n["tie_bytes"] - a["tie_bytes"] for n, a in zip(nudged[0]["log"], alike[0]["log"])]
    assert min(extra) >= 0 and sum(extra) == seen.numel() * (16 * 4 - (16 + 8))
    read = step_rows()
    for run in (alike, nudged):  # the follower's rows it read are the owner's, to the tie's 8 bits
        follower, owner = run[0]["tied"]["embed"][read], run[1]["tied"]["embed"][read]
        assert float((follower - owner).abs().max()) < 1e-2 * float(owner.abs().max())
    assert alike[0]["log"][-1]["loss"] == pytest.approx(nudged[0]["log"][-1]["loss"], rel=1e-2)
