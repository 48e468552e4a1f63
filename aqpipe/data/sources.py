"""Where a dataset's text comes from: a local text file or table (json, jsonl, csv, parquet), or an HF hub dataset
and its splits; a table's text column."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator


TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


TEXT_SUFFIXES = frozenset({".txt", ".text"})


HUB_DEFAULT_CONFIGS = {"wikitext": "wikitext-2-raw-v1"}


def local_file(source: str | Path) -> Path | None:
    """The local file `source` names; None for a hub name. A missing path is an error."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"{str(source)!r} is a directory: expected a file (.txt, .json, .jsonl, .csv, .parquet)")
    text = str(source)
    if isinstance(source, Path) or text.startswith(("/", "./", "../", "~")) or \
            path.suffix.lower() in TEXT_SUFFIXES | set(TABLE_FORMATS):
        raise FileNotFoundError(f"{text!r}: no such file (expected a local .txt, .json, .jsonl, .csv "
                                "or .parquet file, or a hub dataset name)")
    return None


def load_table(path: Path) -> Any:
    """A local json/csv/parquet file as a `datasets.Dataset`."""
    from datasets import load_dataset

    return load_dataset(TABLE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")


def load_hub(name: str, config: str | None) -> Any:
    """All splits of a hub dataset, or a clear error naming what was asked for."""
    from datasets import load_dataset

    try:
        return load_dataset(name, config)
    except Exception as err:  # offline, unknown name, bad config: all end here, with the cause chained
        raise ValueError(f"could not load dataset {name!r} (config {config!r}) from the HuggingFace hub: "
                         f"{type(err).__name__}: {err}. Expected 'shakespeare', a local .txt, .json, .jsonl, "
                         ".csv or .parquet file, or a reachable hub dataset") from err


def hub_split(splits: Any, split: str, name: str) -> tuple[Any, bool]:
    """Our split from a hub DatasetDict: its train / validation (or test) where present."""
    if split == "train" or set(splits) == {"train"}:
        if "train" not in splits:
            raise ValueError(f"dataset {name!r} has splits {sorted(splits)}: expected a 'train' split")
        return splits["train"], split == "train" and set(splits) != {"train"}
    for candidate in ("validation", "test"):
        if candidate in splits:
            return splits[candidate], True
    raise ValueError(f"dataset {name!r} has splits {sorted(splits)}: expected 'validation' or 'test' for eval")


class ColumnTexts:
    """The non-empty texts of a table's column, read a batch of rows at a time each time it is iterated: a hub
    dataset's Arrow files are memory-mapped, so its texts are never all in memory at once (token_file reads them
    three times: the cache key, the size for the progress bar, the ids)."""

    def __init__(self, table: Any, column: str) -> None:
        self.table, self.column = table, column

    def __iter__(self) -> Iterator[str]:
        for batch in self.table.select_columns([self.column]).iter(batch_size=1024):
            yield from (text for text in batch[self.column] if isinstance(text, str) and text.strip())


def column_texts(table: Any, column: str | None, source: str) -> ColumnTexts:
    """The non-empty texts of `column`; None: 'text', else the table's one string column."""
    columns = table.column_names
    if column is None:
        strings = [name for name in columns if _is_string_column(table, name)]
        column = "text" if "text" in columns else strings[0] if len(strings) == 1 else None
        if column is None:
            raise ValueError(f"{source}: no column 'text' and {len(strings)} string columns {strings} "
                             f"(columns found: {columns}); expected a 'text' column or exactly one string "
                             "column, or name it with --text_column")
    if column not in columns:
        raise ValueError(f"{source}: no column {column!r} (columns found: {columns}); name the text column "
                         "with --text_column")
    return ColumnTexts(table, column)


def _is_string_column(table: Any, name: str) -> bool:
    """Whether a table's column holds text: its feature is a string Value (or, untyped, its values are str)."""
    feature = getattr(table, "features", {}).get(name)
    dtype = getattr(feature, "dtype", None)
    if isinstance(dtype, str) and not hasattr(feature, "names"):
        return dtype in ("string", "large_string")
    values = [v for v in table[:100][name] if v is not None]
    return bool(values) and all(isinstance(v, str) for v in values)
