"""Data: tokenizer, `.bin`/`.idx` datasets, GPT samples, blending, the DP sampler and the demo corpus.

`build_data(cfg)` is what pretrain.py calls: it returns the train/valid datasets and the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from megalite.data.demo import default_cache_dir, prepare_demo_data
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, split_documents
from megalite.data.indexed import IndexedDataset, IndexedDatasetWriter
from megalite.data.preprocess import preprocess
from megalite.data.sampler import DataSampler, make_batch
from megalite.data.sources import is_streaming
from megalite.data.tokenizer import Tokenizer, document_ids, load_tokenizer, train_tokenizer
from megalite.errors import ConfigError, DataError

if TYPE_CHECKING:
    from megalite.config.schema import Config

Dataset = Union[GPTDataset, BlendedDataset]

__all__ = [
    "BlendedDataset", "DataBundle", "DataSampler", "Dataset", "GPTDataset", "IndexedDataset",
    "IndexedDatasetWriter", "Tokenizer", "build_data", "default_cache_dir", "document_ids", "load_tokenizer",
    "make_batch", "prepare_demo_data", "preprocess", "split_documents", "train_tokenizer",
]


@dataclass
class DataBundle:
    """What training needs from the data side. `valid` is None when data.valid_fraction == 0. `train` is None
    when data.path holds a raw source: then the data is streamed (megalite/data/loader.py)."""

    train: Dataset | None
    valid: Dataset | None
    tokenizer: Tokenizer


def _blend(parts: list[GPTDataset], weights: list[float]) -> Dataset:
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights)


def build_data(cfg: Config) -> DataBundle:
    """Datasets and tokenizer for `cfg` (reads cfg.data.*, cfg.model.seq_len, cfg.train.seed only).

    Empty `data.path` -> the embedded demo corpus (built once, cached). Several paths -> a blend with
    `data.weights` (default: proportional to each dataset's token count). Each dataset is split into
    train/valid by document with `data.valid_fraction`. A raw source among the paths (jsonl, parquet, a
    datasets directory) -> only the tokenizer (the demo one when data.tokenizer is empty): the trainer
    streams the data (`StreamLoader`).
    """
    data, seq_len, seed = cfg.data, int(cfg.model.seq_len), int(cfg.train.seed)
    paths = list(data.path)
    tokenizer_path = data.tokenizer
    if any(is_streaming(p) for p in paths):
        if not tokenizer_path:
            _, tokenizer_path = prepare_demo_data(data.cache_dir, data.demo_max_bytes, data.demo_vocab_size)
        return DataBundle(train=None, valid=None, tokenizer=load_tokenizer(tokenizer_path))
    if not paths:
        prefix, demo_tokenizer = prepare_demo_data(data.cache_dir, data.demo_max_bytes, data.demo_vocab_size)
        paths = [prefix]
        tokenizer_path = tokenizer_path or demo_tokenizer
    elif not tokenizer_path:
        raise ConfigError("data.path is set but data.tokenizer is empty: pass the tokenizer file (SentencePiece "
                          ".model, tokenizer.json or tiktoken file) that was used to preprocess the data")
    tokenizer = load_tokenizer(tokenizer_path)
    # vocab_size= makes IndexedDataset reject data holding ids the tokenizer does not have.
    indexed = [IndexedDataset(p, vocab_size=tokenizer.vocab_size) for p in paths]
    for ix in indexed:
        # Another vocabulary size means another tokenizer: its ids would be read as other tokens (the
        # range check above only catches ids past the end), so the run is refused, not warned about.
        if ix.vocab_size and ix.vocab_size != tokenizer.vocab_size:
            raise DataError(f"{ix.prefix!r} was preprocessed with a tokenizer of {ix.vocab_size} ids, but "
                            f"data.tokenizer {tokenizer.path!r} has {tokenizer.vocab_size}: pass the tokenizer the "
                            "data was made with, or preprocess it again with this one")
        if data.document_mask:
            ix.check_document_ends(tokenizer.eod_id)
    weights = list(data.weights) or [float(ix.num_tokens) for ix in indexed]
    if len(weights) != len(indexed):
        raise ConfigError(f"data.weights has {len(weights)} entries for {len(indexed)} paths in data.path: give "
                          "one weight per path, or none for size-proportional blending")
    train_parts: list[GPTDataset] = []
    valid_parts: list[GPTDataset] = []
    for ix in indexed:
        train_docs, valid_docs = split_documents(len(ix), float(data.valid_fraction), seed)
        train_parts.append(GPTDataset(ix, train_docs, seq_len, seed, name="train"))
        if len(valid_docs):
            valid_parts.append(GPTDataset(ix, valid_docs, seq_len, seed, name="validation"))
    valid = _blend(valid_parts, weights) if valid_parts else None
    train = _blend(train_parts, weights)
    check_batch_fits(len(train), cfg.train.micro_batch_size, seq_len)
    return DataBundle(train=train, valid=valid, tokenizer=tokenizer)


def check_batch_fits(num_samples: int, micro_batch_size: int, seq_len: int) -> None:
    """A micro-batch must not be larger than the whole training set: every sample would repeat within one
    micro-batch, and a huge value would allocate until the machine runs out of memory."""
    if micro_batch_size > num_samples:
        raise DataError(f"train.micro_batch_size {micro_batch_size} is larger than the whole training set "
                        f"({num_samples} samples of model.seq_len {seq_len} tokens): lower micro_batch_size or "
                        "seq_len, or use more data")
