"""The machines a run has, as a table: each one's compute speed and memory, and every link's rate and latency.

One format serves three uses: what `--placement auto` measured at start (profile.py writes it, `--cluster` reads it
back), what a user writes down to plan before anything runs (`aqpipe plan --cluster cluster.yaml`), and the links a
host emulates (`AQPIPE_LINK_MATRIX`). YAML or JSON, machine i being rank i (the launcher's order):

    machines:                        # one per rank, in rank order
      - {name: a100-0, region: us, block_ms: 12.0, memory_gb: 80}
      - {name: a100-1, region: us, tflops: 150}
      - {name: spot-7, region: eu, tflops: 60}
    regions:                         # a link between two regions (both ways unless the reverse is given)
      us: {us: {mbit: 10000, latency_ms: 0.1}, eu: {mbit: 100, latency_ms: 40}}
      eu: {eu: {mbit: 10000, latency_ms: 0.1}}
    links:                           # a pair of machines (by name or rank), over its regions' link
      - {from: a100-0, to: spot-7, mbit: 50, latency_ms: 45}
    default_link: {mbit: 1000, latency_ms: 0.5}   # a pair nothing above names

A machine's speed is `block_ms` (one block's forward and backward of one micro-batch at the run's shape, as measured)
or `tflops` (what it sustains; a block's time is then its FLOPs over that). A link is one way: `from` -> `to`.
Every bad value is refused in one line naming where it is.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Machine:
    name: str
    region: str | None = None
    block_s: float | None = None  # one block's forward + backward of one micro-batch, at the run's shape
    tflops: float | None = None  # or the rate it computes at, from which the plan prices a block
    memory_bytes: float | None = None  # what a stage may take here (None: unbounded)


@dataclass(frozen=True)
class Cluster:
    """`machines[i]` is rank i; `latency[i][j]` (seconds) and `rate[i][j]` (bytes a second) the link from i to j."""

    machines: tuple[Machine, ...]
    latency: tuple[tuple[float, ...], ...]
    rate: tuple[tuple[float, ...], ...]
    source: str = "given"  # where the table came from, for the start line

    def __len__(self) -> int:
        return len(self.machines)

    def seconds(self, src: int, dst: int, nbytes: float) -> float:
        """A message of `nbytes` from rank `src` to rank `dst`: its time on the link and its latency."""
        return nbytes / self.rate[src][dst] + self.latency[src][dst] if src != dst else 0.0

    def block_seconds(self, rank: int, flops: float) -> float:
        """Rank `rank`'s time for one block's forward and backward of a micro-batch (`flops` of them)."""
        m = self.machines[rank]
        return m.block_s if m.block_s is not None else flops / (m.tflops * 1e12)

    def to_dict(self) -> dict[str, Any]:
        """The table as a file holds it: every machine and every pair's link, written out."""
        machines = []
        for m in self.machines:
            row: dict[str, Any] = {"name": m.name}
            if m.region is not None:
                row["region"] = m.region
            if m.block_s is not None:
                row["block_ms"] = round(m.block_s * 1e3, 6)
            if m.tflops is not None:
                row["tflops"] = m.tflops
            if m.memory_bytes is not None:
                row["memory_gb"] = round(m.memory_bytes / 1e9, 3)
            machines.append(row)
        links = [{"from": i, "to": j, "mbit": round(self.rate[i][j] * 8 / 1e6, 4),
                  "latency_ms": round(self.latency[i][j] * 1e3, 4)}
                 for i in range(len(self)) for j in range(len(self)) if i != j]
        return {"machines": machines, "links": links}

    def write(self, path: str | Path) -> None:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False) if str(path).endswith((".yaml", ".yml")) else \
            json.dumps(self.to_dict(), indent=1)
        Path(path).write_text(text)


def _number(value: Any, where: str, low: float = 0.0, strict: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value > low if strict else value >= low)
    if not ok:
        raise ValueError(f"{where}={value!r}: expected a number {'>' if strict else '>='} {low:g}")
    return float(value)


def _link(spec: Any, where: str) -> tuple[float, float]:
    """(latency s, rate bytes/s) of a link's entry {mbit, latency_ms}."""
    if not isinstance(spec, dict) or "mbit" not in spec:
        raise ValueError(f"{where}={spec!r}: expected {{mbit: rate, latency_ms: delay}}")
    unknown = sorted(set(spec) - {"mbit", "latency_ms", "from", "to"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected mbit, latency_ms")
    return (_number(spec.get("latency_ms", 0.0), f"{where}.latency_ms", strict=False) / 1e3,
            _number(spec["mbit"], f"{where}.mbit") * 1e6 / 8)


def _machine(row: Any, index: int, where: str) -> Machine:
    at = f"{where}: machines[{index}]"
    if not isinstance(row, dict):
        raise ValueError(f"{at}={row!r}: expected a mapping with block_ms or tflops")
    unknown = sorted(set(row) - {"name", "region", "block_ms", "tflops", "memory_gb"})
    if unknown:
        raise ValueError(f"{at}: unknown key(s) {', '.join(unknown)}; expected name, region, block_ms, tflops, "
                         "memory_gb")
    if "block_ms" not in row and "tflops" not in row:
        raise ValueError(f"{at}: no speed; expected block_ms (one block's forward and backward, measured) or tflops")
    block = _number(row["block_ms"], f"{at}.block_ms") / 1e3 if "block_ms" in row else None
    tflops = _number(row["tflops"], f"{at}.tflops") if "tflops" in row else None
    memory = _number(row["memory_gb"], f"{at}.memory_gb") * 1e9 if "memory_gb" in row else None
    region = row.get("region")
    if region is not None and not isinstance(region, str):
        raise ValueError(f"{at}.region={region!r}: expected a region's name")
    return Machine(str(row.get("name", f"rank{index}")), region, block, tflops, memory)


def parse(data: Any, where: str = "cluster", ranks: int | None = None) -> Cluster:
    """A Cluster from a file's contents; `ranks`: how many the run has (the machines must be as many)."""
    if not isinstance(data, dict) or not isinstance(data.get("machines"), list) or not data["machines"]:
        raise ValueError(f"{where}: expected a mapping with a list of machines (one per rank, in rank order)")
    unknown = sorted(set(data) - {"machines", "regions", "links", "default_link"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected machines, regions, links, "
                         "default_link")
    machines = tuple(_machine(row, i, where) for i, row in enumerate(data["machines"]))
    n = len(machines)
    if ranks is not None and n != ranks:
        raise ValueError(f"{where}: {n} machines for a run of {ranks} ranks; expected one machine per rank")
    names = {m.name: i for i, m in enumerate(machines)}
    if len(names) != n:
        raise ValueError(f"{where}: machine names repeat; expected each once")
    default = _link(data["default_link"], f"{where}: default_link") if "default_link" in data else None
    regions: dict[tuple[str, str], tuple[float, float]] = {}
    for a, row in (data.get("regions") or {}).items():
        if not isinstance(row, dict):
            raise ValueError(f"{where}: regions.{a}={row!r}: expected a mapping of regions to links")
        for b, spec in row.items():
            regions[(a, b)] = _link(spec, f"{where}: regions.{a}.{b}")
    for (a, b), link in list(regions.items()):
        regions.setdefault((b, a), link)  # both ways unless the reverse is given
    pairs: dict[tuple[int, int], tuple[float, float]] = {}
    for k, spec in enumerate(data.get("links") or []):
        at = f"{where}: links[{k}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{at}={spec!r}: expected {{from, to, mbit, latency_ms}}")
        ends = []
        for key in ("from", "to"):
            end = spec.get(key)
            index = names.get(end, end) if isinstance(end, str) else end
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
                raise ValueError(f"{at}.{key}={end!r}: expected a machine's name or rank (0..{n - 1})")
            ends.append(index)
        if ends[0] == ends[1]:
            raise ValueError(f"{at}: from and to are both {spec['from']!r}; expected two machines")
        pairs[tuple(ends)] = _link(spec, at)
    for (i, j), link in list(pairs.items()):
        pairs.setdefault((j, i), link)
    latency = [[0.0] * n for _ in range(n)]
    rate = [[math.inf] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            ri, rj = machines[i].region, machines[j].region
            link = pairs.get((i, j)) or regions.get((ri, rj)) or default
            if link is None:
                raise ValueError(f"{where}: no link from {machines[i].name} to {machines[j].name} (regions "
                                 f"{ri!r} -> {rj!r}); expected it under regions, links or default_link")
            latency[i][j], rate[i][j] = link
    return Cluster(machines, tuple(map(tuple, latency)), tuple(map(tuple, rate)), source=where)


def read(path: str | Path, ranks: int | None = None) -> Cluster:
    """The table in a YAML or JSON file; ValueError in one line naming the file and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cluster file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise ValueError(f"cluster file {path}: not YAML or JSON ({str(exc).splitlines()[0]})") from None
    return parse(data, str(path), ranks)
