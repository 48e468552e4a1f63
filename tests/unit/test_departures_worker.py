"""The departures worker (pipeline/departures.py) without a link: `dist.isend` replaced by a recorder, so what is
checked is the worker's own contract. A failing send raises from `drain` only after every other queued send was
waited for (none left in flight holding its buffer), and the worker thread computes on the stage's GPU, not on
whichever device CUDA would make current in a new thread."""
import threading

import pytest
import torch

from aqpipe.pipeline import departures


class _Work:
    def __init__(self, log: list, data: torch.Tensor) -> None:
        self.log, self.data = log, data

    def wait(self) -> None:
        self.log.append(int(self.data[0]))


@pytest.fixture
def sends(monkeypatch):
    log: list[int] = []
    monkeypatch.setattr(departures.dist, "isend", lambda data, dst, group=None, tag=0: _Work(log, data))
    return log


def _broken(_: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the second message cannot be coded")


def test_drain_waits_for_every_send_then_raises_the_first_error(sends):
    out = departures.Departures()
    for i, encode in enumerate((None, _broken, None, _broken)):
        out.post(torch.full((4,), i, dtype=torch.uint8), None, 1, tag=0, group=None, encode=encode,
                 counter="fwd_bytes")
    with pytest.raises(RuntimeError, match="second message"):
        out.drain()
    assert sends == [0, 2]  # the sends after the failure went and were waited for
    out.post(torch.full((3,), 5, dtype=torch.uint8), None, 1, tag=0, group=None, encode=None, counter="bwd_bytes")
    assert out.drain() == [("bwd_bytes", 3)]  # the failed batch is gone, the worker still sends


def test_the_worker_thread_makes_the_stages_gpu_its_current_device(monkeypatch, sends):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append((threading.current_thread().name, d)))
    out = departures.Departures("cuda:1")
    out.post(torch.zeros(2, dtype=torch.uint8), None, 1, tag=0, group=None, encode=None, counter=None)
    assert out.drain() == [(None, 2)]
    assert len(chosen) == 1 and chosen[0][0].startswith("aqpipe-departures")
    assert chosen[0][1] == torch.device("cuda:1")
    host = departures.Departures("cpu")
    host.post(torch.zeros(1, dtype=torch.uint8), None, 1, tag=0, group=None, encode=None, counter=None)
    host.drain()
    assert len(chosen) == 1  # a host stage's worker touches no GPU
