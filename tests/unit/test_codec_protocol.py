"""The codec contract (aqpipe/compression/protocol.py): every codec the factory builds, in every mode, is a `Codec`;
only AQ-SGD's takes a warm-up step itself; and what a rejected step does through the contract alone (undo_point,
dither_state) makes the next message the one the step's would have been, on both sides."""
import pytest
import torch

from aqpipe.compression import Codec, plain_codecs
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory

MODES = {
    "none": dict(forward="none", backward="none"),
    "direct": dict(forward="direct", forward_bits=3, backward="direct", backward_bits=4),
    "hadamard": dict(forward="hadamard", forward_bits=3, backward="direct", backward_bits=4),
    "aqsgd": dict(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4),
    "subspace": dict(forward="subspace", forward_bits=3, backward="subspace", backward_bits=4, subspace_rank=4),
}
SHAPE = (8, 32)  # (seq_len, width)


def sides(mode: str):
    """Boundary 0's (forward, backward) codecs on its two sides, built alike by two factories."""
    c = CompressionConfig(**MODES[mode])
    bits = {"forward": c.forward_bits, "backward": c.backward_bits}
    return [CodecFactory(c, 7, 0).boundary(0, SHAPE, bits, 16) for _ in range(2)]


@pytest.mark.parametrize("mode", MODES)
def test_every_codec_the_factory_builds_keeps_the_contract(mode):
    for codec in [*sides(mode)[0], *plain_codecs()]:
        assert isinstance(codec, Codec), (mode, type(codec).__name__)
    forward = sides(mode)[0][0]
    assert forward.warmup_refresh == (mode == "aqsgd")  # the transport asks this, never the mode
    assert forward.buffer is None or mode == "aqsgd"


@pytest.mark.parametrize("mode", MODES)
def test_a_rejected_message_is_undone_through_the_contract_alone(mode):
    """Send one message, put back what it changed (undo_point, then the dither as it was), send it again: the
    receiver, put back alike, decodes it to the same values; the same bytes, except that a subspace's basis, which
    rode on the step's first message (its refreshes are on the step clock) and both sides keep, is not sent again."""
    (send, _), (recv, _) = sides(mode)
    ids, x = torch.arange(4), torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(0))
    for step in range(2):  # the second step: AQ-SGD sends changes against rows the first stored
        undo_send, undo_recv = send.undo_point(ids), recv.undo_point(ids)
        dither = send.dither_state()
        first = send.encode(x + step, ids)
        decoded = recv.decode(first, ids)
        undo_send(), undo_recv()
        send.set_dither_state(dither)
        again = send.encode(x + step, ids)
        assert torch.equal(recv.decode(again, ids), decoded), (mode, step)
        if mode != "subspace":
            assert torch.equal(first.payload, again.payload), (mode, step)
        send.end_step(), recv.end_step()


def test_every_forward_mode_has_one_boundary_builder():
    """A mode the settings accept and the factory cannot build (or the other way) fails here, not in a run."""
    from aqpipe.compression import FORWARD_MODES
    from aqpipe.pipeline.codec_factory import BOUNDARY_BUILDERS

    assert sorted(BOUNDARY_BUILDERS) == sorted(FORWARD_MODES)
