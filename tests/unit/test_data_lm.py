"""Causal LM data (aqpipe/data/lm.py): exact blocks with stable ids, a disjoint eval tail, the token cache, local
tables and hub splits, bounded tokenizing; bad input named."""
import math

import numpy as np
import pytest
import torch

from aqpipe import data
from aqpipe.data import classification as classification_module
from aqpipe.data import lm as lm_module
from aqpipe.data import tokens as sources
from tests.helpers.files import write_table
from tests.helpers.shakespeare import SEQ, small_text



def every(dataset):
    """Every sample of a dataset, stacked per field."""
    return dataset.batch(np.arange(len(dataset)))


def test_lm_blocks_have_exact_length_and_stable_ids(shakespeare_lm, tok, text):
    train = shakespeare_lm["train"]
    assert len(train) > 10_000
    item = train[7]
    assert item["input_ids"].shape == item["attention_mask"].shape == item["labels"].shape == (SEQ,)
    assert item["sample_id"].dim() == 0 and item["sample_id"].item() == 7 and item["input_ids"].dtype == torch.int64
    assert torch.equal(every(train)["sample_id"], torch.arange(len(train)))
    assert torch.equal(every(train)["labels"], every(train)["input_ids"])
    assert bool(every(train)["attention_mask"].eq(1).all())
    assert tok.decode(train[1000]["input_ids"]) in text  # blocks are consecutive pieces of the text
    again = data.lm_dataset("shakespeare", tok, SEQ)  # from the token cache
    assert torch.equal(every(again)["input_ids"], every(train)["input_ids"])


def test_lm_samples_are_cut_from_a_memory_mapped_token_file_and_a_prefix_keeps_them(shakespeare_lm):
    train = shakespeare_lm["train"]
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint16  # 2 bytes a token, on disk
    part = data.limit(train, 10)
    assert len(part) == 10 and torch.equal(every(part)["input_ids"], train.batch(np.arange(10))["input_ids"])
    assert torch.equal(train[3]["input_ids"], torch.from_numpy(train.tokens[3 * SEQ:4 * SEQ].astype(np.int64)))
    with pytest.raises(IndexError, match="sample indices"):
        part.batch([10])


def test_lm_eval_split_is_the_disjoint_tail(shakespeare_lm, tok):
    train, ev = shakespeare_lm["train"], shakespeare_lm["eval"]
    everything = data.lm_dataset(None, tok, SEQ, eval_fraction=0.0)
    assert len(train) + len(ev) == len(everything) and 0.04 < len(ev) / len(everything) < 0.06
    assert torch.equal(torch.cat([every(train)["input_ids"], every(ev)["input_ids"]]),
                       every(everything)["input_ids"])
    assert torch.equal(every(ev)["sample_id"], torch.arange(len(ev)))


def test_lm_tokens_are_the_same_with_or_without_the_cache(tok, text, tmp_path, monkeypatch):
    path = tmp_path / "part.txt"
    path.write_text(small_text(text))
    first = data.lm_dataset(str(path), tok, SEQ)
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "fresh"))
    fresh = data.lm_dataset(path, tok, SEQ)
    cached = data.lm_dataset(path, tok, SEQ)
    assert torch.equal(every(first)["input_ids"], every(fresh)["input_ids"])
    assert torch.equal(every(fresh)["input_ids"], every(cached)["input_ids"])
    whole = tok(small_text(text))["input_ids"]
    assert abs(len(whole) - (len(first) + len(data.lm_dataset(path, tok, SEQ, "eval"))) * SEQ) < SEQ + 20


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_lm_from_local_tables_joins_rows_with_eos(tok, tmp_path, suffix):
    rows = [{"text": f"Row {i}: the quality of mercy is not strain'd, it droppeth as the gentle rain.", "n": i}
            for i in range(40)]
    ds = data.lm_dataset(write_table(tmp_path / f"t{suffix}", rows), tok, 16, eval_fraction=0.0)
    expected = [i for r in rows for i in tok(r["text"])["input_ids"] + [tok.eos_token_id]]
    assert len(ds) == len(expected) // 16 and len(ds) > 20
    assert every(ds)["input_ids"].flatten().tolist() == expected[: len(ds) * 16]


def test_a_tables_texts_stream_in_batches_of_rows_and_skip_empty_ones(tok, monkeypatch):
    """A hub dataset's column is read from its Arrow batches, never gathered whole: 2,500 rows in batches of 1024."""
    from datasets import Dataset

    from aqpipe.data import sources as table_sources

    texts = [f"line {i} of the play" if i % 7 else ("" if i % 2 else None) for i in range(2500)]
    table = Dataset.from_dict({"text": texts, "n": list(range(2500))})
    monkeypatch.setattr(Dataset, "__getitem__", lambda *a: pytest.fail("the whole column was gathered"))
    read = []
    iterate = Dataset.iter
    monkeypatch.setattr(Dataset, "iter", lambda self, batch_size, **kw: read.append(batch_size) or
                        iterate(self, batch_size, **kw))
    column = table_sources.column_texts(table, None, "the dataset given")
    kept = [t for t in texts if t]
    assert list(column) == kept and list(column) == kept  # iterable again, as the token file's three reads need
    assert read == [1024, 1024]
    ids = sources.token_file(column, tok)
    assert ids.tolist() == [i for t in kept for i in tok(t)["input_ids"] + [tok.eos_token_id]]


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
    assert (every(ev)["token_type_ids"].sum(1) > 0).all()


def test_a_large_text_is_tokenized_in_bounded_batches_with_the_same_ids(tok, text, monkeypatch, tmp_path):
    """Memory stays bounded: the file is read a line at a time and the tokenizer never sees more than a batch of
    chunks at once (the whole of a 121 MB corpus at once peaked at 6.2 GB); the ids are those of one call over
    every chunk, written as uint16 (a 4096-token vocabulary) to a file every process maps."""
    path = tmp_path / "sample.txt"
    path.write_text(text[:200_000])
    chunks = list(sources._line_chunks(text[:200_000].splitlines(keepends=True)))
    assert "".join(chunks) == text[:200_000] and all(c.endswith("\n") for c in chunks[:-1])
    whole = np.concatenate([np.asarray(ids, np.int64) for ids in sources._encode(tok, chunks)])
    calls = []
    encode = sources._encode
    monkeypatch.setattr(sources, "_encode", lambda t, texts: calls.append(len(texts)) or encode(t, texts))
    batched = np.concatenate(list(sources._token_pieces(path, tok, batch_texts=16)))
    assert np.array_equal(batched, whole)
    assert max(calls) == 16 and len(calls) == math.ceil(len(chunks) / 16)
    mapped = sources.token_file(path, tok)
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.uint16 and np.array_equal(mapped, whole)
    rows = ["first row", "second row", "third"]
    eos = tok.eos_token_id
    assert np.concatenate(list(sources._token_pieces(rows, tok, batch_texts=2))).tolist() == \
        [i for row in rows for i in [*tok(row, add_special_tokens=False)["input_ids"], eos]]


class _WideTokenizer:
    """A tokenizer stub of `size` tokens whose texts are ids written out ("65535 0 7"): the token file's width
    depends only on the vocabulary's length, and a fingerprint (a `backend_tokenizer`) sends it through the cache."""

    eos_token_id = pad_token_id = None
    model_input_names = ["input_ids"]
    padding_side = truncation_side = "right"

    def __init__(self, size: int):
        self.size = size
        self.backend_tokenizer = type("Backend", (), {"to_str": lambda _: '{"vocab": %d}' % size})()

    def __len__(self) -> int:
        return self.size

    def __call__(self, texts, **_):
        return {"input_ids": [[int(word) for word in text.split()] for text in texts]}


@pytest.mark.parametrize(("size", "width"), [(65536, np.uint16), (65537, np.uint32)])
def test_token_file_width_at_the_uint16_boundary_keeps_the_largest_id(tmp_path, size, width):
    """A vocabulary of exactly 2**16 tokens fits uint16; one more needs uint32, or its largest id wraps to 0."""
    rows = [f"{size - 1} 0 7", f"{size - 2} {size - 1}"]
    ids = sources.token_file(rows, _WideTokenizer(size))
    assert isinstance(ids, np.memmap) and ids.dtype == width  # written to the cache and mapped back
    assert ids.tolist() == [size - 1, 0, 7, size - 2, size - 1]
    again = sources.token_file(rows, _WideTokenizer(size))  # read back from the file alone
    assert again.filename == ids.filename and again.tolist() == ids.tolist()
