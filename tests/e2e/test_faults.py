"""Faults: NaN/inf never crosses a boundary and stops (or skips) a step on every stage alike. (A rank SIGKILLed
mid-run stops its peer within a bounded time, naming it, and the run resumes exactly: test_no_shared_filesystem.py,
on two machines.)"""
import io
from dataclasses import replace
import re

import pytest
import torch

from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups
from aqpipe import faults
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_batches, toy_stages, toy_ties

SEQ, MBS, MICRO, SAMPLES = 8, 4, 2, 16
AQSGD = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4)
DIRECT = CompressionConfig(forward="direct", forward_bits=4, backward="direct", backward_bits=4)
NAN = float("nan")


def _copy(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def nonfinite(rank, world):
    """Skip mode with a NaN activation on stage 0 in an AQ-SGD epoch; stop mode with a NaN loss / gradient."""
    grid = Grid.for_world(world, world)
    groups = build_groups(grid, rank)
    plan = [(epoch, mbs) for epoch in range(4) for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO, epoch)]  # 8 steps
    poison = {"on": False, "kind": "activation"}

    def make(skip, compression=AQSGD):
        stage = toy_stages(world)[groups.stage]
        engine = PipelineEngine(stage, groups, torch.optim.Adam(stage.parameters(), lr=0.01),
                                EngineSettings(num_samples=SAMPLES, seq_len=SEQ, skip_nonfinite=skip),
                                compression=compression, ties=toy_ties(world))

        def hook(module, inputs, out):
            if not poison["on"]:
                return out
            if poison["kind"] == "activation" and groups.stage == 0:
                return out * NAN
            if poison["kind"] == "range" and groups.stage == 0:  # finite, but a group's range beyond float32's
                wide = torch.full_like(out, 3e38)
                wide[..., ::2] = -3e38
                return out * 0 + wide
            if poison["kind"] == "overflow" and groups.stage == 0:
                return out + 7e4  # finite in float32, beyond float16's 65504
            if poison["kind"] == "loss" and stage.is_last:
                return type(out)(out.loss * NAN, out.logits)
            if poison["kind"] == "gradient" and stage.is_last:
                out.loss.register_hook(lambda g: g * NAN)
            return out
        stage.register_forward_hook(hook)
        if not stage.is_last:  # stage 0's copy of the tied embedding: only its gradient goes non-finite
            stage.embed.register_hook(lambda g: g * NAN if poison["on"] and poison["kind"] == "tied" else g)
        return engine

    engine, wire_finite = make(skip=True), []
    codec = engine.prev.forward if engine.prev else engine.next.backward  # what this rank decodes off the wire
    decode = codec.decode

    def checked(*args, **kw):
        x = decode(*args, **kw)
        wire_finite.append(bool(torch.isfinite(x).all()))
        return x
    codec.decode = checked
    out = {"losses": []}
    for step, (epoch, mbs) in enumerate(plan):
        poison["on"] = step == 5  # epoch 2: every sample seen, AQ-SGD sends deltas
        before = _copy(engine.state_dict())
        metrics = engine.train_batch(mbs, epoch)
        out["losses"].append(metrics.loss)
        if step == 5:
            out["skipped"] = metrics.skipped
            after = _copy(engine.state_dict())
            out["untouched"] = {k: _same(before[k], after[k]) for k in ("model", "optimizer", "codecs")}
    out["wire_finite"] = all(wire_finite) and len(wire_finite) > 0
    for kind in ("loss", "gradient", "tied"):
        engine, poison["kind"], poison["on"] = make(skip=False), kind, True
        try:
            engine.train_batch(plan[0][1], 0)
        except FloatingPointError as exc:
            out[kind] = str(exc)
    # finite values a quantizer cannot scale (a group spanning more than float32 holds): found with the step's other
    # flags after the schedule (no read per message), the step skipped on every rank alike
    engine, poison["kind"] = make(skip=True, compression=DIRECT), "range"
    out["range"] = engine.train_batch(plan[0][1], 0).skipped
    # a first visit a float16 buffer cannot hold stops every rank, skip or not, with nothing stored
    engine, poison["kind"] = make(skip=True), "overflow"
    try:
        engine.train_batch(plan[0][1], 0)
    except ValueError as exc:
        out["overflow"] = str(exc)
    buffer = next(c["buffer"] for c in engine.state_dict()["codecs"].values() if "buffer" in c)
    out["overflow_stored"] = bool(buffer["ids"].numel()) or bool(buffer["rows"].numel())
    out["overflow_sample"] = int(plan[0][1][0]["sample_id"][0])
    # the remedy trains that step: stored, and the loss of the same step with a float32 buffer
    for dtype in (torch.bfloat16, torch.float32):
        roomy = make(skip=False, compression=replace(AQSGD, buffer_dtype=dtype))
        metrics = roomy.train_batch(plan[0][1], 0)
        held = next(c["buffer"]["ids"] for c in roomy.state_dict()["codecs"].values() if "buffer" in c)
        ids = torch.cat([mb["sample_id"].reshape(-1) for mb in plan[0][1]])
        out[str(dtype)] = {"loss": metrics.loss, "skipped": metrics.skipped,
                           "stored": bool(torch.isin(ids, held).all())}
    return out


@pytest.fixture(scope="module")
def nonfinite_runs():
    return spawn(nonfinite, 2)


def test_a_nan_activation_is_never_sent_and_the_step_is_skipped_on_every_stage(nonfinite_runs):
    for run in nonfinite_runs:
        assert run["skipped"] == ("non-finite values at step 6: stage 0 (rank 0, replica 0): activation to send "
                                  "(micro-batch 0)")
        assert run["untouched"] == {"model": True, "optimizer": True, "codecs": True}  # AQ-SGD rows, dither too
        assert run["wire_finite"]
        losses = run["losses"]
        assert losses[5] != losses[5] and all(v == v for v in losses[:5] + losses[6:])  # only step 6 is NaN


def test_an_activation_a_quantizer_cannot_scale_skips_the_step_on_every_stage(nonfinite_runs):
    for run in nonfinite_runs:
        # the sender names its message (the receiver's loss, computed from what it decoded, follows)
        assert run["range"].startswith("non-finite values at step 1: stage 0 (rank 0, replica 0): activation to send "
                                       "(micro-batch 0)"), run["range"]


def test_a_nan_loss_or_gradient_stops_every_stage_naming_where(nonfinite_runs):
    for run in nonfinite_runs:
        assert run["loss"].startswith("non-finite values at step 1: stage 1 (rank 1, replica 0): loss (micro-batch 0)")
        assert "stage 1 (rank 1, replica 0): boundary gradient to send (micro-batch 0)" in run["gradient"]
        assert "skip_nonfinite" in run["loss"]
        # the follower's tied copy: its rows went to the owner as zeros, and the step stops naming that stage
        assert run["tied"].startswith("non-finite values at step 1: stage 0 (rank 0, replica 0): parameter gradients;")
        assert "stage 1" not in run["tied"]


def test_an_activation_beyond_the_float16_buffer_stops_every_rank_naming_boundary_sample_and_remedy(nonfinite_runs):
    sample = nonfinite_runs[0]["overflow_sample"]
    line = (rf"boundary 0 \(stage 0 to 1, rank 0, replica 0\): sample {sample}'s activation reaches 7(\.\d+)?e\+04 at "
            r"step 1, beyond what the float16 AQ-SGD buffer can hold: use buffer_dtype bfloat16 or float32 "
            r"\(--buffer_dtype\)")
    assert re.fullmatch(line, nonfinite_runs[0]["overflow"]), nonfinite_runs[0]["overflow"]
    for run in nonfinite_runs:  # the same line on both ranks, nothing stored on either side of the boundary
        assert run["overflow"] == nonfinite_runs[0]["overflow"]
        assert not run["overflow_stored"]
        roomy, exact = run["torch.bfloat16"], run["torch.float32"]  # a bfloat16 buffer holds it: the step trains
        assert roomy["skipped"] is None and roomy["stored"] and exact["stored"]
        assert roomy["loss"] == pytest.approx(exact["loss"], rel=1e-2)


def test_fault_specs_are_checked():
    assert faults.parse("kill:1:5") == faults.Fault("kill", 1, 5)
    assert faults.parse(None) is None
    with pytest.raises(ValueError, match="AQPIPE_FAULT='boom:1:5': expected KIND:RANK:STEP"):
        faults.parse("boom:1:5")
