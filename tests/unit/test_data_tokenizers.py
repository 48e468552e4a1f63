"""Tokenizers (aqpipe/data/tokenizers.py): a model's own, else a BPE trained on the corpus, cached and
deterministic; bad input named."""
import logging

import pytest

from aqpipe import data



def test_trained_tokenizer_round_trips_text_with_many_distinct_ids(tok, text):
    from transformers import PreTrainedTokenizerFast
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 4096
    sentence = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer"
    ids = tok(sentence)["input_ids"]
    assert len(set(ids)) >= 12 and tok.unk_token_id not in ids
    assert tok.decode(ids) == sentence
    passage = text[500_000:510_000]
    ids = tok(passage)["input_ids"]
    assert len(set(ids)) > 500 and len(ids) < len(passage) / 3  # a real vocabulary, not bytes
    assert tok.decode(ids) == passage
    special = [tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
               tok.mask_token_id]
    assert sorted(special) == list(range(6))
    assert "token_type_ids" not in tok("a b")


def test_tokenizer_is_cached_and_training_is_deterministic(cache, tok, monkeypatch, tmp_path):
    files = list((cache / "tokenizers").glob("bpe-*-4096-*.json"))
    assert len(files) == 1
    corpus = tmp_path / "small.txt"
    corpus.write_text((cache / "data" / data.SHAKESPEARE_FILE).read_text()[:100_000])
    made = []
    for root in ("a", "b"):
        monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / root))
        made.append(data.load_tokenizer(None, corpus, vocab_size=600))
    assert made[0].get_vocab() == made[1].get_vocab() and len(made[0]) == 600
    assert (tmp_path / "a" / "tokenizers").is_dir()


def test_cls_sep_tokenizer_frames_pairs_with_token_types(cls_tok, tok):
    enc = cls_tok("Good night, sweet prince", "And flights of angels sing thee to thy rest")
    ids, types = enc["input_ids"], enc["token_type_ids"]
    assert ids[0] == cls_tok.cls_token_id and ids[-1] == cls_tok.sep_token_id
    assert ids.count(cls_tok.sep_token_id) == 2
    assert types[0] == 0 and types[-1] == 1 and sorted(types) == types
    assert tok("Good night")["input_ids"] == cls_tok("Good night", add_special_tokens=False)["input_ids"]


def test_saved_tokenizer_directory_loads_back(cls_tok, tmp_path):
    cls_tok.save_pretrained(tmp_path)
    again = data.load_tokenizer(str(tmp_path), None)
    sample = ("Friends, Romans, countrymen", "lend me your ears")
    assert again(*sample)["input_ids"] == cls_tok(*sample)["input_ids"]
    assert again.pad_token_id == cls_tok.pad_token_id


def test_model_directory_without_tokenizer_files_falls_back_to_training(tmp_path, corpus, tok):
    (tmp_path / "config.json").write_text("{}")
    assert data.load_tokenizer(str(tmp_path), corpus).get_vocab() == tok.get_vocab()


def test_unreachable_hub_tokenizer_falls_back_with_a_warning(offline_hub, corpus, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="aqpipe.data"):
        fallback = data.load_tokenizer("gpt2", corpus)
    assert fallback.get_vocab() == tok.get_vocab()
    assert "could not load the tokenizer of 'gpt2'" in caplog.text


def test_tokenizer_bad_inputs_are_named(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'\./no/such/model'"):
        data.load_tokenizer("./no/such/model", corpus)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.load_tokenizer(None, tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="vocab_size=100"):
        data.load_tokenizer(None, corpus, vocab_size=100)
