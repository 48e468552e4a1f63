"""The placement a run takes: who holds which (stage, replica), and the blocks of each stage, from the cost model.

Small worlds (up to `EXACT_UP_TO` ranks) are searched whole: every assignment of ranks to the grid's places, less
those that only renumber the replicas (which compute and send alike). Larger ones follow Yuan et al. (NeurIPS 2022,
"Decentralized Training of Foundation Models in Heterogeneous Environments"): the ranks are split into one group per
stage whose members are well linked (the replicas' sync runs inside a group), the groups are ordered into the path
the activations take that costs least (an open-loop path over the groups), the replicas are threaded through
consecutive groups by their best links, and a local search then swaps ranks while the predicted step falls. Both
keep the best placement the model predicts; blocks per stage follow each placement's speeds (CostModel.balance)
unless the run fixes them. Both also keep the best few of other kinds (`_Search.kind`: not the same placement with
alike machines swapped) that the model prices within its error of the best (`MARGIN`): the candidates a run
measures at start (trials.py), since the model cannot tell them apart.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from .cluster import Cluster
from .cost import CostModel, Prediction, ring_seconds, stage_memory
from .workload import Workload

EXACT_UP_TO = 8
RANDOM_STARTS = 3  # besides rank order and the two constructions
KEPT = 8  # candidates kept besides the best
MARGIN = 0.15  # the model's error this far (RESULTS.md): a candidate priced within it of the best is worth measuring


@dataclass(frozen=True)
class Candidate:
    """A placement, its blocks, what the model predicts of it, and (once trials.py has played it) its measured step."""

    placement: list[int]
    partition: list[int]
    predicted: Prediction
    measured: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement, "partition": self.partition, "shares": list(self.predicted.shares),
                "predicted_step_s": self.predicted.step, "measured_step_s": self.measured}


@dataclass(frozen=True)
class Plan:
    """A placement and its blocks, with what the model predicts of it and of rank order."""

    stages: int
    replicas: int
    placement: list[int]  # the rank of each (stage, replica), at index replica x stages + stage
    partition: list[int]
    predicted: Prediction
    rank_order: Prediction  # the launcher's numbering, with the same kind of split
    method: str  # "exact" or "search"
    evaluated: int = 0
    seconds: float = 0.0
    candidates: tuple[Candidate, ...] = ()  # the best first, then those priced within MARGIN of it, none alike
    measured: bool = False  # the placement is the candidates' fastest measured (trials.py), not the model's best

    @property
    def shares(self) -> list[int]:
        """Each replica's micro-batches a step (cost.CostModel.shares)."""
        return list(self.predicted.shares)

    def to_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "replicas": self.replicas, "placement": self.placement,
                "partition": self.partition, "shares": list(self.predicted.shares), "method": self.method,
                "evaluated": self.evaluated,
                "predicted_step_s": self.predicted.step, "rank_order_step_s": self.rank_order.step,
                "parts": {"pipeline": self.predicted.pipeline, "compute": self.predicted.compute,
                          "boundaries": {str(b): t for b, t in self.predicted.boundaries.items()},
                          "tables": self.predicted.tables, "data_parallel": self.predicted.data_parallel},
                "measured": self.measured, "candidates": [c.to_dict() for c in self.candidates]}


ALIKE = 0.2  # two machines within this of each other in every figure are taken as interchangeable (measured noise)


def _alike(a: float | None, b: float | None, floor: float = 0.0) -> bool:
    if a is None or b is None or math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= ALIKE * max(abs(a), abs(b)) + floor


def _same_machine(cluster: Cluster, i: int, j: int) -> bool:
    """Machines i and j alike in speed and memory (within ALIKE)."""
    a, b = cluster.machines[i], cluster.machines[j]
    return _alike(cluster.block_seconds(i, 1e12), cluster.block_seconds(j, 1e12)) and \
        _alike(a.memory_bytes, b.memory_bytes)


def _same_link(cluster: Cluster, one: tuple[int, int], other: tuple[int, int]) -> bool:
    """The link `one` (from, to) alike `other` in rate and latency (within ALIKE; latencies within 0.5 ms too)."""
    (i, j), (k, q) = one, other
    return _alike(cluster.rate[i][j], cluster.rate[k][q]) and _alike(cluster.latency[i][j], cluster.latency[k][q], 5e-4)


def interchangeable(cluster: Cluster) -> list[int]:
    """Each rank's class: machines alike (within ALIKE) in speed, memory, and their links to every other rank and
    between themselves, so that which of them holds what changes the step by no more than the table's noise."""
    n = len(cluster)

    def alike(i: int, j: int) -> bool:
        return _same_machine(cluster, i, j) and _same_link(cluster, (i, j), (j, i)) and \
            all(_same_link(cluster, (i, k), (j, k)) and _same_link(cluster, (k, i), (k, j))
                for k in range(n) if k not in (i, j))

    firsts: list[int] = []
    classes = []
    for i in range(n):
        match = next((c for c, f in enumerate(firsts) if alike(f, i)), None)
        if match is None:
            match = len(firsts)
            firsts.append(i)
        classes.append(match)
    return classes


def renamings(cluster: Cluster, classes: list[int], most: int = 6) -> list[tuple[int, ...]]:
    """The renamings of classes that leave the cluster as it was (two regions alike, swapped): each class to one of
    its size, speed and memory, every link between classes to one alike. Only the identity beyond `most` classes."""
    k = max(classes) + 1
    members = [[i for i, c in enumerate(classes) if c == x] for x in range(k)]
    rep = [ms[0] for ms in members]

    def same(x: int, y: int) -> bool:  # a class for another: as many machines, alike, alike linked among themselves
        if len(members[x]) != len(members[y]) or not _same_machine(cluster, rep[x], rep[y]):
            return False
        return len(members[x]) == 1 or _same_link(cluster, (rep[x], members[x][1]), (rep[y], members[y][1]))

    if k > most:
        return [tuple(range(k))]
    return [perm for perm in itertools.permutations(range(k))
            if all(same(x, perm[x]) for x in range(k)) and
            all(_same_link(cluster, (rep[x], rep[y]), (rep[perm[x]], rep[perm[y]]))
                for x in range(k) for y in range(k) if x != y)]


class _Search:
    def __init__(self, model: CostModel, partition: tuple[int, ...] | None) -> None:
        self.model, self.fixed = model, partition
        self.evaluated = 0
        self._splits: dict[tuple, tuple[int, ...]] = {}
        self._classes = interchangeable(model.cluster)
        self._renamings = renamings(model.cluster, self._classes)
        self.kept: dict[tuple, Candidate] = {}  # the best few priced, one of each kind (`kind`)

    def kind(self, placement: list[int]) -> tuple:
        """What a placement is, up to which of interchangeable machines holds what, renumbered replicas, and a
        renaming of classes that leaves the cluster as it was. Its blocks are not part of it: the split follows the
        machines' speeds, so alike machines' noise alone can move a block."""
        S = self.model.stages
        labels = [self._classes[r] for r in placement]
        return min(tuple(sorted(tuple(perm[x] for x in labels[i:i + S]) for i in range(0, len(labels), S)))
                   for perm in self._renamings)

    def _keep(self, placement: list[int], partition: tuple[int, ...], predicted: Prediction) -> None:
        """Keep a priced placement among the best few of their kinds."""
        kept, step = self.kept, predicted.step
        if not math.isfinite(step) or (len(kept) > KEPT and step >= max(c.predicted.step for c in kept.values())):
            return
        kind = self.kind(placement)
        if kind in kept and kept[kind].predicted.step <= step:
            return
        kept[kind] = Candidate(list(placement), list(partition), predicted)
        if len(kept) > KEPT + 1:
            del kept[max(kept, key=lambda k: kept[k].predicted.step)]

    def candidates(self, best: Candidate) -> tuple[Candidate, ...]:
        """`best`, then the kept placements of other kinds priced within MARGIN of it, fastest first."""
        kind = self.kind(best.placement)
        others = sorted((c for k, c in self.kept.items() if k != kind), key=lambda c: c.predicted.step)
        return (best, *(c for c in others if c.predicted.step <= best.predicted.step * (1 + MARGIN)))

    def splits(self, placement: list[int]) -> list[tuple[int, ...]]:
        """The blocks per stage a placement may take: the run's, or each stage paced by its slowest replica and by its
        fastest (where the others' shares of micro-batches, or links, make up the rest), which is faster depending
        on the placement."""
        if self.fixed is not None:
            return [self.fixed]
        m = self.model
        groups = [[placement[r * m.stages + s] for r in range(m.replicas)] for s in range(m.stages)]
        # what the split reads of each stage: its slowest and fastest replica's pace and its smallest memory
        key = tuple((max(m.block_s[x] for x in g), min(m.block_s[x] for x in g),
                     min(m.cluster.machines[x].memory_bytes or math.inf for x in g)) for g in groups)
        if key not in self._splits:
            self._splits[key] = sorted({m.balance(placement), m.balance(placement, fastest=True)})
        return self._splits[key]

    def price(self, placement: list[int]) -> tuple[Prediction, tuple[int, ...]]:
        """The placement's prediction with the faster of its splits (the first among equals), and that split."""
        self.evaluated += 1
        predicted, partition = min(((self.model.predict(placement, split), split) for split in self.splits(placement)),
                                   key=lambda option: option[0].step)
        self._keep(placement, partition, predicted)
        return predicted, partition


def plan(cluster: Cluster, work: Workload, stages: int, replicas: int, *, partition: list[int] | None = None,
         budget_s: float = 30.0, evaluations: int | None = None, seed: int = 0,
         exact_up_to: int = EXACT_UP_TO) -> Plan:
    """The placement the model predicts fastest for `stages` x `replicas` on `cluster`'s ranks; `partition`: blocks
    per stage the run fixes (None: chosen with each placement). Beyond `exact_up_to` ranks the search spends at most
    `budget_s` seconds and, where given, `evaluations` placements priced (then its answer depends on the seed alone,
    not on how busy the machine is). ValueError in one line when no placement fits."""
    started = time.perf_counter()
    n = stages * replicas
    if len(cluster) != n:
        raise ValueError(f"a cluster of {len(cluster)} machines for {stages} stages x {replicas} replicas; expected "
                         f"{n}")
    model = CostModel(cluster, work, stages, replicas)
    search = _Search(model, None if partition is None else tuple(partition))
    order = list(range(n))
    rank_order = search.price(order)[0]
    if n <= exact_up_to:
        best, method = _exact(search, stages, replicas), "exact"
    else:
        budget = Budget(search, budget_s, evaluations)
        best, method = _heuristic(search, cluster, work, stages, replicas, budget, seed), "search"
    (predicted, split), placement = best
    if not predicted.fits:
        short = _shortfall(model, search.splits(order)[0])
        raise ValueError(f"no placement of {stages} stages x {replicas} replicas fits the machines' memory: {short}")
    return Plan(stages, replicas, placement, list(split), predicted, rank_order, method, search.evaluated,
                time.perf_counter() - started, search.candidates(Candidate(placement, list(split), predicted)))


def _shortfall(model: CostModel, partition: tuple[int, ...]) -> str:
    S, w = model.stages, model.work
    need = max(stage_memory(w, s, S, partition[s]) for s in range(S))
    most = max(m.memory_bytes or math.inf for m in model.cluster.machines)
    return f"its largest stage needs {need / 1e9:.2f} GB, the largest machine has {most / 1e9:.2f} GB"


def _better(a: tuple[tuple[Prediction, tuple[int, ...]], list[int]] | None, b: tuple) -> bool:
    return a is None or b[0][0].step < a[0][0].step


def _exact(search: _Search, stages: int, replicas: int) -> tuple[tuple[Prediction, tuple[int, ...]], list[int]]:
    """Every placement up to renumbering the replicas (the rank holding stage 0 grows with the replica)."""
    n = stages * replicas
    best = None
    for perm in itertools.permutations(range(n)):
        firsts = [perm[r * stages] for r in range(replicas)]
        if any(a > b for a, b in zip(firsts, firsts[1:])):
            continue
        placement = list(perm)
        candidate = (search.price(placement), placement)
        if _better(best, candidate):
            best = candidate
    return best


class Budget:
    """What a search may spend: seconds, and (where given) placements priced; either ends it. A part of what is left
    (`part`) is a budget of its own, `used` how far through it a search is."""

    def __init__(self, search: _Search, seconds: float, evaluations: int | None = None) -> None:
        self.search, self.began, self.began_at = search, time.perf_counter(), search.evaluated
        self.deadline, self.limit = self.began + seconds, (math.inf if evaluations is None else
                                                            search.evaluated + evaluations)

    def done(self) -> bool:
        return time.perf_counter() >= self.deadline or self.search.evaluated >= self.limit

    def used(self) -> float:
        by_time = (time.perf_counter() - self.began) / max(self.deadline - self.began, 1e-9)
        by_count = (self.search.evaluated - self.began_at) / max(self.limit - self.began_at, 1e-9)
        return min(1.0, max(by_time, by_count))

    def part(self, share: float) -> "Budget":
        left = max(self.deadline - time.perf_counter(), 0.0) * share
        count = None if math.isinf(self.limit) else int(max(self.limit - self.search.evaluated, 0) * share)
        return Budget(self.search, left, count)


def _heuristic(search: _Search, cluster: Cluster, work: Workload, stages: int, replicas: int, budget: Budget,
               seed: int) -> tuple[tuple[Prediction, tuple[int, ...]], list[int]]:
    """From rank order and two constructions (stage groups by links, as Yuan et al.; pipelines by links, where the
    boundaries outweigh the sync), annealed by swapping ranks, then swapped while the step falls."""
    rng = random.Random(seed)
    n = stages * replicas
    dp_bytes = work.dp_bytes_per_parameter * work.block_trained * max(1, work.blocks // stages) or work.table_bytes
    message = work.micro_batches * (work.forward_bytes + work.backward_bytes)
    starts = [list(range(n)), _by_stage_groups(cluster, stages, replicas, dp_bytes, message),
              _by_pipelines(cluster, stages, replicas, message)]
    starts += [rng.sample(range(n), n) for _ in range(RANDOM_STARTS)]
    priced = [(search.price(p), p) for p in starts]
    best = min(priced, key=lambda c: c[0][0].step)
    for k, candidate in enumerate(priced):  # each start annealed for a share of half the budget, then polished
        share = budget.part(1 / (2 * (len(priced) - k)))
        found = _polish(search, _anneal(search, candidate, rng, share.part(0.5), stages), share)
        if _better(best, found):
            best = found
    return _polish(search, best, budget)


def _move(placement: list[int], stages: int, rng: random.Random) -> list[int]:
    """A neighbouring placement: two ranks swapped, or (a third of the time) two stages' whole columns, every
    replica's rank of one stage for the other's."""
    out, n = list(placement), len(placement)
    if stages > 1 and rng.random() < 1 / 3:
        a, b = rng.sample(range(stages), 2)
        for r in range(n // stages):
            out[r * stages + a], out[r * stages + b] = out[r * stages + b], out[r * stages + a]
        return out
    i, j = rng.sample(range(n), 2)
    out[i], out[j] = out[j], out[i]
    return out


def _anneal(search: _Search, start: tuple, rng: random.Random, budget: Budget, stages: int) -> tuple:
    """Simulated annealing over moves (`_move`): a worse step is taken with probability exp(-rise / T), T cooling
    from a twentieth of the start's step as the budget is spent; the best placement met is returned."""
    current = best = start
    n = len(start[1])
    if n < 2:
        return best
    t0 = 0.05 * start[0][0].step if math.isfinite(start[0][0].step) else 1.0
    while not budget.done():
        temperature = t0 * (1e-3 ** budget.used())
        placement = _move(current[1], stages, rng)
        candidate = (search.price(placement), placement)
        rise = candidate[0][0].step - current[0][0].step
        if rise <= 0 or (math.isfinite(rise) and rng.random() < math.exp(-rise / max(temperature, 1e-12))):
            current = candidate
            if _better(best, current):
                best = current
    return best


def _polish(search: _Search, start: tuple, budget: Budget) -> tuple:
    """Every swap of two ranks, taken while it shortens the step, until none does or the budget ends."""
    current = start
    n = len(start[1])
    improved = True
    while improved and not budget.done():
        improved = False
        for i, j in itertools.combinations(range(n), 2):
            if budget.done():
                break
            placement = list(current[1])
            placement[i], placement[j] = placement[j], placement[i]
            candidate = (search.price(placement), placement)
            if candidate[0][0].step < current[0][0].step * (1 - 1e-9):
                current, improved = candidate, True
    return current


def _by_stage_groups(cluster: Cluster, stages: int, replicas: int, dp_bytes: float, message: float) -> list[int]:
    """Yuan et al.'s construction: stage groups by links, their cheapest path, replicas threaded by best links."""
    groups = _groups(cluster, stages, replicas, dp_bytes)

    def between(a: list[int], b: list[int]) -> float:  # the groups' best pairing's slowest pair, by greedy matching
        return max(t for t, _, _ in _matching(cluster, a, b, message))

    order = _path([list(g) for g in groups], between)
    chains = [[r] for r in order[0]]
    for s in range(1, stages):
        pairs = _matching(cluster, [c[-1] for c in chains], order[s], message)
        for _, i, j in pairs:
            chains[i].append(order[s][j])
    return _placement(chains, stages)


def _by_pipelines(cluster: Cluster, stages: int, replicas: int, message: float) -> list[int]:
    """Each replica's pipeline on ranks well linked among themselves, its stages in the cheapest path over them."""
    chains = []
    for group in _groups(cluster, replicas, stages, message):
        order = _path([[r] for r in group], lambda a, b: cluster.seconds(a[0], b[0], message))
        chains.append([g[0] for g in order])
    return _placement(chains, stages)


def _placement(chains: list[list[int]], stages: int) -> list[int]:
    """Replica r's chain of ranks (stage order) laid out as a placement."""
    placement = [0] * (len(chains) * stages)
    for r, chain in enumerate(chains):
        for s, rank in enumerate(chain):
            placement[r * stages + s] = rank
    return placement


def _groups(cluster: Cluster, stages: int, replicas: int, nbytes: float) -> list[list[int]]:
    """`stages` groups of `replicas` ranks each, well linked inside: seeded by the least linked rank left, grown by
    the rank nearest the group, then improved by swapping members between groups while the slowest ring falls."""
    n = stages * replicas
    if replicas == 1 or stages == 1:
        return [[r] for r in range(n)] if replicas == 1 else [list(range(n))]

    def link(i: int, j: int) -> float:
        return max(cluster.seconds(i, j, nbytes), cluster.seconds(j, i, nbytes))

    left = set(range(n))
    groups: list[list[int]] = []
    while left:
        seed = max(sorted(left), key=lambda i: sum(link(i, j) for j in left if j != i))
        group = [seed]
        left.discard(seed)
        while len(group) < replicas:
            nearest = min(sorted(left), key=lambda j: max(link(i, j) for i in group))
            group.append(nearest)
            left.discard(nearest)
        groups.append(group)

    def ring(g: list[int]) -> float:
        return ring_seconds(cluster, g, nbytes)

    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(len(groups)), 2):
            for i, j in itertools.product(range(replicas), range(replicas)):
                ga, gb = list(groups[a]), list(groups[b])
                ga[i], gb[j] = gb[j], ga[i]
                if max(ring(ga), ring(gb)) < max(ring(groups[a]), ring(groups[b])) * (1 - 1e-9):
                    groups[a], groups[b], improved = ga, gb, True
    return groups


def _matching(cluster: Cluster, a: list[int], b: list[int], nbytes: float) -> list[tuple[float, int, int]]:
    """Pairs (time, index in a, index in b) joining each of `a` to one of `b`, fastest links first (greedy)."""
    options = sorted((cluster.seconds(x, y, nbytes), i, j) for i, x in enumerate(a) for j, y in enumerate(b))
    used_a, used_b, out = set(), set(), []
    for t, i, j in options:
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            out.append((t, i, j))
    return out


def _path(groups: list[list[int]], between: Any) -> list[list[int]]:
    """The order of the groups whose consecutive links cost least in sum: every order where there are few,
    else nearest neighbours from each start, then 2-opt."""
    k = len(groups)
    cost = [[between(groups[i], groups[j]) if i != j else 0.0 for j in range(k)] for i in range(k)]

    def length(order: list[int]) -> float:
        return sum(cost[order[i]][order[i + 1]] for i in range(k - 1))

    if k <= 7:
        best = min(itertools.permutations(range(k)), key=lambda o: length(list(o)))
        return [groups[i] for i in best]
    candidates = []
    for start in range(k):
        order, left = [start], set(range(k)) - {start}
        while left:
            nxt = min(sorted(left), key=lambda j: cost[order[-1]][j])
            order.append(nxt)
            left.discard(nxt)
        improved = True
        while improved:
            improved = False
            for i in range(1, k - 1):
                for j in range(i + 1, k):
                    trial = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                    if length(trial) < length(order) - 1e-12:
                        order, improved = trial, True
        candidates.append(order)
    return [groups[i] for i in min(candidates, key=length)]
