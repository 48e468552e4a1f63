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
from typing import Any

import torch

from aqpipe.compression import (BackwardCodec, Codec, Subspace, SubspaceCodec, aqsgd_codec, derive_seed, forward_codec,
                                plain_codecs, subspace_codecs)

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
        """Boundary `index`'s (forward, backward) codecs on one side of it: `sample_shape` (seq_len, hidden) one
        sample's activation, `bits` each direction's, `num_samples` the rows AQ-SGD's buffer indexes, `keep` which
        of them keep rows, `buffer_path` the buffer's file (None: memory)."""
        c, width = self.c, sample_shape[-1]

        def dense(direction: str) -> dict[str, Any]:
            return {"stochastic": c.stochastic, "seed": self.dither_seed("boundary", index, direction),
                    "group_size": c.group_size(direction, width, bits[direction]), "adaptive": c.auto(direction),
                    "rotation_seed": self.rotation_seed("boundary", index, direction), "scale_dtype": c.scales()}

        if c.forward == "subspace":
            return self._subspace(index, bits, dense)
        backward = BackwardCodec(c.backward, bits["backward"], **dense("backward"))
        if c.forward != "aqsgd":
            return forward_codec(c.forward, bits["forward"], **dense("forward")), backward
        first, transient = c.whole_rows()
        forward = aqsgd_codec(
            bits["forward"], num_samples=num_samples, sample_shape=sample_shape, **dense("forward"),
            buffer_dtype=c.buffer_dtype, buffer_path=buffer_path, buffer_bits=c.buffer_bits, buffer_keep=keep,
            first_visit=first, transient_visit=transient, first_visit_bits=c.first_visit_bits,
            first_visit_group_size=None if c.first_visit_bits is None else
            c.group_size("forward", width, c.first_visit_bits),
            first_visit_base=c.first_visit_base if c.first_visits_compressed() else "none")
        return forward, backward

    def _subspace(self, index: int, bits: dict[str, int | None], dense: Any) -> tuple[Codec, Codec]:
        """A subspace boundary's codecs around one basis; a dense backward where the backward is not subspace."""
        c, rank = self.c, self.c.subspace_rank
        forward, backward = subspace_codecs(
            rank, bits["forward"], bits["backward"] if c.backward == "subspace" else None, stochastic=c.stochastic,
            seed=self.dither_seed("boundary", index, "forward"), backward_seed=self.dither_seed("boundary", index,
                                                                                              "backward"),
            group_size=c.group_size("forward", rank, bits["forward"]),
            backward_group_size=c.group_size("backward", rank, bits["backward"]), scale_dtype=c.scales())
        return forward, backward or BackwardCodec(c.backward, bits["backward"], **dense("backward"))

    @staticmethod
    def fallbacks() -> tuple[Codec, Codec]:
        """What a link sends in full precision (warm-up epochs, evaluation)."""
        return plain_codecs()

    def tie(self, key: str, follower: int, matrix_shape: tuple[int, int],
            dtype: torch.dtype) -> tuple[Codec, Codec]:
        """The codecs of tied weight `key`'s link to stage `follower`: its rows (as AQ-SGD changes against the
        follower's copy, one buffer row per row of the weight) and their gradients, at the tie's bits."""
        c = self.c
        mode = c.tie_mode()
        if mode == "none":
            return self.fallbacks()
        rows, width = matrix_shape
        where = ("tie", key, "follower", follower)
        values = aqsgd_codec(c.tie_bits, num_samples=rows, sample_shape=(width,), buffer_dtype=dtype,
                             stochastic=c.stochastic, seed=self.dither_seed(*where, "rows"), scale_dtype=c.scales())
        if c.tie_rank:  # the gradients of a row lie near a few directions (benchmarks/boundary_spectrum.py)
            return values, SubspaceCodec(Subspace(c.tie_rank), c.tie_bits, stochastic=c.stochastic,
                                         seed=self.dither_seed(*where, "grads"), scale_dtype=c.scales())
        grads = BackwardCodec("direct", c.tie_bits, stochastic=c.stochastic, seed=self.dither_seed(*where, "grads"),
                              scale_dtype=c.scales())
        return values, grads
