"""Classification data (aqpipe/data/classification.py): GLUE layouts, the built-in acceptability and next-line
tasks, padding and token types, local files; bad input named."""
from collections import Counter

import pytest

from aqpipe import data
from tests.helpers.files import write_table
from tests.helpers.shakespeare import SEQ



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
