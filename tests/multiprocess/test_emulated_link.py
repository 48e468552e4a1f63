"""The emulated link over a real gloo pair (pipeline/emulated_link.py): gloo reports a receive complete only to a
wait, so its landing is taken by a thread that waits from when it is posted. A message that landed while its
receiver computed costs nothing more; one waited for as it lands is held its size over the rate."""
import threading
import time

import pytest
import torch

from tests.helpers.processes import spawn

NBYTES, MBIT = 50_000, 1.0  # 0.4 s on the emulated link


def exchange(rank: int, world: int, compute_s: float) -> list[float] | None:
    from aqpipe.pipeline import transport

    torch.set_num_threads(1)
    wire = transport.Wire(mbit=MBIT)
    if rank == 0:
        wire.send(torch.zeros(NBYTES, dtype=torch.uint8), 1)
        wire.flush()
        return None
    slept: list[float] = []
    incoming = wire.post(NBYTES, 0, torch.device("cpu"))
    threading.Event().wait(compute_s)  # the stage computes while the bytes land
    real_sleep, transport.time.sleep = transport.time.sleep, slept.append
    try:
        start = time.monotonic()
        incoming.wait()
        assert time.monotonic() - start < 0.2 + compute_s  # the real transfer is quick: the hold is the emulator's
    finally:
        transport.time.sleep = real_sleep
    return slept


@pytest.mark.parametrize("compute_s", [0.0, 1.0])
def test_a_message_that_landed_during_compute_is_not_charged_again(compute_s):
    slept = spawn(exchange, 2, compute_s)[1]
    if compute_s:
        assert slept == [], slept  # it landed at the start and was due 0.4 s later, before the wait
    else:
        assert len(slept) == 1 and 0.3 < slept[0] <= NBYTES * 8 / (MBIT * 1e6) + 1e-6, slept
