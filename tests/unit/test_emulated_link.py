"""The link emulated in the transport (pipeline/emulated_link.py; AQPIPE_LINK_MBIT): a message is held until a link
of that rate and latency would have delivered it, one message after another per peer, counting from when its bytes
landed; an entropy-coded one is charged its coded length; without a rate, the latency alone, as before."""
import threading

import pytest
import torch

from aqpipe.compression import entropy
from aqpipe.environment import link_mbit
from aqpipe.pipeline import transport
from aqpipe.pipeline.emulated_link import EmulatedLink, LinkMatrix

MB = 1_000_000 // 8  # bytes in one megabit


def test_a_rate_serializes_each_peers_messages_and_adds_the_latency():
    link = EmulatedLink(latency_s=0.05, mbit=10.0)
    # two 1-Mbit messages from peer 1 landed at t=0, waited for at t=0: 0.1 s each on the link, one after the other
    assert link.hold(1, MB, 0.0, 0.0) == pytest.approx(0.15)
    assert link.hold(1, MB, 0.0, 0.0) == pytest.approx(0.25)
    assert link.hold(2, MB, 0.0, 0.0) == pytest.approx(0.15)  # another peer's link is its own
    # waited for long after it was due: nothing more to wait (a negative hold is no sleep)
    assert link.hold(1, MB, 1.0, 5.0) == pytest.approx(1.0 + 0.1 + 0.05 - 5.0)
    # landing unseen: counted from when its wait found it
    assert link.hold(3, 2 * MB, None, 7.0) == pytest.approx(0.25)


def test_a_collective_is_paced_from_its_start_or_with_latency_alone_after_the_shaped_links(monkeypatch):
    """A matrix of rates holds a collective until its links would have carried it, counted from its start (the real
    transfer on one host is part of that time); a matrix of latencies alone (tc shapes the rates) adds its
    latencies after whatever the shaped links took."""
    import math

    slept = []
    monkeypatch.setattr("aqpipe.pipeline.emulated_link.time.sleep", slept.append)
    monkeypatch.setattr("aqpipe.pipeline.emulated_link.time.monotonic", lambda: 10.0)
    latency = [[0.0, 0.05], [0.05, 0.0]]
    rated = LinkMatrix(0, latency, [[0.0, 1e6], [1e6, 0.0]])
    bare = LinkMatrix(0, latency, [[0.0, math.inf], [math.inf, 0.0]])
    assert not rated.latency_only and bare.latency_only
    rated.pace(9.8, [0, 1], 1e6, "ring")  # 2 hops of 0.5 s and the latency each, begun 0.2 s ago
    bare.pace(9.8, [0, 1], 1e6, "ring")  # the shaped links took 0.2 s: both hops' latencies more
    assert slept == [pytest.approx(2 * 0.55 - 0.2), pytest.approx(2 * 0.05)]


def test_without_a_rate_every_message_waits_the_latency_alone():
    link = EmulatedLink(latency_s=0.025)
    assert [link.hold(1, 10 * MB, 0.0, 9.0) for _ in range(2)] == [0.025, 0.025]


class Work:
    """A gloo receive as the transport sees it: complete only once its bytes land (`land`), and reported complete
    only to a wait."""

    def __init__(self) -> None:
        self.landed = threading.Event()

    def land(self) -> None:
        self.landed.set()

    def wait(self) -> None:
        self.landed.wait()

    def is_completed(self) -> bool:
        return False  # gloo's, before its wait: the landing cannot be polled


def test_a_landing_is_taken_when_the_bytes_land_and_a_coded_message_is_charged_its_coded_length(monkeypatch):
    clock = [100.0]
    works: list[Work] = []
    slept: list[float] = []
    message = torch.randint(0, 4, (40_000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    coded = entropy.encode(message)
    assert coded.numel() < message.numel() // 2  # 2-bit values: the coded form is far shorter

    def irecv(buf, src, group=None, tag=0):
        n = min(buf.numel(), coded.numel())
        buf[:n] = coded[:n]
        works.append(Work())
        return works[-1]

    monkeypatch.setattr(transport.dist, "irecv", irecv)
    monkeypatch.setattr(transport.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    monkeypatch.setattr("aqpipe.pipeline.emulated_link.time.monotonic", lambda: clock[0])
    wire = transport.Wire(latency_s=0.01, mbit=1.0, entropy=True)
    incoming = wire.post(message.numel(), 1, torch.device("cpu"), code=True)
    clock[0] = 101.0
    works[-1].land()  # its bytes land at 101, while the stage computes
    assert incoming.landing.wait() == 101.0
    clock[0] = 101.02  # then the stage waits for the message, still on the emulated link
    assert torch.equal(incoming.wait(), message)
    due = 101.0 + coded.numel() * 8 / 1e6 + 0.01
    assert slept == [pytest.approx(due - 101.02)] and due - 101.02 > 0.05
    # whole messages (no coding) cost their whole size, one after another on the peer's link; one waited for after
    # it was due costs nothing more
    plain = transport.Wire(latency_s=0.01, mbit=1.0)
    first, second = plain.post(1000, 1, torch.device("cpu")), plain.post(1000, 1, torch.device("cpu"))
    clock[0] = 104.0
    works[-2].land(), works[-1].land()
    first.landing.wait(), second.landing.wait()
    slept.clear()
    first.wait(), second.wait()
    assert slept == [pytest.approx(0.008 + 0.01), pytest.approx(0.016 + 0.01)]
    late = plain.post(1000, 1, torch.device("cpu"))
    works[-1].land()
    late.landing.wait()
    clock[0] = 200.0
    slept.clear()
    late.wait()
    assert slept == []


def test_the_rate_is_read_from_the_environment_and_a_bad_one_is_named():
    assert link_mbit({}) is None and link_mbit({"AQPIPE_LINK_MBIT": ""}) is None
    assert link_mbit({"AQPIPE_LINK_MBIT": "100"}) == 100.0
    for bad in ("0", "-5", "fast", "inf"):
        with pytest.raises(ValueError, match=f"AQPIPE_LINK_MBIT='{bad}': expected a rate in Mbit/s > 0"):
            link_mbit({"AQPIPE_LINK_MBIT": bad})
    with pytest.raises(ValueError, match="link rate 0 Mbit/s: expected > 0"):
        EmulatedLink(mbit=0)
