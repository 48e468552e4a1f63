"""The departures worker (pipeline/departures.py) without a link: `dist.isend` replaced by a recorder, so what is
checked is the worker's own contract. A failing send raises from `drain` only after every other queued send was
waited for (none left in flight holding its buffer), and the worker thread computes on the stage's GPU, not on
whichever device CUDA would make current in a new thread."""
import threading

import pytest
import torch

from aqpipe.pipeline import departures


class _Link:
    """What was put on the link (each message's first byte, in order) and what was waited for."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.waited: list[int] = []

    def isend(self, data: torch.Tensor, dst: int, group: object | None = None, tag: int = 0) -> "_Link._Work":
        self.sent.append(int(data[0]))
        return _Link._Work(self.waited, int(data[0]))

    class _Work:
        def __init__(self, log: list, first: int) -> None:
            self.log, self.first = log, first

        def wait(self) -> None:
            self.log.append(self.first)


@pytest.fixture
def sends(monkeypatch):
    link = _Link()
    monkeypatch.setattr(departures.dist, "isend", link.isend)  # torch.distributed's: the wire's own sends too
    return link


def _broken(which: str):
    def encode(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"the {which} message cannot be coded")
    return encode


def test_drain_waits_for_every_send_then_raises_the_first_error(sends):
    out = departures.Departures()
    for i, encode in enumerate((None, _broken("second"), None, _broken("fourth"))):
        out.post(torch.full((4,), i, dtype=torch.uint8), None, 1, tag=0, group=None, encode=encode,
                 counter="fwd_bytes")
    with pytest.raises(RuntimeError, match="^the second message"):  # the first error, not the last
        out.drain()
    assert sends.sent == sends.waited == [0, 2]  # the sends after the failure went and were waited for
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


class _Gate:
    """A copy's event that completes when the test says so."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def query(self) -> bool:
        return self.open.is_set()


def test_a_send_at_once_skips_the_thread_only_where_nothing_waits_in_it(sends):
    from aqpipe.pipeline.transport import Wire

    wire = Wire(defer=True)
    wire.send(torch.full((2,), 1, dtype=torch.uint8), 1, at_once=True, counter="fwd_bytes")
    assert wire.take_sent() == {"fwd_bytes": 2}  # on the link already, before any flush
    gate = _Gate()
    wire.departures.post(torch.full((3,), 2, dtype=torch.uint8), gate, 1, tag=0, group=None, encode=None,
                         counter="fwd_bytes")
    try:
        wire.send(torch.full((4,), 3, dtype=torch.uint8), 1, at_once=True, counter="bwd_bytes")  # behind one
        assert wire.take_sent() == {} and not wire.departures.idle()
    finally:
        gate.open.set()
    wire.flush()
    assert sends.sent == [1, 2, 3]  # the order they were made in
    assert wire.take_sent() == {"fwd_bytes": 3, "bwd_bytes": 4}


def test_a_gpu_named_without_its_index_is_the_current_one(monkeypatch, sends):
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    out = departures.Departures("cuda")  # as EngineSettings(device="cuda") names it
    out.post(torch.zeros(2, dtype=torch.uint8), None, 1, tag=0, group=None, encode=None, counter=None)
    assert out.drain() == [(None, 2)] and chosen == [torch.device("cuda", 2)]
