"""Boundary codecs: the two sides agree bit for bit, AQ-SGD sends less and errs less over time."""
import copy
import math

import pytest
import torch

from aqpipe.compression import (BackwardCodec, BufferRangeError, forward_codec, Message, QuantizedTensor, SampleBuffer,
                         SampleIds, dequantize, quantize)

N, SHAPE = 24, (4, 64)  # dataset size, one sample's activation (seq, hidden)


def pair(mode="aqsgd", bits=2, sender_path=None, receiver_path=None):
    """A sender and a receiver codec for one boundary (each with its own buffer file, if any)."""
    kw = {"num_samples": N, "sample_shape": SHAPE} if mode == "aqsgd" else {}
    return (forward_codec(mode, bits, seed=1, buffer_path=sender_path, **kw),
            forward_codec(mode, bits, seed=1, buffer_path=receiver_path, **kw))


def wire(message: Message) -> Message:
    """What the receiver rebuilds: the payload bytes only, copied as a transport would."""
    return Message(message.payload.clone(), message.shape, message.dtype)


def activation(ids: torch.Tensor, epoch: int, drift: float) -> torch.Tensor:
    """A deterministic per-sample activation that drifts by `drift` per epoch."""
    base = torch.stack([torch.randn(SHAPE, generator=torch.Generator().manual_seed(int(i))) for i in ids])
    moves = torch.stack([torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 + int(i))) for i in ids])
    return base + drift * epoch * moves


def run_epochs(sender, receiver, epochs=3, batch=5, drift=0.1, seed=0):
    """Shuffled epochs of micro-batches through both sides; returns per-epoch (bytes, mean abs error)."""
    g = torch.Generator().manual_seed(seed)
    stats = []
    for epoch in range(epochs):
        order = torch.randperm(N, generator=g)
        sent, err, count = 0, 0.0, 0
        for start in range(0, N, batch):
            ids = order[start : start + batch]
            x = activation(ids, epoch, drift)
            msg = sender.encode(x, ids)
            y = receiver.decode(wire(msg), ids)
            assert torch.equal(y, msg.decoded)  # the sender sees exactly what the receiver computes with
            for side in (sender, receiver) if epoch and sender.buffer is not None else ():  # a change's decode is
                assert torch.equal(y, side.buffer.rows(ids).to(y.dtype)), epoch  # m[ξ] as each side stores it
            sent += msg.nbytes
            err += float((y - x).abs().sum())
            count += x.numel()
        stats.append((sent, err / count))
    return stats


def test_buffers_stay_bit_identical_over_three_shuffled_epochs():
    sender, receiver = pair()
    run_epochs(sender, receiver, epochs=3, batch=5)  # the first epoch's visits whole, later ones as changes
    assert torch.equal(sender.buffer.values, receiver.buffer.values)
    assert torch.equal(sender.buffer.seen, receiver.buffer.seen)
    assert bool(sender.buffer.seen.all())


def test_first_visit_is_whole_and_later_visits_are_quantized_deltas():
    sender, receiver = pair(bits=2)
    ids = torch.tensor([3, 7])
    x = activation(ids, 0, 0.0)
    first = sender.encode(x, ids)
    assert first.nbytes == 2 * math.prod(SHAPE) * 4  # full precision (float32)
    assert torch.equal(receiver.decode(wire(first), ids), x)  # computed with exactly as sent
    assert torch.equal(receiver.buffer.rows(ids), x.half())  # and stored in the float16 buffer
    second = sender.encode(x + 0.01, ids)
    assert second.nbytes == QuantizedTensor.wire_nbytes((2, *SHAPE), 2)
    assert second.nbytes < first.nbytes / 4
    # a batch with one seen and one new sample carries one whole row and one delta row
    mixed_ids = torch.tensor([3, 11])
    mixed = sender.encode(activation(mixed_ids, 0, 0.0), mixed_ids)
    assert mixed.nbytes == math.prod(SHAPE) * 4 + QuantizedTensor.wire_nbytes((1, *SHAPE), 2)
    assert receiver.payload_nbytes((2, *SHAPE), torch.float32, ids) == second.nbytes


def test_first_visit_is_per_sample_not_per_epoch():
    sender, receiver = pair()
    (bytes0, _), (bytes1, _) = run_epochs(sender, receiver, epochs=2)
    assert bytes1 < bytes0 / 10  # epoch 2 sends no sample whole again


def test_aqsgd_error_shrinks_as_activations_settle_but_directq_does_not():
    def errors(mode, drift):
        s, r = pair(mode, 2)
        return [e for _, e in run_epochs(s, r, epochs=4, drift=drift)]

    aq_fast, aq_slow = errors("aqsgd", 0.2), errors("aqsgd", 0.01)
    dq_fast, dq_slow = errors("direct", 0.2), errors("direct", 0.01)
    assert aq_slow[-1] < aq_fast[-1] / 5  # self-enforcing: smaller change, smaller error
    assert aq_slow[-1] < dq_slow[-1] / 10
    assert dq_slow[-1] > dq_fast[-1] * 0.8  # DirectQ's error does not care how much activations move


def test_none_mode_is_exact_and_sends_raw_bytes():
    s, r = forward_codec("none"), forward_codec("none")
    x = torch.randn(3, 4, 5)
    msg = s.encode(x, torch.arange(3))
    assert msg.nbytes == x.numel() * 4
    assert torch.equal(r.decode(wire(msg)), x)


def test_direct_mode_round_trip_matches_the_senders_copy():
    s, r = forward_codec("direct", 3, seed=2), forward_codec("direct", 3)
    x = torch.randn(3, 4, 50).to(torch.bfloat16)
    msg = s.encode(x)
    y = r.decode(wire(msg))
    assert y.dtype == torch.bfloat16 and torch.equal(y, msg.decoded)
    assert msg.nbytes == QuantizedTensor.wire_nbytes(x.shape, 3)


def test_refresh_resends_whole_rows_on_both_sides():
    sender, receiver = pair()
    ids = torch.tensor([1, 2])
    for epoch in range(2):  # the second refresh of rows both sides already hold: each side's row is reset to it
        x = activation(ids, epoch, 0.5)
        msg = sender.encode(x, ids, refresh=True)
        assert msg.nbytes == 2 * math.prod(SHAPE) * 4
        assert torch.equal(receiver.decode(wire(msg), ids, refresh=True), msg.decoded)
        for side in (sender, receiver):
            assert torch.equal(side.buffer.rows(ids), x.to(side.buffer.rows(ids).dtype))
    with pytest.raises(ValueError, match="buffers disagree"):
        receiver.decode(wire(sender.encode(x, ids, refresh=True)), ids)  # refresh on one side only


def test_state_dict_resume_does_not_resend_and_continues_identically(tmp_path):
    sender, receiver = pair()
    run_epochs(sender, receiver, epochs=1)
    torch.save({"s": sender.state_dict(), "r": receiver.state_dict()}, tmp_path / "ckpt.pt")
    reference = run_epochs(sender, receiver, epochs=1, seed=9)  # uninterrupted continuation

    s2, r2 = pair()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    s2.load_state_dict(state["s"])
    r2.load_state_dict(state["r"])
    resumed = run_epochs(s2, r2, epochs=1, seed=9)
    assert resumed == reference  # same bytes (nothing resent whole) and the same errors
    assert torch.equal(s2.buffer.values, sender.buffer.values)


def test_state_from_another_config_is_refused():
    s = forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE)
    other = forward_codec("aqsgd", 4, num_samples=N, sample_shape=SHAPE)
    with pytest.raises(ValueError, match="bits: checkpoint 2 vs codec 4"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_samples: checkpoint 24 vs codec 25"):
        forward_codec("aqsgd", 2, num_samples=N + 1, sample_shape=SHAPE).load_state_dict(s.state_dict())


def test_disk_backed_buffers_match_memory_and_live_in_the_file(tmp_path):
    mem_s, mem_r = pair()
    disk_s, disk_r = pair(sender_path=tmp_path / "send.buf", receiver_path=tmp_path / "recv.buf")
    assert run_epochs(disk_s, disk_r, epochs=2) == run_epochs(mem_s, mem_r, epochs=2)
    assert torch.equal(disk_s.buffer.values, mem_s.buffer.values)
    size = N * math.prod(SHAPE) * 2
    assert (tmp_path / "send.buf").stat().st_size == size
    on_disk = torch.from_file(str(tmp_path / "recv.buf"), size=N * math.prod(SHAPE), dtype=torch.float16)
    assert torch.equal(on_disk.view(N, *SHAPE), mem_r.buffer.values)


def test_a_stale_buffer_file_is_emptied_and_its_bytes_never_reach_a_row(tmp_path):
    path = tmp_path / "old.buf"
    path.write_bytes(b"\x7f" * 100_000)  # a killed run's file, of another size
    codec = forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE, buffer_path=path)
    assert path.stat().st_size == N * math.prod(SHAPE) * 2 and b"\x7f" not in path.read_bytes()  # no old byte
    ids = torch.tensor([5])
    x = activation(ids, 0, 0.0)
    codec.encode(x, ids)
    assert codec.buffer.seen.nonzero().flatten().tolist() == [5] and torch.equal(codec.buffer.rows(ids), x.half())


@pytest.mark.parametrize("ids,match", [
    ([0, 24, 3], r"sample id 24 is out of range: expected 0 <= id < num_samples=24"),
    ([-1, 2, 3], r"sample id -1 is out of range"),
    ([1, 1, 2], r"repeat an index"),
    ([1, 2], r"2 sample_ids for a micro-batch of 3"),
    ([[1, 2, 3]], r"expected a 1-D vector"),
    ([1.0, 2.0, 3.0], r"expected integer dataset indices"),
])
def test_bad_sample_ids_are_refused(ids, match):
    s = forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE)
    with pytest.raises(ValueError, match=match):
        s.encode(torch.randn(3, *SHAPE), torch.tensor(ids))


def test_wrong_sample_shape_is_refused_with_the_numbers():
    s = forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE)
    with pytest.raises(ValueError, match=r"shape \(2, 4, 65\).*sample_shape=\(4, 64\)"):
        s.encode(torch.randn(2, 4, 65), torch.tensor([0, 1]))


@pytest.mark.parametrize("mode", ["direct", "hadamard", "aqsgd"])
def test_nan_is_never_encoded(mode):
    s = pair(mode)[0]
    x = torch.randn(2, *SHAPE)
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 non-finite value.*first at index \(1, 2, 3\)"):
        s.encode(x, torch.tensor([0, 1]))


@pytest.mark.parametrize("mode", ["direct", "hadamard", "aqsgd"])
def test_deferred_checks_flag_each_message_instead_of_raising(mode):
    """A pipeline's codecs defer their checks: each message leaves a value (0-dim, its largest group step) its step
    reads with the others at once, not finite where a group's range is beyond float32. (AQ-SGD's rows are stored in
    host memory, checked as they are stored.)"""
    s, ids = pair(mode)[0], torch.tensor([0, 1])
    s.defer_checks()
    good = torch.randn(2, *SHAPE)
    s.encode(good, ids)
    values = s.take_checks()
    assert values and all(v.dim() == 0 and bool(torch.isfinite(v)) for v in values)
    assert s.take_checks() == []  # taken once
    if mode == "aqsgd":
        return
    wide = torch.full((2, *SHAPE), 3e38)
    wide[..., ::2] = -3e38
    s.encode(wide, ids)  # no ValueError: the flag says it
    assert not all(bool(torch.isfinite(v)) for v in s.take_checks())
    with pytest.raises(ValueError, match="wider than float32|non-finite"):  # what an eager codec says
        pair(mode)[0].encode(wide, ids)


def test_a_full_precision_wire_carries_what_it_is_given_without_reading_it_on_the_host():
    """No quantizer, no scale for a NaN to spoil: mode none checks nothing (a check would sync a GPU each message);
    the engine's step guard zeros a NaN before it is sent and rejects the step."""
    s, r = pair("none")
    x = torch.randn(2, *SHAPE)
    x[1, 2, 3] = float("nan")
    y = r.decode(wire(s.encode(x, torch.tensor([0, 1]))))
    assert torch.equal(y.isnan(), x.isnan()) and torch.equal(y.nan_to_num(), x.nan_to_num())


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="mode='int8': expected one of none, direct, hadamard, aqsgd"):
        forward_codec("int8", 8)
    with pytest.raises(ValueError, match="needs bits"):
        forward_codec("direct")
    with pytest.raises(ValueError, match="bits=9"):
        forward_codec("aqsgd", 9, num_samples=N, sample_shape=SHAPE)
    with pytest.raises(ValueError, match="needs num_samples"):
        forward_codec("aqsgd", 2)
    with pytest.raises(ValueError, match="num_samples=0"):
        forward_codec("aqsgd", 2, num_samples=0, sample_shape=SHAPE)
    with pytest.raises(ValueError, match="mode='aqsgd': expected one of none, direct"):
        BackwardCodec("aqsgd", 2)


def test_truncated_payload_is_refused():
    s, r = forward_codec("direct", 2), forward_codec("direct", 2)
    msg = s.encode(torch.randn(2, 8))
    with pytest.raises(ValueError, match="payload has"):
        r.decode(Message(msg.payload[:-3], msg.shape, msg.dtype))


@pytest.mark.parametrize("mode,bits", [("none", None), ("direct", 4)])
def test_backward_codec(mode, bits):
    s, r = BackwardCodec(mode, bits, seed=3), BackwardCodec(mode, bits)
    g = torch.randn(4, *SHAPE) * 1e-3
    msg = s.encode(g)
    y = r.decode(wire(msg))
    assert torch.equal(y, msg.decoded)
    assert msg.nbytes == r.payload_nbytes(g.shape, g.dtype)
    if mode == "none":
        assert torch.equal(y, g)
    else:
        assert msg.nbytes == g.numel() // 2 + 8 * g.numel() // SHAPE[-1]  # 4-bit codes + 8 bytes of scales a row
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15  # each row's own quantization step
        assert ((y - g).abs() <= step * 1.0001).all()


def test_codec_state_restores_the_dither_stream():
    s = forward_codec("direct", 2, seed=5)
    x = torch.randn(3, 40)
    state = s.state_dict()
    a = s.encode(x)
    assert not torch.equal(s.encode(x).payload, a.payload)  # it dithers: the stream moved on, other bits
    s.load_state_dict(state)
    assert torch.equal(s.encode(x).payload, a.payload)


def test_one_bit_aqsgd_warns_that_it_is_outside_the_theorem():
    with pytest.warns(UserWarning, match="c_Q > 1"):
        forward_codec("aqsgd", 1, num_samples=N, sample_shape=SHAPE)


def test_missing_sample_ids_are_refused():
    with pytest.raises(ValueError, match="sample_ids is None"):
        forward_codec("aqsgd", 2, num_samples=N, sample_shape=SHAPE).encode(torch.randn(2, *SHAPE))


def test_an_activation_a_float16_buffer_cannot_hold_is_refused_before_anything_is_stored():
    send = forward_codec("aqsgd", 2, num_samples=4, sample_shape=(3,))
    first = torch.tensor([[1.0, 2.0, 3.0], [7e4, 0.0, 0.0]])  # finite in float32, inf in float16
    with pytest.raises(BufferRangeError, match=r"sample 2's activation reaches 7e\+04, beyond what the "
                                                r"torch.float16 AQ-SGD buffer can hold") as caught:
        send.encode(first, [0, 2])
    assert (caught.value.sample_id, caught.value.dtype) == (2, torch.float16)
    assert not send.buffer.seen.any() and not send.buffer.values.any()  # nothing stored, not even sample 0
    send.encode(torch.tensor([[1.0, 2.0, 3.0], [6e4, 0.0, 0.0]]), [0, 2])
    before = send.buffer.values.clone()
    with pytest.raises(BufferRangeError, match="sample 2's"):  # a later visit whose change would overflow
        send.encode(torch.tensor([[1.0, 2.0, 3.0], [7e4, 0.0, 0.0]]), [0, 2])
    assert torch.equal(send.buffer.values, before)
    roomy = forward_codec("aqsgd", 2, num_samples=4, sample_shape=(3,), buffer_dtype=torch.bfloat16)
    assert torch.isfinite(roomy.encode(first, [0, 2]).decoded).all()


def test_sample_ids_checked_once_serve_every_call_alike():
    """A stage checks a micro-batch's ids once (SampleIds) and hands them to encode, payload_nbytes, decode."""
    s = forward_codec("aqsgd", 2, num_samples=8, sample_shape=(3,), seed=1)
    r = forward_codec("aqsgd", 2, num_samples=8, sample_shape=(3,))
    ids, x = SampleIds(torch.tensor([5, 1]), 8), torch.randn(2, 3)
    msg = s.encode(x, ids)
    assert r.payload_nbytes(x.shape, x.dtype, ids) == msg.nbytes
    assert torch.equal(r.decode(wire(msg), ids), msg.decoded)
    assert r.buffer.seen.nonzero().flatten().tolist() == [1, 5]
    with pytest.raises(ValueError, match="sample id 5 is out of range"):  # checked for 8 rows: a buffer of 4 checks
        forward_codec("aqsgd", 2, num_samples=4, sample_shape=(3,)).encode(x, ids)
    with pytest.raises(ValueError, match="2 sample_ids for a micro-batch of 3 samples"):
        s.encode(torch.randn(3, 3), ids)
    with pytest.raises(ValueError, match="repeat an index"):
        SampleIds([2, 2], 8)
    # checked once: the calls trust it (a repeat written in after the check is not looked for again)
    ids.tensor[0] = 1
    assert s.payload_nbytes(x.shape, x.dtype, ids) == s.payload_nbytes(x.shape, x.dtype, torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="repeat an index"):
        s.payload_nbytes(x.shape, x.dtype, ids.tensor)


def test_a_buffer_kept_in_a_file_leaves_its_rows_there_and_copies_them_as_bytes(tmp_path):
    import io

    a = SampleBuffer(6, (2, 3), torch.bfloat16, path=tmp_path / "a.buf")
    a.store(torch.tensor([4, 1]), torch.randn(2, 2, 3))
    state = a.state_dict()
    assert state["rows"] is None and state["ids"].tolist() == [4, 1]  # the samples of the slots, as stored
    rows = io.BytesIO()
    a.write_rows(rows, chunk_bytes=20)  # chunks of 1 row of 12 bytes: the loop, not one copy
    assert len(rows.getvalue()) == 2 * 12  # the rows that exist, not the dataset's 6
    (tmp_path / "copy.buf").write_bytes(rows.getvalue())
    for path in (tmp_path / "b.buf", None):
        b = SampleBuffer(6, (2, 3), torch.bfloat16, path=path)
        b.load_state_dict({**state, "rows_file": tmp_path / "copy.buf"})  # in a file or in memory alike
        assert all(torch.equal(x, y) for x, y in zip(b.held(), a.held())) and torch.equal(b.seen, a.seen)
    with pytest.raises(ValueError, match="hold 12 bytes; 2 rows take 24"):
        b.load_state_dict({**state, "rows_file": _file(tmp_path / "short.buf", rows.getvalue()[:12])})
    with pytest.raises(ValueError, match="without its rows: expected them, or the file that holds them"):
        SampleBuffer(6, (2, 3), torch.bfloat16).load_state_dict(state)


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- quantized buffers (buffer_bits)
def quantized_pair(buffer_bits, sender_path=None, receiver_path=None):
    kw = {"num_samples": N, "sample_shape": SHAPE, "buffer_bits": buffer_bits}
    return (forward_codec("aqsgd", 2, seed=1, buffer_path=sender_path, **kw),
            forward_codec("aqsgd", 2, seed=1, buffer_path=receiver_path, **kw))


@pytest.mark.parametrize("buffer_bits", [8, 4])
def test_quantized_buffers_stay_bit_identical_and_hold_a_row_in_a_fraction_of_float16(buffer_bits):
    sender, receiver = quantized_pair(buffer_bits)
    stats = run_epochs(sender, receiver, epochs=3, batch=5)  # asserts decode == the sender's copy, every batch
    assert torch.equal(sender.buffer.values, receiver.buffer.values) and bool(sender.buffer.seen.all())
    # a row: a float32 min and step per token (8 bytes per 64 values), then the codes
    row = SHAPE[0] * (8 + SHAPE[1] * buffer_bits // 8)
    assert sender.buffer.nbytes == N * row and sender.buffer.row_nbytes == row
    assert row / pair()[0].buffer.row_nbytes == row / (math.prod(SHAPE) * 2)  # 0.5625 / 0.3125 here
    floats = run_epochs(*pair(), epochs=3, batch=5)
    assert [s for s, _ in stats] == [s for s, _ in floats]  # the same bytes cross the wire
    error, float_error = stats[-1][1], floats[-1][1]
    # 8 bits: within 10% of the float16 buffer's error; 4 bits: more, its rounding is coarser than the change
    assert error < 1.1 * float_error if buffer_bits == 8 else error > 1.1 * float_error, (error, float_error)


def test_a_quantized_row_is_the_nearest_codes_of_each_token():
    sender, receiver = quantized_pair(8)
    ids = torch.tensor([2, 9])
    x = activation(ids, 0, 0.0)
    receiver.decode(wire(sender.encode(x, ids)), ids)
    expected = dequantize(quantize(x, 8, stochastic=False))  # groups: a token's hidden vector
    assert torch.equal(receiver.buffer.rows(ids), expected) and torch.equal(sender.buffer.rows(ids), expected)
    assert not torch.equal(expected, x.half().float())  # not what a float16 buffer would hold
    later = x + 0.01
    y = receiver.decode(wire(sender.encode(later, ids)), ids)
    assert torch.equal(y, receiver.buffer.rows(ids))  # the receiver computes with the row as held
    assert float((y - later).abs().max()) < 0.05


def test_quantized_buffers_resume_in_a_file_and_refuse_another_setting(tmp_path):
    mem = quantized_pair(4)
    disk = quantized_pair(4, tmp_path / "s.buf", tmp_path / "r.buf")
    assert run_epochs(*disk, epochs=2) == run_epochs(*mem, epochs=2)
    assert torch.equal(disk[1].buffer.values, mem[1].buffer.values)
    assert (tmp_path / "r.buf").stat().st_size == mem[1].buffer.nbytes
    state = copy.deepcopy({"s": mem[0].state_dict(), "r": mem[1].state_dict()})  # state_dicts are references
    reference = run_epochs(*mem, epochs=1, seed=5)
    again = quantized_pair(4)
    again[0].load_state_dict(state["s"])
    again[1].load_state_dict(state["r"])
    assert run_epochs(*again, epochs=1, seed=5) == reference
    with pytest.raises(ValueError, match="buffer_bits: checkpoint 4 vs codec 8"):
        quantized_pair(8)[0].load_state_dict(state["s"])
    with pytest.raises(ValueError, match="buffer_bits: checkpoint None vs codec 4"):
        quantized_pair(4)[0].load_state_dict(pair()[0].state_dict())


def test_quantized_buffer_undo_puts_the_bytes_back():
    sender, receiver = quantized_pair(8)
    ids = torch.tensor([1, 4])
    sender.encode(activation(ids, 0, 0.0), ids)
    before = sender.buffer.values.clone()
    undo = sender.undo_point(ids)
    sender.encode(activation(ids, 1, 0.5), ids)
    assert not torch.equal(sender.buffer.values, before)
    undo()
    assert torch.equal(sender.buffer.values, before)


@pytest.mark.parametrize("bits, shape, match", [
    (3, SHAPE, "buffer_bits=3: expected one of 4, 8"),
    (16, SHAPE, "buffer_bits=16: expected one of 4, 8"),
    (4, (3, 5), "a sample of 15 values at 4 bits is not whole bytes"),
])
def test_bad_buffer_bits_are_named(bits, shape, match):
    with pytest.raises(ValueError, match=match):
        forward_codec("aqsgd", 2, num_samples=N, sample_shape=shape, buffer_bits=bits)


# ----------------------------------------------------------------------------- hadamard (cache-free)
def outlier_activation(n: int = 6, seed: int = 0) -> torch.Tensor:
    """Activations with GPT-2's shape of trouble: a few channels tens of times larger than the rest."""
    x = torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))
    x[..., [5, 40]] *= 40
    return x


def test_hadamard_rotation_is_orthonormal_and_undone_exactly_enough():
    from aqpipe.compression.hadamard import block_size, random_signs, rotate, unrotate

    signs = random_signs(64, seed=3)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, random_signs(64, seed=3))
    assert not torch.equal(signs, random_signs(64, seed=4))
    x = outlier_activation()
    y = rotate(x, signs)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # orthonormal: norms kept per row
    torch.testing.assert_close(unrotate(y, signs), x, rtol=0, atol=1e-4)
    assert float(y.abs().max()) < float(x.abs().max()) / 3  # the outliers spread over their block
    h = torch.tensor([[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2  # H_4 / sqrt(4)
    ones = torch.ones(4)
    torch.testing.assert_close(rotate(torch.eye(4), ones), h)  # the Walsh-Hadamard matrix itself
    assert [block_size(w) for w in (768, 1600, 1536, 128, 6)] == [256, 64, 256, 128, 2]


@pytest.mark.parametrize("bits", [2, 4])
def test_hadamard_codec_round_trips_bit_identically_and_errs_less_than_direct_on_outliers(bits):
    s, r = (forward_codec("hadamard", bits, seed=1, rotation_seed=7), forward_codec("hadamard", bits, rotation_seed=7))
    x = outlier_activation()
    msg = s.encode(x)
    y = r.decode(wire(msg))
    assert torch.equal(y, msg.decoded)
    assert msg.nbytes == QuantizedTensor.wire_nbytes(x.shape, bits) == r.payload_nbytes(x.shape, x.dtype)
    direct = forward_codec("direct", bits, seed=1).encode(x).decoded
    err, direct_err = float((y - x).norm()), float((direct - x).norm())
    assert err < direct_err / 2, (err, direct_err)  # the same bytes, under half the error
    other = forward_codec("hadamard", bits, rotation_seed=8).decode(wire(msg))
    assert float((other - x).norm()) > 5 * err  # the receiver needs the sender's rotation


def test_hadamard_keeps_no_state_between_steps_but_its_dither():
    s = forward_codec("hadamard", 4, seed=1, rotation_seed=2)
    x = outlier_activation()
    state = copy.deepcopy(s.state_dict())
    first = s.encode(x)
    assert not torch.equal(s.encode(x).payload, first.payload)  # it dithers: the stream moved on
    again = forward_codec("hadamard", 4, seed=1, rotation_seed=2)
    again.load_state_dict(state)
    assert torch.equal(again.encode(x).payload, first.payload)  # only the dither stream is state
    other = forward_codec("hadamard", 4, rotation_seed=3)  # the rotation is the codec's own (from the run's seed,
    other.load_state_dict(state)  # both sides alike), not a checkpoint's
    assert not torch.equal(other.encode(x).payload, first.payload)


def test_hadamard_backward_and_half_precision():
    s, r = BackwardCodec("hadamard", 4, seed=3, rotation_seed=1), BackwardCodec("hadamard", 4, rotation_seed=1)
    g = outlier_activation().half() * 1e-3
    msg = s.encode(g)
    y = r.decode(wire(msg))
    assert y.dtype == torch.float16 and torch.equal(y, msg.decoded)
    assert float((y.float() - g.float()).norm() / g.float().norm()) < 0.1


def test_take_change_reports_the_relative_change_of_what_was_sent():
    sender, receiver = pair()
    ids = torch.tensor([3, 8])
    x = activation(ids, 0, 0.0)
    receiver.decode(wire(sender.encode(x, ids)), ids)
    assert sender.take_change() == (0.0, 0.0)  # first visits are sent whole: no change
    later = activation(ids, 1, 0.3)
    receiver.decode(wire(sender.encode(later, ids)), ids)
    change, total = sender.take_change()
    m = x.half().float()  # what the float16 buffer held
    assert change == pytest.approx(float((later - m).square().sum()), rel=1e-5)
    assert total == pytest.approx(float(later.square().sum()), rel=1e-5)
    assert sender.take_change() == (0.0, 0.0)  # taken: the counters start again


@pytest.mark.parametrize("buffer_bits", [8, 4])
def test_quantized_buffers_with_mixed_batches_and_refresh(buffer_bits):
    sender, receiver = quantized_pair(buffer_bits)
    for ids, kw in (([0, 1], {}), ([1, 2, 5], {}), ([2, 1], {"refresh": True}), ([5, 2], {})):
        ids = torch.tensor(ids)  # 1 seen and 2, 5 new: one message of whole rows and changes
        x = activation(ids, 1, 0.2) + 0.1 * int(ids.sum())
        msg = sender.encode(x, ids, **kw)
        assert torch.equal(receiver.decode(wire(msg), ids, **kw), msg.decoded)
        assert torch.equal(sender.buffer.values, receiver.buffer.values)
    held = sender.buffer.rows(torch.tensor([1]))  # refreshed at the third step: the whole row, nearest codes
    x = activation(torch.tensor([2, 1]), 1, 0.2)[1:] + 0.1 * 3
    assert torch.equal(held, dequantize(quantize(x, buffer_bits, stochastic=False)))


def test_adaptive_codecs_change_bits_on_both_sides_and_resume_with_the_current_ones():
    kw = {"num_samples": N, "sample_shape": SHAPE, "adaptive": True}
    sender, receiver = forward_codec("aqsgd", 2, seed=1, **kw), forward_codec("aqsgd", 2, seed=1, **kw)
    first = run_epochs(sender, receiver, epochs=2)
    for codec in (sender, receiver):  # both sides, between the same two messages
        codec.set_bits(4, None)
    later = run_epochs(sender, receiver, epochs=1, seed=3)
    assert torch.equal(sender.buffer.values, receiver.buffer.values)
    assert later[0][0] == N * SHAPE[0] * (SHAPE[1] * 4 // 8 + 8)  # 4-bit changes, a min and step per row
    assert later[0][0] > first[1][0] and later[0][1] < first[1][1]  # more bytes, less error than at 2 bits
    state = copy.deepcopy({"s": sender.state_dict(), "r": receiver.state_dict()})
    again = forward_codec("aqsgd", 2, seed=1, **kw), forward_codec("aqsgd", 2, seed=1, **kw)
    again[0].load_state_dict(state["s"])
    again[1].load_state_dict(state["r"])
    assert (again[0].bits, again[1].bits) == (4, 4)
    assert run_epochs(*again, epochs=1, seed=4) == run_epochs(sender, receiver, epochs=1, seed=4)
    with pytest.raises(RuntimeError, match="set_bits on a 'aqsgd' codec built without adaptive=True"):
        pair()[0].set_bits(4, None)
    with pytest.raises(ValueError, match="adaptive: checkpoint False vs codec True"):
        again[0].load_state_dict(pair()[0].state_dict())


def test_forward_codec_takes_every_keyword_of_the_codecs_it_builds_with_their_defaults():
    """forward_codec spells out aqsgd_codec's and ForwardCodec's keywords (no options bag): an option added to either
    and not to it, or a default that drifts, fails here."""
    import inspect

    from aqpipe.compression import ForwardCodec, aqsgd_codec

    mine = inspect.signature(forward_codec).parameters
    for built in (aqsgd_codec, ForwardCodec):
        for name, param in inspect.signature(built).parameters.items():
            if name in ("self", "mode", "bits"):
                continue
            required = param.default is inspect.Parameter.empty  # num_samples, sample_shape: checked for aqsgd
            assert name in mine and (required or mine[name].default == param.default), (built.__name__, name)
