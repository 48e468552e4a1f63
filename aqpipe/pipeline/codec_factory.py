"""Every codec a rank holds, built in one place from the compression settings: a boundary's two directions, their
full-precision fallbacks, and a tied weight's rows and gradients.

Every seed is derived from the run's seed and the codec's name (what it carries, where, which direction, which
replica; compression.derive_seed), never made by arithmetic: `seed * 1000 + boundary * 10 + replica` gave boundary 0
of replica 10 the dither of boundary 1 of replica 0. A dither seed names the replica (only the sender draws, and
replicas must not round alike); a rotation seed does not (hadamard's signs are the same on both sides of a boundary
and in every replica).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aqpipe.compression import (BackwardCodec, Codec, Subspace, SubspaceCodec, SubspaceRowsCodec, aqsgd_codec,
                                derive_seed, forward_codec, plain_codecs, subspace_codecs)

from .compression_config import CompressionConfig


class CodecFactory:
    """The codecs of one rank (its stage's boundaries and ties, in replica `replica` of a run seeded `seed`)."""

    def __init__(self, compression: CompressionConfig, seed: int, replica: int) -> None:
        self.c, self.seed, self.replica = compression, seed, replica

    def dither_seed(self, *where: object) -> int:
        """The seed of the rounding a codec at `where` draws: this replica's own."""
        return derive_seed(self.seed, *where, "replica", self.replica)

    def rotation_seed(self, *where: object) -> int:
        """The seed of hadamard's signs at `where`: every replica's and both sides' alike."""
        return derive_seed(self.seed, *where, "rotation")

    def boundary(self, index: int, sample_shape: tuple[int, int], bits: dict[str, int | None], num_samples: int,
                 keep: torch.Tensor | None = None, buffer_path: str | os.PathLike | None = None) -> tuple[Codec, Codec]:
        """Boundary `index`'s (forward, backward) codecs on one side of it, built by its forward mode's builder
        (BOUNDARY_BUILDERS): `sample_shape` (seq_len, hidden) one sample's activation, `bits` each direction's,
        `num_samples` the rows AQ-SGD's buffer indexes, `keep` which of them keep rows, `buffer_path` the buffer's
        file (None: memory)."""
        return BOUNDARY_BUILDERS[self.c.forward](self, Side(index, sample_shape, bits, num_samples, keep, buffer_path))

    def dense(self, side: "Side", direction: str) -> dict[str, Any]:
        """A dense codec's settings in `direction` of a boundary: its dither and rotation seeds, its bits' group."""
        c = self.c
        return {"stochastic": c.stochastic, "seed": self.dither_seed("boundary", side.index, direction),
                "group_size": c.group_size(direction, side.width, side.bits[direction]), "adaptive": c.auto(direction),
                "rotation_seed": self.rotation_seed("boundary", side.index, direction), "scale_dtype": c.scales()}

    def dense_backward(self, side: "Side") -> Codec:
        return BackwardCodec(self.c.backward, side.bits["backward"], **self.dense(side, "backward"))

    @staticmethod
    def fallbacks() -> tuple[Codec, Codec]:
        """What a link sends in full precision (warm-up epochs, evaluation)."""
        return plain_codecs()

    def tie(self, key: str, follower: int, matrix_shape: tuple[int, int],
            dtype: torch.dtype) -> tuple[Codec, Codec]:
        """The codecs of tied weight `key`'s link to stage `follower`: its rows (as AQ-SGD changes against the
        follower's copy, one buffer row per row of the weight; in a basis of the changes' own with tie_rows_rank) and
        their gradients (in a basis of their own with tie_rank), at the tie's bits."""
        c = self.c
        mode = c.tie_mode()
        if mode == "none":
            return self.fallbacks()
        rows, width = matrix_shape
        where = ("tie", key, "follower", follower)
        values = aqsgd_codec(c.tie_bits, num_samples=rows, sample_shape=(width,), buffer_dtype=dtype,
                             stochastic=c.stochastic, seed=self.dither_seed(*where, "rows"), scale_dtype=c.scales())
        if c.tie_rows_rank:  # the rows' changes lie in a few directions too
            values = SubspaceRowsCodec(values, c.tie_rows_rank)
        if c.tie_rank:  # the gradients of a row lie near a few directions (benchmarks/boundary_spectrum.py)
            return values, SubspaceCodec(Subspace(c.tie_rank), c.tie_bits, stochastic=c.stochastic,
                                         seed=self.dither_seed(*where, "grads"), scale_dtype=c.scales())
        grads = BackwardCodec("direct", c.tie_bits, stochastic=c.stochastic, seed=self.dither_seed(*where, "grads"),
                              scale_dtype=c.scales())
        return values, grads


@dataclass(frozen=True)
class Side:
    """What one side of a boundary is built for (CodecFactory.boundary's arguments)."""

    index: int
    sample_shape: tuple[int, int]
    bits: dict[str, int | None]
    num_samples: int
    keep: torch.Tensor | None
    buffer_path: str | os.PathLike | None

    @property
    def width(self) -> int:
        return self.sample_shape[-1]


def _dense(f: CodecFactory, side: Side) -> tuple[Codec, Codec]:
    """none, direct, hadamard: each direction on its own."""
    return forward_codec(f.c.forward, side.bits["forward"], **f.dense(side, "forward")), f.dense_backward(side)


def _aqsgd(f: CodecFactory, side: Side) -> tuple[Codec, Codec]:
    """AQ-SGD's changes against per-sample rows, their first visits as the settings say; a dense backward."""
    c = f.c
    first, transient = c.whole_rows()
    forward = aqsgd_codec(
        side.bits["forward"], num_samples=side.num_samples, sample_shape=side.sample_shape, **f.dense(side, "forward"),
        buffer_dtype=c.buffer_dtype, buffer_path=side.buffer_path, buffer_bits=c.buffer_bits, buffer_keep=side.keep,
        first_visit=first, transient_visit=transient, first_visit_bits=c.first_visit_bits,
        first_visit_group_size=None if c.first_visit_bits is None else
        c.group_size("forward", side.width, c.first_visit_bits),
        first_visit_base=c.first_visit_base if c.first_visits_compressed() else "none")
    return forward, f.dense_backward(side)


def _subspace(f: CodecFactory, side: Side) -> tuple[Codec, Codec]:
    """Both directions around one basis, or the backward in its own; a dense backward where the backward is not
    subspace."""
    c, (rank, energy), bits = f.c, f.c.subspace(), side.bits
    if energy is not None:  # auto rank: its bound is at most the boundary's width
        rank = min(rank, side.width)
    forward, backward = subspace_codecs(
        rank, bits["forward"], bits["backward"] if c.backward == "subspace" else None, energy=energy,
        stochastic=c.stochastic,
        seed=f.dither_seed("boundary", side.index, "forward"),
        backward_seed=f.dither_seed("boundary", side.index, "backward"),
        group_size=c.group_size("forward", rank, bits["forward"]),
        backward_group_size=c.group_size("backward", rank, bits["backward"]), scale_dtype=c.scales(),
        backward_basis=c.backward_basis, feedback=c.backward_feedback)
    return forward, backward or f.dense_backward(side)


# a boundary's builder by its forward mode (compression.FORWARD_MODES, each once): a new mode is its codec and a line
BOUNDARY_BUILDERS: dict[str, Callable[[CodecFactory, Side], tuple[Codec, Codec]]] = {
    "none": _dense, "direct": _dense, "hadamard": _dense, "aqsgd": _aqsgd, "subspace": _subspace}
