"""AQ-SGD buffers whose writes wait for the step's end (`defer`, as every pipeline boundary sets them, so that no
message waits for a GPU): the same messages and rows as writes made at once, rows written within a step landing in
order, and a row beyond a float16 buffer reported at `end_step` with the sample and value, then undone."""

import torch

from aqpipe.compression import ForwardCodec, forward_codec, SampleBuffer
from aqpipe.compression.buffers import Prepared
from tests.unit.test_codecs import N, SHAPE, activation, wire

STEPS = [[[0, 1], [2, 3]], [[0, 4], [5, 1]], [[2, 3], [4, 5]]]  # first visits, mixed, changes


def _pair(deferred: bool, buffer_bits: int | None) -> tuple[ForwardCodec, ForwardCodec]:
    kw = {"num_samples": N, "sample_shape": SHAPE, "first_visit": "direct", "first_visit_bits": 4,
          "buffer_bits": buffer_bits}
    pair = forward_codec("aqsgd", 2, seed=1, **kw), forward_codec("aqsgd", 2, **kw)
    for codec in pair if deferred else ():
        codec.defer_checks()
    return pair


def _run(deferred: bool, buffer_bits: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor], ForwardCodec]:
    send, recv = _pair(deferred, buffer_bits)
    payloads, decoded = [], []
    for step, micro_batches in enumerate(STEPS):
        before = send.buffer.values.clone()
        for mb in micro_batches:
            ids = torch.tensor(mb)
            msg = send.encode(activation(ids, step, 0.3), ids)
            payloads.append(msg.payload)
            decoded.append(recv.decode(wire(msg), ids))
            assert torch.equal(decoded[-1], msg.decoded)
        if deferred:  # nothing landed inside the step; the seen bits did (the next message's size needs them)
            assert torch.equal(send.buffer.values, before) and send.buffer.seen[torch.tensor(micro_batches)].all()
            assert send.end_step() is None and recv.end_step() is None
        assert torch.equal(send.buffer.values, recv.buffer.values)
    return payloads, decoded, send


def test_deferred_writes_send_the_same_messages_as_writes_made_at_once():
    for bits in (None, 8):
        at_once, deferred = _run(False, bits), _run(True, bits)
        assert all(torch.equal(a, b) for a, b in zip(at_once[0], deferred[0]))
        assert all(torch.equal(a, b) for a, b in zip(at_once[1], deferred[1]))
        assert torch.equal(at_once[2].buffer.values, deferred[2].buffer.values)


def test_a_row_written_twice_before_the_step_ends_keeps_the_later_write():
    buf = SampleBuffer(4, (3,), torch.float32)
    buf.defer()

    def write(ids: list[int], value: float) -> None:
        rows = torch.full((len(ids), 3), value)
        buf.store(torch.tensor(ids), Prepared(rows, rows, rows.abs().amax(dim=1)))

    write([1, 2], 1.0)
    write([2, 3], 2.0)  # a tied row read again in a later micro-batch of the same step
    assert torch.equal(buf.rows(torch.tensor([2]))[0], torch.full((3,), 2.0))  # a read lands what it needs: the
    assert torch.equal(buf.rows(torch.tensor([3]))[0], torch.full((3,), 2.0))  # later write of a row written twice...
    assert buf.land_writes() is None
    assert buf.rows(torch.tensor([1, 2, 3]))[:, 0].tolist() == [1.0, 2.0, 2.0]  # ...and everything before it, in
    assert buf.seen.tolist() == [False, True, True, True]  # order


def test_a_row_beyond_a_float16_buffer_is_reported_at_the_end_of_the_step_and_undone():
    send, recv = _pair(True, None)
    first, ids = torch.zeros(2, *SHAPE), torch.tensor([0, 2])
    recv.decode(wire(send.encode(first, ids)), ids)
    assert send.end_step() is None and recv.end_step() is None
    hot = first.clone()
    hot[1, 0, 0] = 7e4  # finite in float32, inf in float16
    undo = send.undo_point(ids), recv.undo_point(ids)
    before = send.buffer.values.clone()
    recv.decode(wire(send.encode(hot, ids)), ids)  # nothing raised inside the step: it reads nothing back
    found = [side.end_step() for side in (send, recv)]
    assert all(f is not None and (f.sample_id, f.dtype) == (2, torch.float16) for f in found), found
    assert "sample 2's activation reaches 7e+04" in str(found[0])
    assert torch.isinf(send.buffer.rows(torch.tensor([2]))).any()  # landed as the step left it, for its undo
    for restore in undo:
        restore()
    assert torch.equal(send.buffer.values, before) and torch.equal(recv.buffer.values, before)
    undo = send.undo_point(ids)
    send.encode(hot, ids)
    undo()  # a step stopped inside its schedule (a peer died) is undone before its step ends
    assert send.end_step() is None and torch.equal(send.buffer.values, before)  # no overflow of an undone step
