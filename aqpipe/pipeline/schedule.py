"""Pipeline schedules as data: the list of actions each stage performs for one batch.

An action is (op, micro_batch). Communication is explicit, so a schedule can be
checked without processes (`simulate`): sends are buffered (the engine uses
isend), receives block and must find the micro-batch they expect.

  gpipe  all forwards, then all backwards (activations of every micro-batch live at once)
  1f1b   stage s runs min(stages - s - 1, M) warm-up forwards, then alternates one
         forward and one backward, then drains: at most stages - s micro-batches in flight
  zb1    1F1B with each backward split in two (ZB-H1, "Zero Bubble Pipeline Parallelism",
         Qi et al. 2024): the input gradient, which the previous stage waits for, runs where
         1F1B's backward ran; the weight gradient, which nobody waits for, runs `s` micro-batches
         later on stage s, so the later stages, which 1F1B leaves idle while the earlier ones
         drain, fill that tail with it. The same messages in the same order as 1F1B; at most
         `stages` micro-batches in flight on any stage: 1F1B's peak, on its first stage. In bytes a
         later stage holds more than under 1F1B: each held micro-batch keeps its whole graph until
         its weight gradient runs (split_backward.py), on the last stage also a logits-sized gradient.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

RECV_ACT, FORWARD, SEND_ACT = "recv_act", "forward", "send_act"
RECV_GRAD, BACKWARD, SEND_GRAD = "recv_grad", "backward", "send_grad"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"  # a backward split in two (zb1)
SCHEDULES = ("gpipe", "1f1b", "zb1")
COMPUTE = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}  # relative costs (`bubble`)


class Action(NamedTuple):
    op: str
    micro_batch: int


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    ops = ([RECV_ACT] if stage > 0 else []) + [FORWARD] + ([SEND_ACT] if stage < stages - 1 else [])
    return [Action(op, mb) for op in ops]


def _backward(stage: int, stages: int, mb: int, op: str = BACKWARD) -> list[Action]:
    ops = ([RECV_GRAD] if stage < stages - 1 else []) + [op] + ([SEND_GRAD] if stage > 0 else [])
    return [Action(op, mb) for op in ops]


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"num_micro_batches={micro_batches}: expected at least 1")


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    _check(stage, stages, micro_batches)
    actions = [a for mb in range(micro_batches) for a in _forward(stage, stages, mb)]
    return actions + [a for mb in range(micro_batches) for a in _backward(stage, stages, mb)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    _check(stage, stages, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    actions = [a for mb in range(warmup) for a in _forward(stage, stages, mb)]
    for i in range(micro_batches - warmup):
        actions += _forward(stage, stages, warmup + i) + _backward(stage, stages, i)
    for mb in range(micro_batches - warmup, micro_batches):
        actions += _backward(stage, stages, mb)
    return actions


def zero_bubble_h1(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """1F1B's order with input- and weight-gradient actions; stage s holds back s weight gradients."""
    _check(stage, stages, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    actions = [a for mb in range(warmup) for a in _forward(stage, stages, mb)]
    waiting: deque[int] = deque()  # micro-batches whose input gradient is sent, weight gradient not yet run
    for mb in range(micro_batches):
        if warmup + mb < micro_batches:
            actions += _forward(stage, stages, warmup + mb)
        actions += _backward(stage, stages, mb, BACKWARD_INPUT)
        waiting.append(mb)
        if len(waiting) > stage:
            actions.append(Action(BACKWARD_WEIGHT, waiting.popleft()))
    return actions + [Action(BACKWARD_WEIGHT, mb) for mb in waiting]


def forward_only(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Evaluation: forwards only."""
    _check(stage, stages, micro_batches)
    return [a for mb in range(micro_batches) for a in _forward(stage, stages, mb)]


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zero_bubble_h1}


def train_schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[Action]:
    if name not in _BUILDERS:
        raise ValueError(f"schedule={name!r}: expected one of {', '.join(SCHEDULES)}")
    return _BUILDERS[name](stage, stages, micro_batches)


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any point."""
    live = peak = 0
    for op, _ in actions:
        live += (op == FORWARD) - (op in (BACKWARD, BACKWARD_WEIGHT))
        peak = max(peak, live)
    return peak


def simulate(schedules: list[list[Action]]) -> list[tuple[int, Action]]:
    """Run all stages' action lists together; returns the global order, or raises on deadlock.

    Sends go into per-link FIFO queues; a receive blocks until its queue is non-empty and
    raises if the head is not the micro-batch it expects (the engine would decode garbage).
    """
    return _play(schedules, [COMPUTE] * len(schedules), {})[0]


def bubble(schedules: list[list[Action]], costs: dict[str, float] | None = None, transfer: float = 0.0) -> float:
    """The fraction of the stages' time spent idle in one step: 1 - busy / (stages x makespan).

    Compute actions take `costs` (default COMPUTE: a backward twice a forward, each half of it once split),
    a message takes `transfer` on its link, which carries one at a time each way, sends do not block. 1F1B's is
    (S-1) / (M+S-1) at no transfer.
    """
    stages = len(schedules)
    links = {(a, b): transfer for a in range(stages) for b in (a - 1, a + 1) if 0 <= b < stages}
    _, clock, busy = _play(schedules, [COMPUTE if costs is None else costs] * stages, links)
    return 1.0 - sum(busy) / (stages * max(clock))


Transfer = float | tuple[float, float]  # a message's seconds on its link, or (seconds on it, latency after)


def makespan(schedules: list[list[Action]], costs: list[dict[str, float]],
             transfer: dict[tuple[int, int], Transfer]) -> float:
    """Seconds one step takes when stage s's compute actions take `costs[s][op]` and a message from stage a to
    stage b takes `transfer[(a, b)]` (absent: no time), each direction of a link carrying one message at a time
    (a message sent while the link is busy waits behind the one on it). A transfer given as (seconds, latency)
    holds the link for its seconds and arrives a latency later: messages in flight overlap their latencies. Used
    to price bits per link, and placements (aqpipe/plan)."""
    return max(_play(schedules, costs, transfer)[1])


def _play(schedules: list[list[Action]], costs: list[dict[str, float]],
          transfer: dict[tuple[int, int], Transfer]) -> tuple[list[tuple[int, Action]], list[float], list[float]]:
    """The global order of the actions, each stage's clock at its end and its time computing."""
    stages = len(schedules)
    queues = {(src, dst): deque() for src in range(stages) for dst in (src - 1, src + 1) if 0 <= dst < stages}
    free = dict.fromkeys(queues, 0.0)  # when each direction of each link is next idle
    pos, order = [0] * stages, []
    clock, busy = [0.0] * stages, [0.0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pos[s] < len(schedules[s]):
                action = schedules[s][pos[s]]
                if action.op in (RECV_ACT, RECV_GRAD):
                    src = s - 1 if action.op == RECV_ACT else s + 1
                    queue = queues[(src, s)]
                    if not queue:
                        break
                    kind, mb, arrives = queue.popleft()
                    if (kind, mb) != (action.op, action.micro_batch):
                        raise RuntimeError(f"stage {s} expected {action} but stage {src} sent {kind} {mb}")
                    clock[s] = max(clock[s], arrives)
                elif action.op in (SEND_ACT, SEND_GRAD):
                    link = (s, s + 1) if action.op == SEND_ACT else (s, s - 1)
                    held, latency = _split(transfer.get(link, 0.0))
                    free[link] = max(clock[s], free[link]) + held
                    kind = RECV_ACT if action.op == SEND_ACT else RECV_GRAD
                    queues[link].append((kind, action.micro_batch, free[link] + latency))
                else:
                    clock[s] += costs[s][action.op]
                    busy[s] += costs[s][action.op]
                order.append((s, action))
                pos[s] += 1
                progress = True
    stuck = [s for s in range(stages) if pos[s] < len(schedules[s])]
    if stuck:
        raise RuntimeError(f"deadlock: stages {stuck} wait at {[schedules[s][pos[s]] for s in stuck]}")
    return order, clock, busy


def _split(transfer: Transfer) -> tuple[float, float]:
    return (transfer, 0.0) if isinstance(transfer, (int, float)) else transfer


def simulate_streams(schedules: list[list[Action]], *, shared: bool, posted_ahead: bool) -> None:
    """Run the stages' action lists as NCCL runs point-to-point messages; raise on deadlock.

    NCCL queues a rank's sends and receives to a peer on one stream per communicator, in the order they are
    issued, and a send completes only together with its receive, both at the head of their streams. With
    `shared`, each pair of stages talks in one communicator (one process group for everything, as tags do
    not separate messages on NCCL); otherwise each direction of each link has its own (topology.channels).
    `posted_ahead`: every receive of the step is issued first (the engine's way on gloo); otherwise each at
    its action. A stage's host waits only for a receive it takes, and at the end for all of its messages.
    """
    stages = len(schedules)

    def stream(stage: int, src: int, dst: int) -> tuple[int, int, int]:
        return (stage, min(src, dst), max(src, dst)) if shared else (stage, src, dst)

    queues: dict[tuple[int, int, int], deque] = {}
    done: set[tuple[str, int, int, int]] = set()  # (kind, micro-batch, src, dst) delivered

    def issue(stage: int, action: Action) -> tuple[str, int, int, int]:
        """Queue the action's message on its stream; returns the message's identity."""
        sending = action.op in (SEND_ACT, SEND_GRAD)
        ahead = action.op in (SEND_ACT, RECV_ACT)
        if sending:
            src, dst = stage, stage + (1 if ahead else -1)
        else:
            src, dst = stage + (-1 if ahead else 1), stage
        message = ("act" if ahead else "grad", action.micro_batch, src, dst)
        queues.setdefault(stream(stage, src, dst), deque()).append(("send" if sending else "recv", message))
        return message

    receives = [[a for a in actions if a.op in (RECV_ACT, RECV_GRAD)] for actions in schedules]
    pos, waiting = [0] * stages, [None] * stages
    if posted_ahead:
        for s in range(stages):
            for action in receives[s]:
                issue(s, action)
    progress = True
    while progress:
        progress = False
        for key, queue in queues.items():  # deliver: a send meets its receive, both at the head of their streams
            stage, a, b = key
            if not queue or queue[0][0] != "send":
                continue
            message = queue[0][1]
            peer_queue = queues.get(stream(message[3], message[2], message[3]))
            if peer_queue and peer_queue[0] == ("recv", message):
                queue.popleft()
                peer_queue.popleft()
                done.add(message)
                progress = True
        for s in range(stages):
            while pos[s] < len(schedules[s]):
                if waiting[s] is not None:
                    if waiting[s] not in done:
                        break
                    waiting[s] = None
                action = schedules[s][pos[s]]
                if action.op in (SEND_ACT, SEND_GRAD):
                    issue(s, action)
                elif action.op in (RECV_ACT, RECV_GRAD):
                    src = s - 1 if action.op == RECV_ACT else s + 1
                    message = ("act" if action.op == RECV_ACT else "grad", action.micro_batch, src, s)
                    if not posted_ahead:
                        issue(s, action)
                    waiting[s] = message
                pos[s] += 1
                progress = True
    pending = sorted({key for key, queue in queues.items() if queue})
    stuck = [s for s in range(stages) if pos[s] < len(schedules[s]) or waiting[s] is not None]
    if pending or stuck:
        heads = {key: queues[key][0] for key in pending}
        raise RuntimeError(f"deadlock: stages {stuck} wait; streams {heads} cannot move")
