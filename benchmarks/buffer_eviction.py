"""Which samples should keep AQ-SGD rows when the budget holds fewer than the run reads back: a simulation.

Each epoch visits every sample once in a new shuffle (as aqpipe.data.micro_batches does); a buffer with room for a
fraction of the samples' rows either keeps a fixed set (the first samples to come, never evicting: what the trainer
does, with the samples visited most), evicts the least recently used row, or evicts the row needed furthest ahead
(Belady's rule, optimal for hits, which needs the whole order in advance). A revisit hits when its row is held; a
miss is sent whole. Printed: the share of each epoch's visits that hit, per rule and budget.

    python -m benchmarks.buffer_eviction                        # 20,000 samples, 2 and 3 epochs, seconds
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

RULES = ("fixed", "lru", "belady")


def hits(samples: int, room: int, epochs: int, rule: str, seed: int = 0) -> list[float]:
    """The share of each epoch's visits whose row is held, under `rule` with room for `room` rows."""
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(samples) for _ in range(epochs)])
    following = np.full(len(order), np.inf)  # each visit's next visit of the same sample
    seen: dict[int, int] = {}
    for t in range(len(order) - 1, -1, -1):
        following[t] = seen.get(int(order[t]), np.inf)
        seen[int(order[t])] = t
    held: OrderedDict[int, float] = OrderedDict()
    ahead: list[tuple[float, int]] = []  # Belady: (-next use, sample), stale entries skipped
    out = np.zeros(epochs)
    for t, sample in enumerate(order.tolist()):
        hit = sample in held
        out[t // samples] += hit
        if rule == "fixed":
            if not hit and len(held) < room and following[t] < np.inf:
                held[sample] = 0.0
        elif rule == "lru":
            held[sample] = 0.0
            held.move_to_end(sample)
            if len(held) > room:
                held.popitem(last=False)
        else:
            held.pop(sample, None)
            if following[t] < np.inf:
                held[sample] = following[t]
                heapq.heappush(ahead, (-following[t], sample))
            while len(held) > room:
                key, victim = heapq.heappop(ahead)
                if held.get(victim) == -key:
                    del held[victim]
    return (out / samples).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--rooms", default="0.25,0.5", help="the budget's room, as fractions of the samples")
    p.add_argument("--epochs", default="2,3")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    rows = []
    print("| room | epochs | rule | hits, epoch 2 | hits, last epoch |\n|---|---|---|---|---|")
    for room in (float(r) for r in args.rooms.split(",")):
        for epochs in (int(e) for e in args.epochs.split(",")):
            for rule in RULES:
                share = hits(args.samples, int(room * args.samples), epochs, rule)
                rows.append({"room": room, "epochs": epochs, "rule": rule, "hits": share})
                print(f"| {room:g} | {epochs} | {rule} | {share[1]:.3f} | {share[-1]:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
