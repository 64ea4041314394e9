"""The tokenizer half of a Hugging Face export: `tokenizer.json` + `tokenizer_config.json` that
`AutoTokenizer.from_pretrained(out)` loads as a fast tokenizer giving megalite's ids.

  hf        the `tokenizer.json` is copied as is; the config names its EOD/BOS (as megalite resolved them)
  tiktoken  the ranks become a byte-level BPE (`transformers`' TikTokenConverter: merges recovered from the
            ranks, tiktoken's split regex as a pre-tokenizer); special tokens get their tiktoken ids, gaps
            between them filled with reserved placeholders so that every id stays where tiktoken puts it
  sentencepiece  not converted (SentencePiece's whitespace and merge rules have no exact `tokenizers`
            equivalent for megalite's identity-normalised models): refused with a clear line

`add_special_tokens=True` (AutoTokenizer's default) prepends BOS exactly when megalite's tokenizer does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from megalite.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["export_tokenizer", "load_tokenizer"]
from megalite.errors import CheckpointError


def _tiktoken_to_json(tok: Any, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from megalite.data.tokenizer_tiktoken import read_ranks

    ranks = read_ranks(tok.path)

    class _FromRanks(TikTokenConverter):  # type: ignore[misc]
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:  # the ranks we read, not a URL
            return ranks

    backend = _FromRanks(vocab_file=tok.path, pattern=tok.pattern).converted()
    by_id = {i: text for text, i in tok.special_tokens.items()}
    for i in range(backend.get_vocab_size(with_added_tokens=True), max(by_id) + 1):
        backend.add_special_tokens([AddedToken(by_id.get(i, f"<|reserved_{i}|>"), normalized=False, special=True)])
    for text, i in tok.special_tokens.items():
        if backend.token_to_id(text) != i:
            raise CheckpointError(f"cannot place tiktoken special token {text!r} at id {i} in tokenizer.json "
                                  "(its ranks are not dense)")
    backend.save(str(out / "tokenizer.json"))


def export_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write `out/tokenizer.json` and `out/tokenizer_config.json` for `tok` (from `load_tokenizer`)."""
    if tok.kind == "hf":
        shutil.copyfile(tok.path, out / "tokenizer.json")
        eod_text, bos_text = tok.eod_text, tok.bos_text  # type: ignore[attr-defined]
    elif tok.kind == "tiktoken":
        _tiktoken_to_json(tok, out)
        eod_text, bos_text = "<|endoftext|>", None
    else:
        raise CheckpointError(f"--tokenizer {tok.path}: exporting a SentencePiece model to transformers is not "
                              "supported; train or pick a Hugging Face tokenizer.json (or a tiktoken file) to "
                              "get a tokenizer AutoTokenizer loads, or copy the .model and load it yourself")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_text,
                              "bos_token": bos_text if tok.add_bos else None, "add_bos_token": tok.add_bos,
                              "add_eos_token": False, "clean_up_tokenization_spaces": False,
                              "model_max_length": None}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2))
