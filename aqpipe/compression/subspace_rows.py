"""AQ-SGD's changes as k coefficients a row in a basis the sender estimates: a tied embedding's rows, whose
fine-tune change lies almost all in a few directions (benchmarks/RESULTS.md: 94-96% in one, 99% at rank 16).

The rows travel as AQ-SGD's do (aqsgd.py): each as its change against the copy both sides keep. Only the change's
coding differs. The sender adds each message's changes to a second moment and, at the first message of steps 0, 1,
2, 4, 8, ... (the boundary subspace's clock, subspace.py), sends the top-k directions with each one's root mean
square. Each row's change then goes as k whitened coefficients, quantized as one group. Both sides add the decoded
change to their copy. What the basis leaves out stays in the difference between the owner's row and the copy, and
goes with the row's next change: nothing is lost, only delayed until the basis holds it. The directions it piles up
in enter the moment, so a later refresh takes them.
"""
from __future__ import annotations

from typing import Any

import torch

from .aqsgd import AQSGDCodec
from .codecs import check_config
from .fields import check_int
from .quantizer import QuantizedTensor, dequantize
from .subspace import Subspace


class SubspaceRowsCodec(AQSGDCodec):
    """AQ-SGD whose changes travel as coefficients in a rank-`rank` basis of their own (see the module doc): `codec`'s
    buffer, whole rows and changes' quantizer (its bits and dither), which then codes the coefficients."""

    def __init__(self, codec: AQSGDCodec, rank: int) -> None:
        super().__init__(codec.delta, codec.buffer, codec.whole)
        width = codec.buffer.sample_shape[-1]
        self.subspace = Subspace(check_int("tie_rows_rank", rank, 1, width,
                                           what=f"1 to the tied weight's width, {width}"))

    def _width(self) -> int:
        return self.buffer.sample_shape[-1]

    def _coefficients(self, samples: int) -> torch.Size:
        """The coefficients of `samples` samples' changes: a row of `rank` for each row of width in a sample."""
        rows_a_sample = torch.Size(self.buffer.sample_shape[:-1]).numel()
        return torch.Size((samples * rows_a_sample, self.subspace.rank))

    def _changes_nbytes(self, n: int, carries: Any) -> int:
        head = self.subspace.head_nbytes(carries, self._width()) if carries else 0
        return head + self.delta.payload_nbytes(self._coefficients(n), torch.float32)

    def _encode_changes(self, change: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, width = self.subspace, self._width()
        rows = change.reshape(-1, width)
        if not rows.shape[0]:  # whole rows alone (a warm-up's, first visits): off the clock, as the receiver knows
            return change.new_empty(0, dtype=torch.uint8), m
        s.follow(rows.device)
        s.observe(rows)
        head = s.send_head(s.tick())
        q = self.delta.quantize(s.coefficients(rows))
        held = m + s.expand(dequantize(q), "a row's change").view(change.shape)
        body = q.to_bytes()
        return (body if head is None else torch.cat([head.to(body.device), body])), held

    def _decode_changes(self, payload: torch.Tensor, n: int, m: torch.Tensor, carries: Any) -> torch.Tensor:
        s, width = self.subspace, self._width()
        if not n:
            return m
        s.follow(payload.device)
        head = s.take_head(payload, carries, width)
        q = QuantizedTensor.from_bytes(payload[head:], self._coefficients(n), torch.float32, self.delta.bits,
                                       self.delta.group_size, self.delta.scale_dtype)
        return m + s.expand(dequantize(q), "a row's change").view(m.shape)

    def _post(self, changes: int) -> tuple[bool, bool]:
        return self.subspace.post() if changes else (False, False)  # whole rows alone are off the clock

    def _take_posted(self, changes: int) -> tuple[bool, bool]:
        return self.subspace.take_posted() if changes else (False, False)

    def end_step(self) -> Any:
        self.subspace.end_step()
        return super().end_step()

    def config(self) -> dict[str, Any]:
        return {**super().config(), "rows_rank": self.subspace.most}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rows_subspace": self.subspace.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_config(type(self).__name__, self.config(), state)
        super().load_state_dict(state)
        self.subspace.load_state_dict(state["rows_subspace"])

