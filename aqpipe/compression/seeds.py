"""Seeds derived from names: what a random draw gives does not depend on where it runs, and no two streams that
should differ (two boundaries, two replicas, a forward and a backward wire) can collide, as sums of products can."""
from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the parts' text: the same on every process, platform and Python run."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
