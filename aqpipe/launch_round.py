"""Join the process group under keys of this round of the launch, never an earlier round's.

torchrun keeps its store across `--max_restarts` restarts (static rendezvous) and across the rounds of an elastic
`--nnodes MIN:MAX` job, while torch names the process group's keys the same each round: a restarted rank reads the
dead ranks' addresses and cannot connect. Nothing the launcher tells a worker names the round the same on every
node (each node's TORCHELASTIC_RESTART_COUNT counts its own failures), so the ranks agree on one here:

1. every rank writes a token of its own, fresh in this process, under `hello/<rank>`;
2. rank 0 publishes a roster (an id fresh in its process, every rank's token as it read them) and waits for each
   rank to acknowledge that id; a rank acknowledges only a roster holding its own token, so a roster built from a
   token left by a dead process of an earlier round is never acknowledged, and rank 0 reads the tokens again;
3. once all acknowledged, rank 0 says go with that id, and every rank's keys are prefixed by it.
"""
from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

ROOT = "aqpipe/round/"
ACK_WAIT_S = 3.0  # how long rank 0 waits for acknowledgements before reading the tokens again


def _get(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def agree_round(store: dist.Store, rank: int, size: int, timeout: timedelta, poll: float = 0.02) -> str:
    """The id every rank of this round agrees on (see the module's docstring); RuntimeError after `timeout`."""
    token = uuid.uuid4().hex
    store.set(f"{ROOT}hello/{rank}", token)
    deadline = time.monotonic() + timeout.total_seconds()
    attempt = 0
    while time.monotonic() < deadline:
        if rank == 0:
            tokens = [_get(store, f"{ROOT}hello/{r}") for r in range(size)]
            if None not in tokens:
                attempt += 1
                rid = f"{token}.{attempt}"
                store.set(f"{ROOT}roster", json.dumps({"id": rid, "tokens": tokens}))
                until = min(deadline, time.monotonic() + ACK_WAIT_S)
                while time.monotonic() < until:
                    if all(_get(store, f"{ROOT}ack/{r}") == rid for r in range(1, size)):
                        store.set(f"{ROOT}go", rid)
                        return rid
                    time.sleep(poll)
                continue
        else:
            roster = json.loads(_get(store, f"{ROOT}roster") or '{"id": null, "tokens": []}')
            if rank < len(roster["tokens"]) and roster["tokens"][rank] == token:
                store.set(f"{ROOT}ack/{rank}", roster["id"])
                if _get(store, f"{ROOT}go") == roster["id"]:
                    return roster["id"]
        time.sleep(poll)
    raise RuntimeError(f"the ranks of this launch did not all arrive within {timeout.total_seconds():g} s")


def join_group(backend: str, rank: int, size: int, timeout: timedelta) -> str:
    """Init the default process group on the launcher's store under this round's keys; returns their prefix."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
    prefix = f"aqpipe/{agree_round(store, rank, size, timeout)}/"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                            timeout=timeout)
    return prefix
