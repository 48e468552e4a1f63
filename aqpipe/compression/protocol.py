"""What one side of a compressed wire is, declared: the calls a pipeline's transport, its step guard and its engine
make on a codec, whatever its mode (none, direct, hadamard, aqsgd, subspace). A codec is built by the factory
(pipeline/codec_factory.py) and used only through these; nothing outside it asks its mode or reaches into its parts.

The order of calls in a step: `encode` on the sender and `decode` on the receiver, message by message in the same
order (both sides' state, AQ-SGD's rows or a subspace's basis, moves alike); `undo_point` before a message that
changes rows, so a rejected step puts them back with `dither_state`'s snapshot; `take_checks` once the schedule
ends; `end_step` after it; `take_change` for the metrics. `state_dict` / `load_state_dict` carry all of it in a
checkpoint; `config` is what both sides and a checkpoint must agree on.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .codecs import Message


@runtime_checkable
class Codec(Protocol):
    mode: str
    bits: int | None
    group_size: int | None
    adaptive: bool
    buffer: Any  # per-sample rows a checkpoint copies (AQ-SGD's SampleBuffer), or None
    warmup_refresh: bool  # a warm-up step sends through it, every sample whole (else through the dense fallback)

    def encode(self, x: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message: ...

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor: ...

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int: ...

    def defer_checks(self) -> None: ...

    def take_checks(self) -> list[torch.Tensor]: ...

    def undo_point(self, sample_ids: Any) -> Callable[[], None]: ...

    def dither_state(self) -> torch.Tensor: ...

    def set_dither_state(self, state: torch.Tensor) -> None: ...

    def primable(self) -> bool: ...  # it can take every sample's row at once now (a per-sample codec, no row yet)

    def prime(self, rows: torch.Tensor) -> None: ...  # every sample's row, in id order, as both sides hold it

    def end_step(self) -> Any: ...

    def take_change(self) -> tuple[float, float]: ...

    def set_bits(self, bits: int, group_size: int | None) -> None: ...

    def config(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
