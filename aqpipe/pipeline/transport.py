"""Codec messages between neighbouring stages over torch.distributed point-to-point.

One message per transfer, so a slow, high-latency link pays one round of latency:
the receiver computes the size from its own state (every stage loads the same
micro-batch locally, so it knows the shape and the sample ids, and its codec knows
which samples it has seen). The sample ids travel appended to each activation and
are checked on arrival: a data-order mismatch between stages fails loudly instead
of decoding garbage into the AQ-SGD buffers.

Sends are isend (compute continues while bytes drain); `flush` waits for them. Receives can be
posted ahead (`post_activation` / `post_grad`, then `take_*`): gloo moves a message only once its
receive is posted, so a stage that posts all of a step's receives up front overlaps every transfer
with its own compute instead of paying each one when it needs the tensor.

An emulated slow link (`Wire(latency_s=..., mbit=...)`; the trainer's `AQPIPE_LINK_LATENCY_MS` and
`AQPIPE_LINK_MBIT`): a receive completes when a link of that rate and latency would have delivered its message
(emulated_link.py), for machines where no namespace can shape one.

A boundary runs in one of three phases: "train" (the configured codecs), "warmup"
(full precision; aqsgd refreshes its buffer rows so compression starts from them)
and "eval" (full precision, buffers untouched: eval samples have their own ids).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aqpipe.compression import BufferRangeError, Codec, Message, SampleIds, entropy
from aqpipe.compression.buffers import to_device
from aqpipe.compression.staging import HostStaging

from .departures import Departures, copied_out
from .emulated_link import EmulatedLink, LinkMatrix
from .participants import StepPart, StepStart

PROBE_REPEATS = 2  # round trips per size in a link probe; the faster counts


class Incoming:
    """A receive posted ahead of its use. gloo starts moving a message only once its receive is
    posted, so posting early lets the transfer run while this stage computes."""

    def __init__(self, work: Any, buf: torch.Tensor, staging: HostStaging, device: torch.device, *, src: int,
                 link: EmulatedLink, coded: int | None = None) -> None:
        """`coded`: the message's size where it travels entropy-coded (`buf` then holds its coded form); `link`:
        the emulated link it crosses from `src` (which takes when its bytes land, where it has a rate)."""
        self.work, self.buf, self.staging, self.device = work, buf, staging, device
        self.src, self.link, self.coded = src, link, coded
        self.landing = link.watch(work, blocking=staging.transport.type == "cpu")

    def wait(self) -> torch.Tensor:
        """The message on the device it was posted for, once the emulated link (if any) has delivered it."""
        landed_at = None if self.landing is None else self.landing.wait()
        if self.landing is None or not self.landing.blocking:
            self.work.wait()
        ready = time.monotonic()
        buf, size = self.buf, self.buf.numel()
        if self.coded is not None:  # decoded on the host, into pinned memory where a GPU takes it
            buf, size = entropy.decode_sized(buf, self.coded, self.staging.landing(self.coded, torch.uint8,
                                                                                    self.device))
        out = self.staging.arrived(buf, self.device)
        hold = self.link.hold(self.src, size, landed_at, ready)  # decoding counts after the delivery
        if hold > 0:
            time.sleep(hold)
        return out


class Wire:
    """Non-blocking sends and receives. `latency_s`, `mbit`: an emulated link's one-way delay and rate (None:
    unlimited) on the receiving side (emulated_link.py; the benchmarks' --latency_ms), or `matrix`: each peer's.
    `transport`: the device the process group moves tensors from (cpu for gloo, the GPU for NCCL); payloads computed
    elsewhere are staged through it (compression.staging).
    `entropy`: messages sent and posted with `code=True` travel entropy-coded (compression.entropy), which needs a
    transport that takes a message shorter than its receive (gloo; NCCL does not): elsewhere it is ignored.
    `device`: where the stage computes. A GPU's payloads over a host transport (gloo) leave through `Departures`
    (departures.py), so no send waits for the GPU on the main thread; `defer=True` sends that way from any device.
    What each send puts on the link is counted on the wire it names (`counter`, a StepCounters field), read by
    `take_sent` once `flush` has sent everything."""

    def __init__(self, latency_s: float = 0.0, transport: torch.device | str = "cpu", entropy: bool = False,
                 mbit: float | None = None, device: torch.device | str = "cpu", defer: bool | None = None,
                 matrix: LinkMatrix | None = None) -> None:
        self._pending: list[tuple[object, torch.Tensor]] = []
        self.link = EmulatedLink(latency_s, mbit, matrix)
        self.staging = HostStaging(transport)
        self.entropy = bool(entropy) and self.staging.transport.type == "cpu"
        if defer is None:
            defer = torch.device(device).type == "cuda" and self.staging.transport.type == "cpu"
        self.departures = Departures(device) if defer else None
        self._sent: dict[str, int] = {}

    def send(self, payload: torch.Tensor, dst: int, tag: int = 0, group: object | None = None,
             code: bool = False, counter: str | None = None, at_once: bool = False) -> None:
        """Send `payload` (entropy-coded with `code` where this wire codes), its bytes on the link counted on
        `counter` (None: not a step's bytes, as a probe's). `at_once`: not through the departures' thread where
        nothing waits in it (a host payload: a probe, whose timing must not include the thread's hand-off)."""
        encode = entropy.encode if code and self.entropy else None
        if self.departures is not None and not (at_once and self.departures.idle()):
            host, ready = copied_out(payload)
            self.departures.post(host, ready, dst, tag=tag, group=group, encode=encode, counter=counter)
            return
        payload = self.staging.outgoing(payload)
        if encode is not None:
            payload = encode(payload)
        work = dist.isend(payload, dst, group=group, tag=tag)
        self._pending.append((work, payload))  # keep the buffer alive until the send completes
        self.count(counter, payload.numel())

    def count(self, counter: str | None, nbytes: int) -> None:
        """`nbytes` more put on the link, on `counter`'s wire (None: on none)."""
        if counter is not None:
            self._sent[counter] = self._sent.get(counter, 0) + nbytes

    def take_sent(self) -> dict[str, int]:
        """Bytes put on the link since the last call, by counter (call after `flush`: a deferred send counts once
        it has gone)."""
        sent, self._sent = self._sent, {}
        return sent

    def post(self, nbytes: int, src: int, device: torch.device, tag: int = 0, group: object | None = None,
             code: bool = False) -> Incoming:
        """Start receiving an `nbytes` message from `src` for use on `device` (`code`: as its sender sent it);
        messages from one peer in one group match in posting order."""
        coded = code and self.entropy
        buf = self.staging.landing(entropy.capacity(nbytes) if coded else nbytes, torch.uint8,
                                   torch.device("cpu") if coded else device)  # decoded on the host
        return Incoming(dist.irecv(buf, src, group=group, tag=tag), buf, self.staging, torch.device(device),
                        src=src, link=self.link, coded=nbytes if coded else None)

    def recv(self, nbytes: int, src: int, device: torch.device, tag: int = 0,
             group: object | None = None) -> torch.Tensor:
        return self.post(nbytes, src, device, tag, group).wait()

    def flush(self) -> None:
        """Wait until every send so far has completed."""
        if self.departures is not None:
            for counter, nbytes in self.departures.drain():
                self.count(counter, nbytes)
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _coded(codec: Codec) -> bool:
    """Whether a codec's messages go through the wire's entropy stage: a compressing codec's do, the full-precision
    baselines' (`none`) do not."""
    return codec.mode != "none"


def _ids_tensor(ids: torch.Tensor | SampleIds) -> torch.Tensor:
    return ids.tensor if isinstance(ids, SampleIds) else ids


def _ids_bytes(ids: torch.Tensor | SampleIds, device: torch.device) -> torch.Tensor:
    return to_device(_ids_tensor(ids).to(torch.int64).contiguous(), device).view(torch.uint8)


class Boundary:
    """One side of the boundary between stage s and s+1: the codecs and the peer's rank.

    On stage s it sends activations and receives gradients; on stage s+1 it receives activations and sends
    gradients (`outgoing` / `incoming`: the process group each way).
    """

    def __init__(self, wire: Wire, peer: int, forward: Codec, backward: Codec,
                 fallback_forward: Codec, fallback_backward: Codec, *, sends_activations: bool,
                 tag: int = 0, send_ids: bool = True, outgoing: object | None = None,
                 incoming: object | None = None, counters: tuple[str, str] = ("fwd_bytes", "bwd_bytes")) -> None:
        """`sends_activations`: this side encodes the forward messages (it reports what they found, its peer finds the
        same); `tag` keeps this boundary's messages apart from others between the same two ranks (gloo), `outgoing`
        and `incoming` are the groups that carry its messages each way (pipeline.topology.channels: what keeps NCCL,
        which ignores tags, from matching them with others); `send_ids=False` leaves the ids off the wire where both
        sides derive them from data already checked elsewhere; `counters`: the wires (StepCounters fields) its
        activations' and its gradients' bytes count on."""
        self.wire, self.peer, self.tag, self.send_ids, self.counters = wire, peer, tag, send_ids, counters
        self.sends_activations = sends_activations
        self.outgoing, self.incoming = outgoing, incoming
        self.forward, self.backward = forward, backward
        # full precision during warm-up epochs (aqsgd uses refresh instead, which also fills its buffer)
        self.fallback_forward, self.fallback_backward = fallback_forward, fallback_backward
        self._arrived: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids as received, as loaded) to check_order
        for codec in self._codecs():  # a step reads its codecs' checks with its other flags, after the schedule
            codec.defer_checks()

    def _codecs(self) -> tuple[Any, ...]:
        return self.forward, self.backward, self.fallback_forward, self.fallback_backward

    def take_checks(self) -> list[torch.Tensor]:
        """A 0-dim value on the device per quantized message sent since the last call, finite where the message
        was (codecs' `take_checks`): one that is not means its peer decoded garbage, so the step must be rejected."""
        return [flag for codec in self._codecs() for flag in codec.take_checks()]

    def _forward_codec(self, phase: str) -> tuple[Codec, dict]:
        if phase == "train":
            return self.forward, {}
        if phase == "warmup" and self.forward.warmup_refresh:
            return self.forward, {"refresh": True}
        return self.fallback_forward, {}

    def _backward_codec(self, phase: str) -> Codec:
        return self.backward if phase == "train" else self.fallback_backward

    def send_activation(self, x: torch.Tensor, sample_ids: torch.Tensor, phase: str) -> None:
        codec, kw = self._forward_codec(phase)
        msg = codec.encode(x, sample_ids, **kw)
        payload = torch.cat([msg.payload, _ids_bytes(sample_ids, msg.payload.device)]) if self.send_ids else msg.payload
        self.wire.send(payload, self.peer, tag=self.tag, group=self.outgoing, code=_coded(codec),
                       counter=self.counters[0])

    def post_activation(self, shape: torch.Size, dtype: torch.dtype, sample_ids: torch.Tensor, phase: str,
                        device: torch.device) -> "Posted":
        """Start receiving a micro-batch's activation. Its size comes from this side's codec state, which
        decoding other micro-batches of the step does not change (a step's sample ids are distinct)."""
        codec, kw = self._forward_codec(phase)
        nbytes = codec.payload_nbytes(shape, dtype, sample_ids, **kw)
        ids_nbytes = 8 * sample_ids.numel() if self.send_ids else 0
        incoming = self.wire.post(nbytes + ids_nbytes, self.peer, device, tag=self.tag, group=self.incoming,
                                  code=_coded(codec))
        return Posted(incoming, nbytes, shape, dtype, phase, sample_ids)

    def take_activation(self, posted: "Posted") -> torch.Tensor:
        """Wait for a posted activation and decode it; its sample ids are kept for `check_order`."""
        buf, nbytes, ids = posted.incoming.wait(), posted.nbytes, posted.sample_ids
        if self.send_ids:
            self._arrived.append((buf[nbytes:].clone().view(torch.int64),  # clone: int64's alignment
                                  _ids_tensor(ids).cpu().to(torch.int64)))
        codec, kw = self._forward_codec(posted.phase)
        return codec.decode(Message(buf[:nbytes], posted.shape, posted.dtype), ids, **kw)

    # ------------------------------------------------------------------ a step participant (participants.py)
    def begin(self, start: StepStart) -> None:
        """Drop the ids kept for `check_order` (a step that stopped short is not checked by the next)."""
        self._arrived = []

    def finish(self) -> StepPart:
        """The arrived ids checked, the codecs' step ended; the sender's AQ-SGD changes and overflow."""
        self.check_order()
        overflow = self.land()
        change = self.forward.take_change() if self.sends_activations else (0.0, 0.0)
        return StepPart(overflow=overflow, change=change)

    def land(self) -> BufferRangeError | None:
        """The codecs' step ended (AQ-SGD rows landed, a subspace's step clock): the first row of the sender's that
        its buffer cannot hold, or None (the receiver finds the same row; the sender reports it)."""
        overflow = self.forward.end_step()
        self.backward.end_step()
        return overflow if self.sends_activations else None

    def check_order(self) -> None:
        """After a step's schedule: the sample ids that came with its activations, read in one transfer (on a GPU,
        a read per message would wait for the compute queued before it), against the ids this stage loaded.
        A RuntimeError naming both where they differ: the stages' data orders differ, and the step decoded its
        activations into the wrong samples' buffer rows."""
        if not self._arrived:
            return
        arrived, self._arrived = self._arrived, []
        sent = torch.cat([a for a, _ in arrived]).cpu().split([a.numel() for a, _ in arrived])
        for got, (_, loaded) in zip(sent, arrived):
            if not torch.equal(got, loaded):
                raise RuntimeError(
                    f"received sample ids {got.tolist()} but this stage loaded {loaded.tolist()}: "
                    "the stages' data orders differ (same dataset, seed and batch sizes on every stage?)"
                )

    def send_grad(self, g: torch.Tensor, phase: str) -> None:
        codec = self._backward_codec(phase)
        msg = codec.encode(g)
        self.wire.send(msg.payload, self.peer, tag=self.tag, group=self.outgoing, code=_coded(codec),
                       counter=self.counters[1])

    def post_grad(self, shape: torch.Size, dtype: torch.dtype, phase: str, device: torch.device) -> "Posted":
        codec = self._backward_codec(phase)
        nbytes = codec.payload_nbytes(shape, dtype)
        return Posted(self.wire.post(nbytes, self.peer, device, tag=self.tag, group=self.incoming,
                                     code=_coded(codec)), nbytes, shape, dtype, phase)

    def send_raw(self, payload: torch.Tensor, counter: str | None = None, at_once: bool = False) -> None:
        """`payload` as it is (`counter`: the wire its bytes count on; None: none, as a probe's; `at_once`: Wire's)."""
        self.wire.send(payload, self.peer, tag=self.tag, group=self.outgoing, counter=counter, at_once=at_once)

    def recv_raw(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.wire.recv(nbytes, self.peer, device, tag=self.tag, group=self.incoming)

    def probe(self, leads: bool, large: int, small: int = 64) -> tuple[float, float, float] | None:
        """Time this boundary's link each way with ping-pongs of `large` and `small` bytes (both sides call it at
        the same point; the two directions may differ, as shaped uplinks do). The side that `leads` (the stage
        that sends activations) returns (seconds a byte ahead, seconds a byte back, one-way delay); the other
        side answers each message and returns None. Not counted as any wire's bytes: it is measurement. The
        messages live where the transport reads them (host memory under gloo), so that what is timed is the link:
        no copy to or from the GPU, no hand-off to the departures' thread."""
        where = self.wire.staging.transport
        big = torch.zeros(large, dtype=torch.uint8, device=where)
        little = torch.zeros(small, dtype=torch.uint8, device=where)
        plan = [(small, small)] + [(small, small), (large, small), (small, large)] * PROBE_REPEATS  # (out, back)
        self.wire.flush()  # nothing of the step before still queued: each probe message leaves at once
        if not leads:
            for n_out, n_in in plan:
                self.recv_raw(n_out, where)
                self.send_raw(big[:n_in] if n_in == large else little, at_once=True)
            self.wire.flush()
            return None
        times: dict[tuple[int, int], float] = {}
        for n_out, n_in in plan:  # the first message on a path pays its set-up: it is timed, then bettered
            start = time.perf_counter()
            self.send_raw(big if n_out == large else little, at_once=True)
            self.recv_raw(n_in, where)
            if where.type == "cuda":  # NCCL's wait only orders the GPU's queue: the host waits for the bytes here
                torch.cuda.synchronize(where)
            took = time.perf_counter() - start
            times[(n_out, n_in)] = min(took, times.get((n_out, n_in), took))  # the least: the link, not the noise
        self.wire.flush()
        rtt = times[(small, small)]
        per_byte = [max(0.0, times[pair] - rtt) / (large - small) for pair in ((large, small), (small, large))]
        return per_byte[0], per_byte[1], rtt / 2

    def take_grad(self, posted: "Posted") -> torch.Tensor:
        buf = posted.incoming.wait()
        return self._backward_codec(posted.phase).decode(Message(buf, posted.shape, posted.dtype))


@dataclass
class Posted:
    """A boundary receive in flight and what decoding it will need."""

    incoming: Incoming
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    phase: str
    sample_ids: torch.Tensor | None = None
