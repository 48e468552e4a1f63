"""Deferred sends (pipeline/departures.py) over a real gloo pair: every send of a wire that defers goes through one
worker thread, so a peer receives its messages in the order they were sent whatever their tag or coding, the bytes
arrive as they were, and each counts on the wire it names once `flush` has sent it: an entropy-coded message its
coded length, the same as the wire that sends at once."""
import torch

from tests.helpers.processes import spawn

# (size, tag, coded, counter): codes of a few levels, as a compressing codec's, and raw bytes
PLAN = [(4000, 0, True, "fwd_bytes"), (16, 7, False, "tie_bytes"), (3000, 0, True, "fwd_bytes"),
        (2500, 7, True, "tie_bytes"), (64, 0, False, None), (5000, 0, False, "bwd_bytes")]


def payload(i: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 4 if i % 2 == 0 else 256, (size,), generator=g, dtype=torch.uint8)


def exchange(rank: int, world: int, defer: bool) -> dict:
    from aqpipe.pipeline.transport import Wire

    torch.set_num_threads(1)
    wire = Wire(entropy=True, defer=defer)
    if rank == 0:
        for i, (size, tag, coded, counter) in enumerate(PLAN):
            wire.send(payload(i, size), 1, tag=tag, code=coded, counter=counter)
        early = wire.take_sent()  # a deferred send counts once it has gone
        wire.flush()
        return {"early": early, "sent": wire.take_sent()}
    posted = [wire.post(size, 0, torch.device("cpu"), tag=tag, code=coded) for size, tag, coded, _ in PLAN]
    got = [p.wait() for p in posted]
    return {"equal": [torch.equal(g, payload(i, size)) for i, (g, (size, *_)) in enumerate(zip(got, PLAN))]}


def test_deferred_sends_arrive_in_order_and_count_as_sends_made_at_once():
    deferred, at_once = spawn(exchange, 2, True), spawn(exchange, 2, False)
    assert deferred[1]["equal"] == [True] * len(PLAN)
    assert deferred[0]["early"] == {}
    assert deferred[0]["sent"] == at_once[0]["early"] and at_once[0]["sent"] == {}  # at once: counted as sent
    sent = deferred[0]["sent"]
    assert set(sent) == {"fwd_bytes", "tie_bytes", "bwd_bytes"}  # the probe-like send counts on none
    assert sent["bwd_bytes"] == 5000 and sent["fwd_bytes"] < 7000 / 2  # coded: 2-bit codes in whole bytes


def two_steps(rank: int, world: int, defer: bool) -> list[tuple]:
    """A 2-stage toy job with a tied weight and AQ-SGD codecs, its wire sending through departures or at once."""
    from aqpipe.pipeline import CompressionConfig, EngineSettings, Grid, PipelineEngine, build_groups
    from aqpipe.pipeline.departures import Departures
    from tests.helpers.toy import toy_batches, toy_stages, toy_ties

    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = toy_stages(world)[groups.stage]
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5),
                            EngineSettings(num_samples=32, seq_len=8), compression=CompressionConfig(),
                            ties=toy_ties(world))
    engine.wire.departures = Departures() if defer else None
    out = []
    for batch in list(toy_batches(32, 8, 2, 3, 0))[:3]:
        if defer:  # a tally left from before the step (a step that raised) is not this step's
            engine.wire.count("fwd_bytes", 10**6)
        m = engine.train_batch(batch)
        out.append((m.loss, m.fwd_bytes, m.bwd_bytes, m.tie_bytes))
    return out


def test_a_pipeline_step_through_departures_is_the_step_sent_at_once():
    """The same losses and bytes either way, and a step counts its own bytes alone."""
    deferred, at_once = spawn(two_steps, 2, True), spawn(two_steps, 2, False)
    assert deferred == at_once
    assert all(row[1] > 0 and row[2] > 0 and row[3] > 0 for row in deferred[0] + deferred[1])
