"""Where aqpipe's caches live, and files written so that processes starting together never read half of one."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


def cache_root() -> Path:
    """Root of aqpipe's caches: `$AQPIPE_CACHE`, else `~/.cache/aqpipe`."""
    env = os.environ.get("AQPIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aqpipe"


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: written beside it, synced, then renamed, so readers see all or
    nothing; an error inside leaves no file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` all at once or not at all (atomic_file)."""
    with atomic_file(path) as f:
        f.write(data)


def sha256_hex(*parts: bytes) -> str:
    """Digest of several byte strings, each length-prefixed so boundaries count."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


