"""Codecs' states through a checkpoint's round trip (torch.save, then a weights_only load), as a resume reads them."""
import io
from typing import Any, Sequence

import torch


def reloaded(codecs: Sequence[Any], fresh: Sequence[Any]) -> list[dict[str, Any]]:
    """Load each of `fresh` (a new process's codecs) with its counterpart in `codecs`' saved state; the states."""
    saved = io.BytesIO()
    torch.save([codec.state_dict() for codec in codecs], saved)
    saved.seek(0)
    states = torch.load(saved, weights_only=True)
    for codec, state in zip(fresh, states, strict=True):
        codec.load_state_dict(state)
    return states
