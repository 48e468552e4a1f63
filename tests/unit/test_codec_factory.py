"""Every codec of a rank comes from one factory, and every stream of dither it draws is its own: no two wires,
boundaries, replicas or tied-weight links round alike, up to 16 replicas."""
import dataclasses

import torch

from aqpipe.compression import AQSGDCodec, BackwardCodec, ForwardCodec
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory

AUTO = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4, first_visit="auto",
                         first_visit_bits=3, first_visit_base="position", tie="aqsgd", tie_bits=8)


def drawing_streams(factory: CodecFactory, boundaries: int, followers: int) -> dict[tuple, int]:
    """The initial seed of every generator a rank's codecs draw from (a full-precision row codec draws none)."""
    out = {}
    for index in range(boundaries):
        forward, backward = factory.boundary(index, (4, 64), {"forward": 2, "backward": 4}, 8)
        out[("boundary", index, "changes")] = forward.generator.initial_seed()
        out[("boundary", index, "rows kept out")] = forward.whole.transient.generator.initial_seed()
        out[("boundary", index, "backward")] = backward.generator.initial_seed()
        assert forward.whole.first.mode == "none"  # auto: a kept sample's first visit in full precision, no dither
    for follower in range(1, followers + 1):
        rows, grads = factory.tie("embed", follower, (32, 64), torch.float32)
        out[("tie", follower, "rows")] = rows.generator.initial_seed()
        out[("tie", follower, "grads")] = grads.generator.initial_seed()
    return out


def test_every_wire_boundary_replica_and_tie_draws_its_own_dither_up_to_16_replicas():
    streams = {}
    for replica in range(16):
        for where, seed in drawing_streams(CodecFactory(AUTO, 42, replica), boundaries=7, followers=7).items():
            streams[(replica, *where)] = seed
    assert len(streams) == 16 * (7 * 3 + 7 * 2)
    assert len(set(streams.values())) == len(streams)  # boundary 0 of replica 10 is not boundary 1 of replica 0


def test_a_rotation_is_the_same_on_both_sides_and_in_every_replica_and_differs_between_links():
    rotations = {(replica, index, direction): CodecFactory(AUTO, 42, replica).rotation_seed("boundary", index,
                                                                                           direction)
                 for replica in range(4) for index in range(7) for direction in ("forward", "backward")}
    assert all(rotations[(r, i, d)] == rotations[(0, i, d)] for r, i, d in rotations)
    assert len({rotations[(0, i, d)] for i in range(7) for d in ("forward", "backward")}) == 14


def test_the_factory_builds_each_kind_from_the_settings():
    forward, backward = CodecFactory(AUTO, 1, 0).boundary(2, (4, 128), {"forward": 2, "backward": 4}, 8)
    assert isinstance(forward, AQSGDCodec) and isinstance(backward, BackwardCodec)
    assert (forward.bits, forward.group_size, backward.bits, backward.group_size) == (2, 64, 4, None)  # auto groups
    assert (forward.whole.first.mode, forward.whole.transient.mode, forward.whole.transient.bits) == (
        "none", "hadamard", 3)
    assert forward.whole.base is not None  # first_visit_base="position": a running base under the first visits
    keep = torch.tensor([True, False] * 4)  # the buffer plan's: which samples keep a row
    narrow = dataclasses.replace(AUTO, first_visit_bits=2, scale_dtype="bfloat16")
    forward, backward = CodecFactory(narrow, 1, 0).boundary(2, (4, 128), {"forward": 2, "backward": 4}, 8, keep=keep)
    assert torch.equal(forward.buffer.keeps(torch.arange(8)), keep)
    assert (forward.whole.transient.bits, forward.whole.transient.group_size) == (2, 64)  # auto groups at 2 bits
    assert forward.delta.scale_dtype == forward.whole.transient.scale_dtype == backward.scale_dtype == torch.bfloat16
    dense = CompressionConfig(forward="hadamard", forward_bits=4, backward="none", tie="none")
    forward, backward = CodecFactory(dense, 1, 0).boundary(0, (4, 64), {"forward": 4, "backward": None}, 8)
    assert type(forward) is ForwardCodec and forward.mode == "hadamard" and backward.mode == "none"
    rows, grads = CodecFactory(dense, 1, 0).tie("embed", 1, (32, 64), torch.float32)
    assert rows.mode == grads.mode == "none"


def test_each_codec_takes_the_group_its_own_bits_and_direction_give():
    """A 3-bit first visit at width 128 groups by row (auto's groups are 64 at 2 bits only); a subspace boundary's
    gradients take --backward_group_size, its activations --forward_group_size."""
    forward, _ = CodecFactory(AUTO, 1, 0).boundary(0, (4, 128), {"forward": 2, "backward": 4}, 8)
    assert forward.group_size == 64 and forward.whole.transient.group_size is None
    sub = CompressionConfig(forward="subspace", forward_bits=4, backward="subspace", backward_bits=4,
                            subspace_rank=8, forward_group_size=4, backward_group_size=8)
    forward, backward = CodecFactory(sub, 1, 0).boundary(0, (4, 64), {"forward": 4, "backward": 4}, 8)
    assert (forward.group_size, backward.group_size) == (4, 8)
