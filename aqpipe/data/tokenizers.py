"""A model's own tokenizer when one can be had, else a byte-level BPE trained on the corpus (4096 tokens by
default: tiny models stay fast on 2 CPU cores, where GPT-2's 50257-token head would dominate), cached on disk."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:  # transformers and datasets take seconds to import: only where used
    import tokenizers
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .cache import atomic_write, cache_root, sha256_hex
from .corpus import fetch_shakespeare

log = logging.getLogger(__name__)

EOS, PAD, UNK, CLS, SEP, MASK = "<|endoftext|>", "<pad>", "<unk>", "<cls>", "<sep>", "<mask>"
SPECIAL_TOKENS = (EOS, PAD, UNK, CLS, SEP, MASK)  # ids 0..5 in a trained tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "spm.model", "tokenizer.model", "sentencepiece.bpe.model")
_TOKENIZER_FORMAT = 1  # bump when the training recipe changes: old cache entries stop matching


def load_tokenizer(model_name_or_path: str | None, corpus_path: str | Path | None = None,
                   vocab_size: int = 4096, *, cls_sep: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer for a model: its own if it has one, else a BPE trained on the corpus.

    `model_name_or_path`: a directory with tokenizer files (loaded with AutoTokenizer), a hub name
    (tried; offline it fails and we fall back with a warning), or None. A directory without
    tokenizer files also falls back. The fallback trains a byte-level BPE of `vocab_size` tokens
    on `corpus_path` (default: the Shakespeare corpus), cached by corpus digest and size.
    `cls_sep=True` makes the trained one frame inputs as `<cls> A <sep> [B <sep>]` with
    token_type_ids, as DeBERTa/BERT-style classifiers expect; without it nothing is added (GPT-2
    style). A pretrained tokenizer keeps its own framing.
    A pretrained tokenizer without a pad token gets its eos token as pad.
    """
    if model_name_or_path:
        pretrained = _pretrained_tokenizer(str(model_name_or_path))
        if pretrained is not None:
            if pretrained.pad_token is None and pretrained.eos_token is not None:
                pretrained.pad_token = pretrained.eos_token
            return pretrained
    corpus = Path(corpus_path).expanduser() if corpus_path is not None else fetch_shakespeare()
    return wrap_tokenizer(trained_bpe(corpus, vocab_size), cls_sep=cls_sep)


def _pretrained_tokenizer(name: str) -> PreTrainedTokenizerBase | None:
    """AutoTokenizer for a local directory or hub name; None where we should train our own."""
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.is_dir():
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(path))
        log.info("%s has no tokenizer files (%s): training a BPE on the corpus", path, ", ".join(_TOKENIZER_FILES))
        return None
    if path.exists():
        raise ValueError(f"model_name_or_path={name!r} is a file: expected a model directory or a hub name")
    if name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"model_name_or_path={name!r}: no such directory (expected a model "
                                "directory with tokenizer files, or a hub name)")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        log.warning("could not load the tokenizer of %r (%s); training a byte-level BPE on the corpus "
                    "instead", name, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def trained_bpe(corpus: Path, vocab_size: int = 4096) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on `corpus`, from the cache when the same one was trained before."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= minimum:
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int above {minimum} "
                         "(the 256 byte symbols and the special tokens, plus merges)")
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus_path={str(corpus)!r}: no such file (expected a plain-text corpus)")
    from tokenizers import Tokenizer

    digest = sha256_hex(corpus.read_bytes())[:16]
    cached = cache_root() / "tokenizers" / f"bpe-v{_TOKENIZER_FORMAT}-{vocab_size}-{digest}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    tok = _train_bpe(corpus, vocab_size)
    atomic_write(cached, tok.to_str().encode("utf-8"))
    return tok


def _train_bpe(corpus: Path, vocab_size: int) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if corpus.stat().st_size == 0:
        raise ValueError(f"corpus_path={str(corpus)!r} is empty: expected text to train a tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    return tok


def wrap_tokenizer(tok: tokenizers.Tokenizer, *, cls_sep: bool = False) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a trained `tokenizers.Tokenizer`, special tokens named."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tok.to_str())  # a copy: the template below must not leak into the cache
    names = ["input_ids", "attention_mask"]
    if cls_sep:
        cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
            special_tokens=[(CLS, cls_id), (SEP, sep_id)])
        names = ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=names, eos_token=EOS, bos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, cls_token=CLS, sep_token=SEP, mask_token=MASK)


