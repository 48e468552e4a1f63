"""What a piece of code reads back on the host: the ops that, on a GPU, make the host wait for the device (an
`.item()` or `bool()`, `nonzero`, a boolean mask's index, `torch.equal`, `unique`). Recorded on CPU tensors, where
they cost nothing, so a CPU test can say that the device side of a step would not sync. Copies to the host
(`.cpu()`, `.tolist()`) are not seen on CPU tensors: the GPU test (tests/gpu) covers them."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
         aten.unique_consecutive, aten.equal, aten.is_nonzero, aten.repeat_interleave}


def _bool_index(func, args) -> bool:
    return func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


class HostReads(TorchDispatchMode):
    """Inside it, `reads` lists each op that read values back (by name), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in READS or _bool_index(func, args):
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
