"""AQ-SGD's whole rows: what a message carries for the samples it cannot send as changes.

A sample's first visit (and a warm-up's refresh) has no buffer row to change from, and a sample the buffer keeps out
never gets one. Their rows travel whole, through cache-free row codecs: `first` for the rows that become buffer rows
(the base of every later change), `transient` for the rows of samples kept out (read back by no one, so as cheap as
a one-epoch run's; the same codec as `first` unless told otherwise). With a running base, the compressed ones travel
as changes from it. Both sides split a message's whole rows alike (by the buffer's keep mask), so each codec's part
sits at a known place at the front of the payload.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .buffers import SampleBuffer, positions
from .running_base import RunningBase

if TYPE_CHECKING:
    from .codecs import RowCodec


class WholeRows:
    """The whole rows of one side of a boundary: their codecs, the running base, and the buffer that decides which
    rows are kept."""

    def __init__(self, first: "RowCodec", transient: "RowCodec", base: RunningBase | None,
                 buffer: SampleBuffer) -> None:
        self.first, self.transient, self.base, self.buffer = first, transient, base, buffer

    def codecs(self) -> list["RowCodec"]:
        """The row codecs, each once."""
        return [self.first] if self.transient is self.first else [self.first, self.transient]

    def parts(self, ids: torch.Tensor) -> list[tuple["RowCodec", torch.Tensor | None]]:
        """Each codec and which of the whole rows of samples `ids` it sends (None: all), in payload order."""
        if self.transient is self.first:
            return [(self.first, None)]
        kept = self.buffer.keeps(ids)
        if bool(kept.all()) or not bool(kept.any()):  # one codec's part, the other's empty: the rows as they are
            return [(self.first if bool(kept.all()) else self.transient, None)]
        return [(self.first, kept), (self.transient, ~kept)]

    def _sizes(self, ids: torch.Tensor, dtype: torch.dtype) -> list[tuple["RowCodec", torch.Tensor | None, int, int]]:
        shape, out = self.buffer.sample_shape, []
        for codec, chosen in self.parts(ids):
            n = ids.numel() if chosen is None else int(chosen.sum())
            out.append((codec, chosen, n, codec.nbytes(n, shape, dtype)))
        return out

    def nbytes(self, ids: torch.Tensor, dtype: torch.dtype) -> int:
        """The payload bytes of the whole rows of samples `ids`."""
        return sum(size for *_, size in self._sizes(ids, dtype))

    def _based(self, codec: "RowCodec") -> bool:
        """Whether `codec`'s rows travel as changes from the running base (the compressed ones, where it is on)."""
        return self.base is not None and codec.mode != "none"

    @staticmethod
    def _merge(parts: list[torch.Tensor | None], decoded: list[torch.Tensor]) -> torch.Tensor:
        """The rows in the message's sample order, from each codec's rows."""
        if len(decoded) == 1:
            return decoded[0]
        out = decoded[0].new_empty((sum(d.shape[0] for d in decoded), *decoded[0].shape[1:]),
                                   dtype=torch.promote_types(*(d.dtype for d in decoded)))
        for chosen, part in zip(parts, decoded):
            out.index_copy_(0, positions(chosen, out.device), part.to(out.dtype))
        return out

    def send(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each codec's payload for the whole `rows` of samples `ids`, and the rows as the receiver will decode
        them (what both sides compute with and store)."""
        parts, payloads, decoded = self.parts(ids), [], []
        for codec, chosen in parts:
            mine = rows if chosen is None else rows.index_select(0, positions(chosen, rows.device))
            sent = codec.encode(self.base.center(mine) if self._based(codec) else mine)
            payloads.append(sent.payload)
            decoded.append(self.base.restore(sent.decoded) if self._based(codec) else sent.decoded)
        return payloads, self._merge([chosen for _, chosen in parts], decoded)

    def receive(self, payload: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The whole rows of samples `ids` from the front of a payload, and the bytes they took."""
        start, chosen_parts, decoded = 0, [], []
        for codec, chosen, n, size in self._sizes(ids, dtype):
            rows = codec.decode(payload[start:start + size], torch.Size((n, *self.buffer.sample_shape)), dtype)
            decoded.append(self.base.restore(rows) if self._based(codec) else rows)
            chosen_parts.append(chosen)
            start += size
        return self._merge(chosen_parts, decoded), start

    def fold(self, rows: torch.Tensor) -> None:
        """The running base takes in a message's whole rows once they are stored (both sides, in order)."""
        if self.base is not None:
            self.base.update(rows)

    def undo_point(self) -> Callable[[], None]:
        """What puts back the codecs' dither (the rows' own rounding) and the running base as they are now."""
        dither = [codec.dither_state() for codec in self.codecs()]
        base = None if self.base is None else self.base.snapshot()

        def restore() -> None:
            for codec, state in zip(self.codecs(), dither):
                codec.set_dither_state(state)
            if base is not None:
                self.base.put_back(base)

        return restore

    def config(self) -> dict[str, Any]:
        return {"first_visit": self.first.mode, "first_visit_bits": self.first.bits or self.transient.bits,
                "first_visit_base": "none" if self.base is None else "position", "transient_visit": self.transient.mode}

    def state_dict(self) -> dict[str, Any]:
        state = {"first_visit": self.first.state_dict()}
        if self.transient is not self.first:
            state["transient_visit"] = self.transient.state_dict()
        if self.base is not None:
            state["first_visit_base"] = self.base.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of state_dict; a state from before first-visit codecs has no dither to restore."""
        if "first_visit" in state:
            self.first.load_state_dict(state["first_visit"])
        if self.transient is not self.first:
            self.transient.load_state_dict(state["transient_visit"])
        if self.base is not None:
            self.base.load_state_dict(state["first_visit_base"])
