"""Bits per link in a real pipeline: both sides of every boundary use the same bits at every step, the
choice follows the links, is logged, and a resumed run continues with it exactly."""
import copy

import pytest
import torch

from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_batches, toy_stages, toy_ties

SEQ, MBS, MICRO, SAMPLES, HIDDEN = 8, 4, 2, 32, 64


def engine(rank: int, world: int, compression: CompressionConfig) -> PipelineEngine:
    torch.set_num_threads(1)
    stage = toy_stages(world, hidden=HIDDEN)[rank]
    groups = build_groups(Grid.for_world(world, world), rank)
    return PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5),
                          EngineSettings(num_samples=SAMPLES, seq_len=SEQ), compression=compression,
                          ties=toy_ties(world))


def batches(epochs: int) -> list[tuple[int, list]]:
    return [(e, mbs) for e in range(epochs) for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, e)]


def codec_bits(e: PipelineEngine) -> dict[str, int]:
    return {name: codec.bits for name, codec in e.codecs().items() if name.split(".")[0] in ("prev", "next")}


def run(rank: int, world: int, compression: CompressionConfig) -> dict:
    e = engine(rank, world, compression)
    log, seen = [], []
    steps = batches(3)
    for epoch, mbs in steps[:6]:
        log.append(e.train_batch(mbs, epoch).record())
        seen.append(codec_bits(e))
    saved = copy.deepcopy(e.state_dict())  # state_dicts hold references: a copy, as a checkpoint file is
    for epoch, mbs in steps[6:]:
        log.append(e.train_batch(mbs, epoch).record())
    resumed = engine(rank, world, compression)
    resumed.load_state_dict(saved)
    again = [resumed.train_batch(mbs, epoch).record() for epoch, mbs in steps[6:]]
    codecs = e.state_dict()["codecs"]
    buffers = {k: v["buffer"]["rows"] for k, v in codecs.items() if "buffer" in v}
    return {"log": log, "seen": seen, "again": again, "buffers": buffers}


@pytest.fixture(scope="module")
def known():
    """4 stages, boundary 1 on a slow link (0.5 Mbit/s), the others fast: decided from the given rates."""
    cfg = CompressionConfig(forward="aqsgd", forward_bits="auto", backward="direct", backward_bits="auto",
                            auto_bits_every=4, link_mbit=[1000.0, 0.5, 1000.0],
                            entropy_coding=False)  # packed sizes, counted below
    return spawn(run, 4, cfg)


def test_the_slow_link_gets_fewer_bits_and_both_sides_switch_together(known):
    logs = [r["log"] for r in known]
    assert all(log == logs[0] or [s["bits"] for s in log] == [s["bits"] for s in logs[0]] for log in logs)
    first, later = logs[0][0]["bits"], logs[0][-1]["bits"]
    assert first == {f"{b}.{d}": 8 for b in range(3) for d in ("forward", "backward")}  # until the first decision
    assert later["1.forward"] == later["1.backward"] == 2  # 0.5 Mbit/s: the bottleneck, the fewest
    assert later["0.forward"] == later["2.forward"] == later["0.backward"] == 8  # fast links: the most
    decisions = [s["step"] for s in logs[0] if s["bits_decision"] is not None]
    assert decisions == [1, 5, 9]  # every 4 steps, from the first
    assert logs[0][0]["bits_decision"]["links"]["1.forward"][0] == pytest.approx(8 / 0.5e6)
    for s in range(6):  # the codecs themselves, both sides of each boundary
        for b in range(3):
            sender, receiver = known[b]["seen"][s], known[b + 1]["seen"][s]
            assert sender["next.forward"] == receiver["prev.forward"]
            assert sender["next.backward"] == receiver["prev.backward"]
    # the bytes follow: boundary 1's gradients go back at 2 bits from the second step on (activations of the
    # first epoch are first visits, sent whole)
    rows = MBS * SEQ * MICRO
    assert logs[0][0]["bwd_bytes"] - logs[0][1]["bwd_bytes"] == rows * (HIDDEN * 8 // 8 - HIDDEN * 2 // 8 - 8 * (
        HIDDEN // 64 - 1))


def test_buffers_stay_bit_identical_and_a_resumed_run_continues_exactly(known):
    for b in range(3):
        assert torch.equal(known[b]["buffers"]["next.forward"], known[b + 1]["buffers"]["prev.forward"])
    for r in known:
        straight = [{k: v for k, v in s.items() if k != "seconds"} for s in r["log"][6:]]
        resumed = [{k: v for k, v in s.items() if k != "seconds"} for s in r["again"]]
        for a, b in zip(straight, resumed):
            a.pop("bubble"), b.pop("bubble")
            if a["bits_decision"]:
                for key in ("compute", "step_seconds_fewest", "step_seconds_chosen"):  # from measured compute times
                    a["bits_decision"].pop(key), b["bits_decision"].pop(key)
        assert resumed == straight


def test_probed_links_decide_the_same_on_every_rank():
    cfg = CompressionConfig(forward="direct", forward_bits="auto", backward="direct", backward_bits=4,
                            auto_bits_every=3, auto_bits_min=3, auto_bits_max=6)
    results = spawn(run, 2, cfg)
    a, b = (r["log"] for r in results)
    assert [s["bits"] for s in a] == [s["bits"] for s in b]
    decision = a[0]["bits_decision"]
    assert decision == b[0]["bits_decision"] and set(decision["bits"]) == {"0.forward"}  # backward is fixed
    seconds_per_byte, latency = decision["links"]["0.forward"]
    # loopback: far faster than 10 Mbit/s (its time a byte may be below the timer's noise: the probe clamps it at 0),
    # and a round trip measured: a probe that timed nothing says 0 s of latency
    assert seconds_per_byte < 8 / 10e6 and 0 < latency < 0.05
    assert all(3 <= s["bits"]["0.forward"] <= 6 for s in a)
