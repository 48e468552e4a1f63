"""The user's own data: a local table in GLUE's column layouts trains with no flag, `--text_column`,
`--text_pair_column` and `--label_column` name any other columns, and label names reach the model's config.

Offline and small: the tokenizer is a byte-level BPE trained on a few generated speeches.
"""
import json
import random
from pathlib import Path

import pytest
import torch

from aqpipe import data
from aqpipe import train as trainer
from aqpipe.config import RunConfig
from aqpipe.settings import resolve
from aqpipe.flags import build_parser
from aqpipe.data import classification as sources
from aqpipe.models import resolve_model
from aqpipe.tasks import TASKS
from aqpipe.world import World
from tests.helpers.files import write_table

SEQ = 24
FORMATS = (".csv", ".json", ".jsonl", ".parquet")
WORDS = ("mercy gentle rain heaven place beneath twice blest giveth taketh mightiest becomes throned monarch "
         "better crown sceptre shows force temporal power attribute awe majesty wherein doth sit dread fear "
         "kings").split()


# ----------------------------------------------------------------------------- fixtures

def _speeches(count: int = 60, lines: int = 6, seed: int = 0) -> str:
    """Play-like text that `verse_runs` reads: a speaker's name, then verse lines of 4+ words."""
    rng = random.Random(seed)
    speeches = []
    for i in range(count):
        verse = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))).capitalize() for _ in range(lines)]
        speeches.append("\n".join([f"{'PORTIA' if i % 2 else 'SHYLOCK'}.", *verse]))
    return "\n\n".join(speeches) + "\n"


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("aqpipe-cache")


@pytest.fixture(autouse=True)
def _use_cache(cache, monkeypatch):
    monkeypatch.setenv("AQPIPE_CACHE", str(cache))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "speeches.txt"
    path.write_text(_speeches(), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def cls_tok(cache, corpus):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AQPIPE_CACHE", str(cache))
        return data.load_tokenizer(None, corpus, vocab_size=400, cls_sep=True)


def load(path: Path, tok, **kw) -> data.TensorDictDataset:
    """The whole file as one train split (no eval carved off)."""
    return data.classification_dataset(str(path), tok, SEQ, eval_fraction=0.0, **kw)


def rows_of(columns: tuple[str, ...], n: int = 12, labels=None) -> list[dict]:
    """n rows with a distinct text in each column (its name and the row number), labels 0/1 by default,
    and an integer column no layout uses."""
    labels = labels or [i % 2 for i in range(n)]
    return [{**{c: f"{c} {i} words" for c in columns}, "label": labels[i], "idx": i} for i in range(n)]


# ----------------------------------------------------------------------------- the layouts, with no flag

LAYOUTS = [("sentence",), ("sentence1", "sentence2"), ("question", "sentence"), ("question1", "question2"),
           ("premise", "hypothesis"), ("text",), ("text", "text_pair")]


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS, ids="+".join)
def test_each_glue_layout_loads_from_each_format(cls_tok, tmp_path, layout, suffix):
    rows = rows_of(layout)
    ds = load(write_table(tmp_path / f"t{suffix}", rows), cls_tok)
    pair = layout[1] if len(layout) == 2 else None
    expected = [(r[layout[0]], r[pair] if pair else None, r["label"]) for r in rows]
    assert sorted(ds.examples) == sorted(expected)
    assert ds.num_labels == 2 and ds.label_names is None  # bare integers: no names to keep
    assert ds.tensors["input_ids"].shape == (len(rows), SEQ)
    assert sorted(ds.tensors["labels"].tolist()) == sorted(r["label"] for r in rows)
    if pair:  # the second text is the tokenizer's second segment
        assert bool((ds.tensors["token_type_ids"].sum(1) > 0).all())


def test_pairs_win_over_single_sentences_and_the_known_layouts_are_data():
    assert sources.table_columns(["question", "sentence", "label"], "f") == ("question", "sentence", "label")
    assert sources.table_columns(["sentence", "label", "idx"], "f") == ("sentence", None, "label")
    assert sources.table_columns(["text", "text_pair", "labels"], "f") == ("text", "text_pair", "labels")
    assert sources.table_columns(["text", "label", "labels"], "f") == ("text", None, "label")  # label first
    pairs = [i for i, (_, second) in enumerate(sources.TEXT_LAYOUTS) if second is not None]
    singles = [i for i, (_, second) in enumerate(sources.TEXT_LAYOUTS) if second is None]
    assert max(pairs) < min(singles)
    assert {layout for layout in sources.TEXT_LAYOUTS} >= {(a, b) for a, b, _, _ in sources.GLUE_TASKS.values()}


@pytest.mark.parametrize("suffix", FORMATS)
def test_labels_column_is_taken_when_there_is_no_label_column(cls_tok, tmp_path, suffix):
    rows = [{"sentence": f"sentence {i}", "labels": i % 3} for i in range(12)]
    ds = load(write_table(tmp_path / f"l{suffix}", rows), cls_tok)
    assert sorted(ds.examples) == sorted((r["sentence"], None, r["labels"]) for r in rows)
    assert ds.num_labels == 3


# ----------------------------------------------------------------------------- label names

@pytest.mark.parametrize("suffix", FORMATS)
def test_qnli_file_with_string_labels_keeps_their_names_in_id_order(cls_tok, tmp_path, suffix):
    names = ["not_entailment", "entailment"]
    rows = [{"question": f"question {i}?", "sentence": f"sentence {i}.", "label": names[i % 3 == 0], "idx": i}
            for i in range(30)]
    path = write_table(tmp_path / f"qnli{suffix}", rows)
    train = data.classification_dataset(str(path), cls_tok, SEQ, eval_fraction=0.2)
    ev = data.classification_dataset(str(path), cls_tok, SEQ, "eval", eval_fraction=0.2)
    assert train.label_names == ev.label_names == ["entailment", "not_entailment"]  # sorted: ids 0, 1
    assert train.num_labels == 2
    by_question = {r["question"]: r for r in rows}
    for split in (train, ev):
        for (question, sentence, y), label in zip(split.examples, split.tensors["labels"].tolist()):
            assert y == label and sentence == by_question[question]["sentence"]
            assert split.label_names[y] == by_question[question]["label"]
    assert data.limit(train, 5).label_names == train.label_names


def test_many_string_labels_are_numbered_in_sorted_order(cls_tok, tmp_path):
    moods = ["neutral", "positive", "negative", "mixed"]
    rows = [{"text": f"review {i}", "label": moods[i % 4]} for i in range(20)]
    ds = load(write_table(tmp_path / "m.jsonl", rows), cls_tok)
    assert ds.label_names == sorted(moods) and ds.num_labels == 4
    assert all(ds.label_names[y] == moods[int(text.split()[1]) % 4] for text, _, y in ds.examples)


def test_class_label_feature_names_are_kept(cls_tok, tmp_path):
    import datasets
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["unacceptable", "acceptable"])})
    rows = [{"sentence": f"line {i}", "label": i % 2} for i in range(10)]
    path = tmp_path / "cola.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    ds = load(path, cls_tok)
    assert ds.label_names == ["unacceptable", "acceptable"] and ds.num_labels == 2


def test_glue_hub_tasks_name_their_labels_from_the_features(cls_tok, monkeypatch):
    import datasets
    features = datasets.Features({"question": datasets.Value("string"), "sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["entailment", "not_entailment"]),
                                  "idx": datasets.Value("int32")})
    table = datasets.Dataset.from_list([{"question": f"q{i}?", "sentence": f"s{i}.", "label": i % 2, "idx": i}
                                        for i in range(8)], features=features)
    monkeypatch.setattr(sources, "load_hub", lambda name, config: datasets.DatasetDict(
        {"train": table, "validation": table}))
    ds = data.classification_dataset("glue/qnli", cls_tok, SEQ, "eval")
    assert ds.label_names == ["entailment", "not_entailment"] and ds.examples[1] == ("q1?", "s1.", 1)


@pytest.mark.parametrize("task,names", [("acceptability", ["unacceptable", "acceptable"]),
                                        ("next_line", ["not_next", "next"])])
def test_builtin_tasks_name_their_labels(cls_tok, corpus, task, names):
    ds = data.classification_dataset(task, cls_tok, SEQ, text_path=corpus, max_samples=20)
    assert ds.label_names == names and ds.num_labels == len(names)


def test_the_model_config_maps_ids_to_the_label_names(cls_tok, tmp_path):
    names = ["entailment", "not_entailment"]
    tiny = resolve_model(None, "deberta", "classification", cls_tok, SEQ, 2, label_names=names).config
    assert tiny.id2label == {0: "entailment", 1: "not_entailment"}
    assert tiny.label2id == {"entailment": 0, "not_entailment": 1}
    tiny.to_json_file(tmp_path / "config.json")  # a config.json: the seeded random init of that shape
    shaped = resolve_model(str(tmp_path / "config.json"), "deberta", "classification", cls_tok, SEQ, 3,
                           label_names=["a", "b", "c"]).config
    assert shaped.id2label == {0: "a", 1: "b", 2: "c"} and shaped.num_labels == 3
    bare = resolve_model(None, "deberta", "classification", cls_tok, SEQ, 2).config
    assert bare.id2label == {0: "LABEL_0", 1: "LABEL_1"}  # transformers' default where the data has none


def test_dropout_sets_every_dropout_of_the_model_and_its_config(cls_tok):
    import torch

    plain = resolve_model(None, "deberta", "classification", cls_tok, SEQ, 2).full_model(0)
    assert max(m.p for m in plain.modules() if isinstance(m, torch.nn.Dropout)) == 0.1  # HF default (pooler: 0)
    spec = resolve_model(None, "deberta", "classification", cls_tok, SEQ, 2, dropout=0.0)
    off = spec.full_model(0)
    assert {m.p for m in off.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    assert spec.config.hidden_dropout_prob == spec.config.attention_probs_dropout_prob == 0.0
    off.train()
    x = torch.randint(0, 50, (2, SEQ))
    assert torch.equal(off(input_ids=x).logits, off(input_ids=x).logits)  # no mask drawn: two passes agree
    plain.train()
    assert not torch.equal(plain(input_ids=x).logits, plain(input_ids=x).logits)


# ----------------------------------------------------------------------------- naming other columns

@pytest.mark.parametrize("suffix", FORMATS)
def test_the_three_column_flags_pick_other_columns(cls_tok, tmp_path, suffix):
    rows = [{"sentence": f"decoy {i}", "label": 0, "review": f"review {i}", "context": f"context {i}",
             "stars": ["bad", "good"][i % 2]} for i in range(12)]
    path = write_table(tmp_path / f"r{suffix}", rows)
    ds = load(path, cls_tok, text_column="review", text_pair_column="context", label_column="stars")
    assert sorted(ds.examples) == sorted((r["review"], r["context"], ["bad", "good"].index(r["stars"]))
                                         for r in rows)
    assert ds.label_names == ["bad", "good"]
    only_label = load(path, cls_tok, label_column="stars")  # the text still found by the layouts
    assert sorted(only_label.examples) == sorted((r["sentence"], None, int(r["stars"] == "good")) for r in rows)
    only_pair = load(path, cls_tok, text_pair_column="context")
    assert sorted(only_pair.examples) == sorted((r["sentence"], r["context"], 0) for r in rows)


def test_causal_lm_tables_take_text_or_the_one_string_column_or_the_flag(cls_tok, tmp_path):
    line = "Gentle rain from heaven upon the place beneath"
    one = write_table(tmp_path / "one.csv", [{"body": f"{line} {i}", "n": i} for i in range(40)])
    assert len(data.lm_dataset(one, cls_tok, 8)) > 0
    two = write_table(tmp_path / "two.jsonl", [{"body": f"{line} {i}", "title": "Portia"} for i in range(40)])
    with pytest.raises(ValueError, match=r"2 string columns \['body', 'title'\].*--text_column"):
        data.lm_dataset(two, cls_tok, 8)
    by_flag = data.lm_dataset(two, cls_tok, 8, text_column="body")
    by_column = data.lm_dataset(one, cls_tok, 8)
    assert by_flag.batch(range(len(by_flag)))["input_ids"].tolist() == \
        by_column.batch(range(len(by_column)))["input_ids"].tolist()


# ----------------------------------------------------------------------------- errors

def test_a_missing_column_names_the_columns_the_layouts_and_the_flags(cls_tok, tmp_path):
    path = write_table(tmp_path / "odd.csv", [{"body": f"b {i}", "headline": f"h {i}", "y": i % 2} for i in range(8)])
    with pytest.raises(ValueError) as err:
        load(path, cls_tok)
    message = str(err.value)
    assert "\n" not in message
    assert "no text column and no label column (columns found: ['body', 'headline', 'y'])" in message
    assert "sentence1+sentence2, question+sentence, question1+question2, premise+hypothesis" in message
    assert "--text_column, --text_pair_column, --label_column" in message
    with pytest.raises(ValueError, match=r"no label column 'stars' \(columns found: \['body', 'headline', 'y'\]\)"
                                         r".*--label_column"):
        load(path, cls_tok, text_column="body", label_column="stars")
    with pytest.raises(ValueError, match=r"no pair column 'context'.*--text_pair_column"):
        load(path, cls_tok, text_column="body", text_pair_column="context", label_column="y")
    with pytest.raises(ValueError, match="name the same column twice"):
        load(path, cls_tok, text_column="body", label_column="body")
    assert len(load(path, cls_tok, text_column="body", text_pair_column="headline", label_column="y")) == 8


# ----------------------------------------------------------------------------- configuration

COLUMN_FLAGS = ("text_column", "text_pair_column", "label_column")


def test_run_config_takes_the_flags_and_the_run_block_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert all(f"--{name}" in build_parser(RunConfig, "t").format_help() for name in COLUMN_FLAGS)
    default = resolve("classification", [], "t")
    columns = ("text_column", "text_pair_column", "label_column")
    assert [getattr(default.data, name) for name in columns] == [None, None, None]
    flags = resolve("classification", ["--text_column", "review", "--text_pair_column", "context",
                                       "--label_column", "stars"], "t")
    assert [getattr(flags.data, name) for name in columns] == ["review", "context", "stars"]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"run": {"text_column": "body", "text_pair_column": "title", "label_column": "y"}}))
    filed = resolve("classification", ["--deepspeed_config", str(config), "--label_column", "stars"], "t")
    assert [getattr(filed.data, name) for name in columns] == ["body", "title", "stars"]  # a run block's, as before
    assert filed.to_dict()["data"]["text_column"] == "body"
    config.write_text(json.dumps({"run": {"text_column": ""}}))
    with pytest.raises(SystemExit) as exit_:
        resolve("classification", ["--deepspeed_config", str(config)], "t")
    assert exit_.value.code == 2 and "text_column='': expected a column name" in capsys.readouterr().err


def test_build_datasets_threads_the_flags_to_both_kinds_of_data(cls_tok, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(data, "fetch_shakespeare", lambda *a, **k: corpus)  # the tokenizer is trained on it
    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    rows = [{"review": f"review number {i} of many", "context": f"context {i}", "stars": ["bad", "good"][i % 2]}
            for i in range(40)]
    path = write_table(tmp_path / "r.csv", rows)
    cfg = resolve("classification", ["--dataset", str(path), "--seq_len", str(SEQ), "--text_column", "review",
                                     "--text_pair_column", "context", "--label_column", "stars"], "t")
    _, train_set, eval_set = trainer.build_datasets(cfg, TASKS["deberta"], world)
    assert train_set.label_names == eval_set.label_names == ["bad", "good"]
    assert {a for a, _, _ in train_set.examples + eval_set.examples} == {r["review"] for r in rows}
    assert all(b == a.replace("review number", "context").replace(" of many", "") for a, b, _ in train_set.examples)
    lm = write_table(tmp_path / "lm.jsonl", [{"body": _speeches(1, seed=i), "title": "x"} for i in range(40)])
    cfg = resolve("causal_lm", ["--dataset", str(lm), "--seq_len", "8", "--text_column", "body"], "t")
    _, lm_train, _ = trainer.build_datasets(cfg, TASKS["gpt2"], world)
    assert len(lm_train) > 0
