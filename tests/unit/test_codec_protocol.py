"""The codec contract (aqpipe/compression/protocol.py): every codec the factory builds, in every mode, is a `Codec`;
only AQ-SGD's takes a warm-up step itself; and what a rejected step does through the contract alone (undo_point,
dither_state) makes the next message the one the step's would have been, on both sides."""
import pytest
import torch

from aqpipe.compression import Codec, plain_codecs
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory
from aqpipe.pipeline.step_guard import StepGuard

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


KIND = {"none": "ForwardCodec", "direct": "ForwardCodec", "hadamard": "ForwardCodec", "aqsgd": "AQSGDCodec",
        "subspace": "SubspaceCodec"}


@pytest.mark.parametrize("mode", MODES)
def test_every_codec_the_factory_builds_keeps_the_contract(mode):
    """A boundary's codecs (the forward of its mode, drawing the boundary's own dither), a subspace forward with a
    dense backward, the tie's, the fallbacks: all are Codecs; only AQ-SGD's takes a warm-up step or can be primed."""
    c = CompressionConfig(**MODES[mode])
    factory = CodecFactory(c, 7, 0)
    forward, backward = sides(mode)[0]
    assert (type(forward).__name__, forward.mode) == (KIND[mode], mode)  # the registry's builder for this mode
    assert forward.generator.initial_seed() == factory.dither_seed("boundary", 0, "forward")
    mixed = CodecFactory(CompressionConfig(forward="subspace", forward_bits=3, backward="direct", backward_bits=4,
                                           subspace_rank=4), 7, 0).boundary(0, SHAPE, {"forward": 3, "backward": 4}, 16)
    assert type(mixed[1]).__name__ == "BackwardCodec" and mixed[1].mode == "direct"
    ties = [CodecFactory(CompressionConfig(**MODES[mode], tie=tie, tie_bits=4, tie_rank=rank), 7, 0).tie(
        "embed", 1, (16, 32), torch.float32) for tie, rank in (("aqsgd", 0), ("aqsgd", 4), ("none", 0))]
    for codec in [forward, backward, *mixed, *plain_codecs(), *(c for pair in ties for c in pair)]:
        assert isinstance(codec, Codec), (mode, type(codec).__name__)
        assert codec.warmup_refresh == (codec.mode == "aqsgd")  # the transport asks this, never the mode
        assert codec.primable() == (codec.mode == "aqsgd")  # an empty AQ-SGD buffer, as a tie's first step finds it
        assert (codec.buffer is None) == (codec.mode != "aqsgd")


@pytest.mark.parametrize("mode", MODES)
def test_a_rejected_message_is_undone_through_the_contract_alone(mode):
    """Send one message, let the step guard put back what it changed (undo_point, then the dither as it was), send
    it again: the receiver, put back alike, decodes it to the same values; the same bytes, except that a subspace's
    basis, which rode on the step's first message (its refreshes are on the step clock) and both sides keep, is not
    sent again."""
    (send, _), (recv, _) = sides(mode)
    ids, x = torch.arange(4), torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(0))
    for step in range(2):  # the second step: AQ-SGD sends changes against rows the first stored
        guards = StepGuard({"send": send}), StepGuard({"recv": recv})  # as the engine's step holds each side's
        guards[0].remember(send, ids), guards[1].remember(recv, ids)
        first = send.encode(x + step, ids)
        decoded = recv.decode(first, ids)
        guards[0].undo(), guards[1].undo()
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
