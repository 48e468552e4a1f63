"""AQ-SGD's first visits through a cache-free codec (direct or hadamard): fewer bytes from the first step, both sides
storing what was decoded so later deltas are taken against what the receiver holds, bit-identical over shuffled
epochs (buffers in memory, on disk, at 8 and 4 bits), and a resumed codec continuing as the uninterrupted one."""

import copy
import math

import pytest
import torch

from aqpipe.compression import forward_codec, Message, QuantizedTensor
from aqpipe.compression.running_base import RunningBase
from tests.unit.test_codecs import N, SHAPE, activation, run_epochs, wire

FIRST = [("direct", 4), ("hadamard", 4), ("hadamard", 3)]


def pair(first="hadamard", first_bits=4, buffer_bits=None, paths=(None, None)):
    kw = {"num_samples": N, "sample_shape": SHAPE, "first_visit": first, "first_visit_bits": first_bits,
          "buffer_bits": buffer_bits}
    return tuple(forward_codec("aqsgd", 2, seed=1, rotation_seed=7, buffer_path=path, **kw) for path in paths)


@pytest.mark.parametrize(("first", "bits"), FIRST)
def test_a_first_visit_is_compressed_and_both_sides_keep_what_was_decoded(first, bits):
    sender, receiver = pair(first, bits)
    ids = torch.tensor([3, 7])
    x = activation(ids, 0, 0.0)
    msg = sender.encode(x, ids)
    assert msg.nbytes == QuantizedTensor.wire_nbytes((2, *SHAPE), bits)  # not 2 x 4 x 64 float32s
    assert receiver.payload_nbytes((2, *SHAPE), torch.float32, ids) == msg.nbytes
    y = receiver.decode(wire(msg), ids)
    assert torch.equal(y, msg.decoded) and not torch.equal(y, x)  # computed with what was decoded, not x
    for side in (sender, receiver):  # stored as decoded, never the sender's exact activation
        assert torch.equal(side.buffer.rows(ids), y.half())
    # the next visit's delta is against that row: a small change costs the delta's bytes alone
    again = sender.encode(x + 0.01, ids)
    assert again.nbytes == QuantizedTensor.wire_nbytes((2, *SHAPE), 2)
    assert torch.equal(receiver.decode(wire(again), ids), again.decoded)
    # a batch of one seen and one new sample: one compressed row and one delta row
    mixed = torch.tensor([3, 11])
    msg = sender.encode(activation(mixed, 0, 0.0), mixed)
    assert msg.nbytes == QuantizedTensor.wire_nbytes((1, *SHAPE), bits) + QuantizedTensor.wire_nbytes((1, *SHAPE), 2)
    assert torch.equal(receiver.decode(wire(msg), mixed), msg.decoded)


def test_hadamard_first_visits_err_less_than_direct_on_an_outlier_channel():
    ids = torch.arange(8)
    x = activation(ids, 0, 0.0)
    x[..., 5] *= 40  # one channel tens of times the others, as GPT-2's hidden states have
    errors = {}
    for first in ("direct", "hadamard"):
        sender, receiver = pair(first, 4)
        errors[first] = float((receiver.decode(wire(sender.encode(x, ids)), ids) - x).norm() / x.norm())
    assert errors["hadamard"] < 0.5 * errors["direct"], errors


@pytest.mark.parametrize(("first", "bits"), FIRST)
@pytest.mark.parametrize("buffer_bits", [None, 8, 4])
def test_buffers_stay_bit_identical_over_shuffled_epochs(first, bits, buffer_bits):
    sender, receiver = pair(first, bits, buffer_bits)
    stats = run_epochs(sender, receiver, epochs=3, batch=5)  # asserts decode == the sender's copy, every batch
    assert torch.equal(sender.buffer.values, receiver.buffer.values)
    assert torch.equal(sender.buffer.seen, receiver.buffer.seen) and bool(sender.buffer.seen.all())
    whole = run_epochs(*pair("none", None, buffer_bits), epochs=3, batch=5)
    assert stats[0][0] == N * QuantizedTensor.wire_nbytes((1, *SHAPE), bits) < whole[0][0] / 6  # epoch 1
    assert stats[1][0] == stats[2][0] == whole[1][0] == whole[2][0]  # later epochs: the same deltas' bytes


def test_buffers_in_files_match_buffers_in_memory(tmp_path):
    in_memory = run_epochs(*pair(), epochs=2)
    in_files = pair(paths=(tmp_path / "send.buf", tmp_path / "recv.buf"))
    assert run_epochs(*in_files, epochs=2) == in_memory
    assert torch.equal(in_files[0].buffer.values, in_files[1].buffer.values)


def test_a_resumed_codec_continues_mid_epoch_as_the_uninterrupted_one(tmp_path):
    """Saved after two of five micro-batches: the remaining first visits draw the first-visit codec's dither."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    batches = [order[i:i + 5] for i in range(0, N, 5)]

    def visit(codecs, ids_list, epoch=0):
        out = []
        for ids in ids_list:
            msg = codecs[0].encode(activation(ids, epoch, 0.1), ids)
            out.append(codecs[1].decode(wire(msg), ids))
        return out

    sender, receiver = pair()
    visit((sender, receiver), batches[:2])
    torch.save({"s": sender.state_dict(), "r": receiver.state_dict()}, tmp_path / "codec.pt")
    expected = visit((sender, receiver), batches[2:]) + visit((sender, receiver), batches, epoch=1)
    resumed = pair()
    state = torch.load(tmp_path / "codec.pt", weights_only=True)
    resumed[0].load_state_dict(state["s"])
    resumed[1].load_state_dict(state["r"])
    got = visit(resumed, batches[2:]) + visit(resumed, batches, epoch=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(resumed[1].buffer.values, receiver.buffer.values)


def test_a_checkpoint_of_another_first_visit_codec_is_refused():
    hadamard, direct, whole = pair("hadamard", 4)[0], pair("direct", 4)[0], pair("none", None)[0]
    with pytest.raises(ValueError, match="first_visit: checkpoint 'hadamard' vs codec 'direct'"):
        direct.load_state_dict(hadamard.state_dict())
    with pytest.raises(ValueError, match="first_visit: checkpoint 'hadamard' vs codec 'none'"):
        whole.load_state_dict(hadamard.state_dict())
    with pytest.raises(ValueError, match="first_visit_bits: checkpoint 4 vs codec 3"):
        pair("hadamard", 3)[0].load_state_dict(hadamard.state_dict())
    older = whole.state_dict()  # a checkpoint saved before first-visit codecs existed loads as full precision
    del older["first_visit"]
    older["config"] = {k: v for k, v in older["config"].items() if not k.startswith("first_visit")}
    pair("none", None)[0].load_state_dict(older)
    with pytest.raises(ValueError, match="first_visit: checkpoint 'none' vs codec 'hadamard'"):
        hadamard.load_state_dict(older)


def test_bad_first_visit_settings_are_named():
    with pytest.raises(ValueError, match=r"mode='hadamard' needs bits"):
        pair("hadamard", None)
    with pytest.raises(ValueError, match=r"mode='aqsgd': expected one of none, direct, hadamard"):
        pair("aqsgd", 4)


def test_auto_sends_a_kept_samples_first_visit_whole_and_the_rest_as_hadamard_changes():
    """auto: the first visit of a sample the run reads back is the base of its later changes (full precision); a
    sample kept out of the buffer (never read back) goes as a 3-bit Hadamard change from the running base, at every
    visit, as a one-epoch run's every sample."""
    from aqpipe.pipeline import CompressionConfig

    auto = CompressionConfig(forward="aqsgd", forward_bits=2, first_visit="auto", first_visit_bits=3,
                             first_visit_base="position")
    assert auto.whole_rows() == ("none", "hadamard") and auto.first_visits_compressed()
    assert CompressionConfig(first_visit="direct", first_visit_bits=4).whole_rows() == ("direct", "direct")
    with pytest.raises(ValueError, match=r"^first_visit_compress='hadamart': expected one of auto, none, direct"):
        CompressionConfig(first_visit="hadamart")
    with pytest.raises(ValueError, match=r"^first_visit_bits=None: expected an integer from 1 to 8"):
        CompressionConfig(forward="aqsgd", forward_bits=2, first_visit="hadamard")
    CompressionConfig(forward="direct", forward_bits=2, first_visit="hadamard")  # no first visits: unused

    keep = torch.zeros(N, dtype=torch.bool)
    keep[:N // 2] = True
    kw = {"num_samples": N, "sample_shape": SHAPE, "first_visit": "none", "transient_visit": "hadamard",
          "first_visit_bits": 3, "first_visit_base": "position", "buffer_keep": keep}
    send, recv = (forward_codec("aqsgd", 2, seed=1, rotation_seed=7, **kw) for _ in range(2))
    one_epoch = forward_codec("aqsgd", 2, seed=1, rotation_seed=7, **{**kw, "first_visit": "hadamard",
                                                                      "transient_visit": None})
    ids = torch.tensor([N - 1, 0, N - 2, 1])  # two kept out, two kept, interleaved
    whole = torch.randn(4, *SHAPE).to(torch.bfloat16)
    m = send.encode(whole, ids)
    out = recv.decode(Message(m.payload.clone(), m.shape, m.dtype), ids)
    hadamard = QuantizedTensor.wire_nbytes((2, *SHAPE), 3)
    assert m.nbytes == 2 * math.prod(SHAPE) * 2 + hadamard  # two bf16 rows whole, two at 3 bits
    assert torch.equal(out, m.decoded) and torch.equal(out[[1, 3]], whole[[1, 3]])  # the kept ones exactly
    away = one_epoch.encode(whole[[0, 2]], ids[[0, 2]]).decoded  # a one-epoch run's codec, the same stream
    assert torch.equal(out[[0, 2]], away)
    assert send.buffer.seen.nonzero().flatten().tolist() == [0, 1] and torch.equal(send.buffer.values,
                                                                                    recv.buffer.values)
    later = whole.float() + 0.01
    again = send.encode(later, ids)
    assert again.nbytes == hadamard + QuantizedTensor.wire_nbytes((2, *SHAPE), 2, 64)  # out again whole, kept as
    assert torch.equal(recv.decode(Message(again.payload.clone(), again.shape, again.dtype), ids), again.decoded)
    state = send.state_dict()  # changes; both codecs' dither and the config travel in a checkpoint
    assert state["config"]["transient_visit"] == "hadamard" and "transient_visit" in state
    twin = forward_codec("aqsgd", 2, seed=1, rotation_seed=7, **kw)
    twin.load_state_dict(copy.deepcopy(state))
    assert torch.equal(twin.whole.transient.generator.get_state(), send.whole.transient.generator.get_state())
    with pytest.raises(ValueError, match="transient_visit: checkpoint 'hadamard' vs codec 'direct'"):
        forward_codec("aqsgd", 2, **{**kw, "transient_visit": "direct"}).load_state_dict(copy.deepcopy(state))


def based_pair(first="hadamard", bits=3, buffer_bits=None):
    kw = {"num_samples": N, "sample_shape": SHAPE, "first_visit": first, "first_visit_bits": bits,
          "buffer_bits": buffer_bits, "first_visit_base": "position"}
    return tuple(forward_codec("aqsgd", 2, seed=1, rotation_seed=7, **kw) for _ in range(2))


def with_offset(ids: torch.Tensor, epoch: int = 0) -> torch.Tensor:
    """Activations sharing a large per-position part (as position embeddings and large channels give)."""
    offset = 6 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(99))
    return activation(ids, epoch, 0.1) + offset


@pytest.mark.parametrize("buffer_bits", [None, 4])
def test_a_running_base_keeps_both_sides_bit_identical_and_sends_the_same_bytes(buffer_bits):
    sender, receiver = based_pair(buffer_bits=buffer_bits)
    stats = run_epochs(sender, receiver, epochs=2, batch=5)
    assert torch.equal(sender.whole.base.mean, receiver.whole.base.mean) and sender.whole.base.count == N
    assert torch.equal(sender.buffer.values, receiver.buffer.values)
    assert [s for s, _ in stats] == [s for s, _ in run_epochs(*pair("hadamard", 3, buffer_bits), epochs=2, batch=5)]


def test_a_running_base_is_the_mean_of_its_first_window_then_follows_with_weight_one_over_window():
    base = RunningBase((1,), window=4)
    for value in (1.0, 2.0, 3.0, 4.0):
        base.update(torch.tensor([[value]]))
    assert base.mean.item() == 2.5  # the cumulative mean of the first 4 samples
    base.update(torch.tensor([[10.0]]))
    assert base.mean.item() == 2.5 + (10.0 - 2.5) / 4  # then a quarter a sample, not a fifth
    base.update(torch.tensor([[0.0], [2.0]]))
    assert base.mean.item() == pytest.approx(4.375 + (1.0 - 4.375) * 2 / 4)  # a message of 2: their mean, by 2/4


def test_a_running_base_errs_less_where_samples_share_a_part():
    errors = {}
    for name, codecs in (("plain", pair("hadamard", 3)), ("base", based_pair())):
        sent = 0.0
        for start in range(0, N, 4):
            ids = torch.arange(start, start + 4)
            x = with_offset(ids)
            y = codecs[1].decode(wire(codecs[0].encode(x, ids)), ids)
            if start >= 8:  # after two micro-batches the base has seen 8 samples
                sent += float((y - x).norm() / x.norm())
        errors[name] = sent
    assert errors["base"] < 0.5 * errors["plain"], errors


def test_a_running_base_resumes_and_is_refused_by_a_codec_without_one(tmp_path):
    sender, receiver = based_pair()
    ids = torch.arange(8)
    receiver.decode(wire(sender.encode(with_offset(ids), ids)), ids)
    saved = receiver.state_dict()
    again = based_pair()[1]
    again.load_state_dict(saved)
    assert torch.equal(again.whole.base.mean, receiver.whole.base.mean) and again.whole.base.count == 8
    with pytest.raises(ValueError, match="first_visit_base: checkpoint 'position' vs codec 'none'"):
        pair("hadamard", 3)[1].load_state_dict(saved)
    with pytest.raises(ValueError, match=r"first_visit_base='position': expected a compressed first visit"):
        based_pair("none", None)


def test_an_undone_step_leaves_no_trace_in_the_base_or_the_first_visit_dither():
    """A step rejected for a NaN is undone: the same micro-batch encoded again sends the same bytes."""
    sender, _ = based_pair()
    ids = torch.arange(4)
    sender.encode(with_offset(ids), ids)  # the base has seen 4 samples
    later = torch.arange(4, 8)
    restore = sender.undo_point(later)
    streams = [c.generator.get_state() for c in sender.whole.codecs()]
    first = sender.encode(with_offset(later), later)
    mean, count = sender.whole.base.mean.clone(), sender.whole.base.count
    assert any(not torch.equal(c.generator.get_state(), s) for c, s in zip(sender.whole.codecs(), streams))  # dithered
    restore()
    assert all(torch.equal(c.generator.get_state(), s) for c, s in zip(sender.whole.codecs(), streams))
    assert sender.whole.base.count == 4 and not torch.equal(sender.whole.base.mean, mean)
    again = sender.encode(with_offset(later), later)
    assert torch.equal(again.payload, first.payload) and torch.equal(sender.whole.base.mean, mean) and count == 8


def test_whole_first_visits_ignore_a_presets_bits_so_older_checkpoints_resume():
    """The trainer's preset carries first-visit bits that `none` does not use; a codec state saved before first-visit
    codecs (no such keys) loads into a codec built from it."""
    older = forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE).state_dict()
    del older["first_visit"]
    older["config"] = {k: v for k, v in older["config"].items() if not k.startswith("first_visit")}
    forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE, first_visit="none",
                 first_visit_bits=3).load_state_dict(older)
