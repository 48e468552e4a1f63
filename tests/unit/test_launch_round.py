"""The ranks of a restarted launch agree on keys of their own round, whatever an earlier round left in the store."""
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from aqpipe.launch_round import ROOT, agree_round


def _round(store, size, delays):
    """agree_round on `size` threads sharing `store`, rank r starting after delays[r] seconds: each rank's id."""
    got = [None] * size

    def rank(r):
        time.sleep(delays[r])
        got[r] = agree_round(store, r, size, timedelta(seconds=20), poll=0.005)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_a_restarted_round_never_takes_the_dead_rounds_keys():
    store = dist.HashStore()
    first = _round(store, 3, [0, 0, 0])
    assert len(set(first)) == 1 and first[0] is not None
    # the next round: rank 2 comes late, so rank 0 first reads its dead predecessor's token (and sees the old go)
    second = _round(store, 3, [0, 0, 1.0])
    assert len(set(second)) == 1 and second[0] not in (None, first[0])
    assert second[0].endswith(".2") or second[0].endswith(".3"), second  # a roster with a dead token was redone


def test_a_rank_acknowledges_only_a_roster_holding_its_own_token():
    store = dist.HashStore()
    store.set(f"{ROOT}roster", json.dumps({"id": "stale.1", "tokens": ["a", "b"]}))
    store.set(f"{ROOT}go", "stale.1")
    with pytest.raises(RuntimeError, match="did not all arrive within 0.3 s"):  # rank 0 never comes
        agree_round(store, 1, 2, timedelta(seconds=0.3), poll=0.005)
    assert not store.check([f"{ROOT}ack/1"])


def test_a_stale_go_is_never_taken_for_this_rounds():
    """An earlier round's go stays in the store; this round's roster (a new id, this rank's token) is acknowledged
    but not yet confirmed: the rank waits for this round's go, however the threads are timed."""
    store = dist.HashStore()
    store.set(f"{ROOT}go", "stale.1")
    seen = {}

    def rank_1():
        try:
            seen["id"] = agree_round(store, 1, 2, timedelta(seconds=0.5), poll=0.005)
        except RuntimeError as exc:
            seen["error"] = str(exc)

    thread = threading.Thread(target=rank_1)
    thread.start()
    deadline = time.monotonic() + 5
    while not store.check([f"{ROOT}hello/1"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    token = store.get(f"{ROOT}hello/1").decode()
    store.set(f"{ROOT}roster", json.dumps({"id": "new.1", "tokens": ["rank0", token]}))  # rank 0's, not confirmed
    thread.join(10)
    assert store.get(f"{ROOT}ack/1").decode() == "new.1"  # acknowledged this round's roster
    assert "id" not in seen and "did not all arrive" in seen["error"]  # and waited for its go, never the stale one
