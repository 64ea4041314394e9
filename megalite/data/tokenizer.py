"""One tokenizer interface over the three kinds people already use, detected from the file.

    kind            file                                              EOD            BOS prepended
    sentencepiece   a `.model` (ours from tools/train_tokenizer.py,   its eos piece  no
                    or Llama 2's ...)
    hf              a Hugging Face `tokenizer.json` (or a directory   eos_token      as the tokenizer
                    holding one), via the `tokenizers` package                       does (Llama yes)
    tiktoken        a tiktoken encoding file (`cl100k_base.tiktoken`  <|endoftext|>  no
                    ...), via `tiktoken`

The kind is read from the bytes, not the file name: JSON is a `tokenizer.json`, lines of
`<base64> <rank>` are tiktoken, anything else must parse as a SentencePiece model; anything that does
not load is one DataError naming the three kinds. `document_ids` is the one place that decides how a
document is framed for training: `[BOS] + encode(text) + [EOD]` (BOS only when the kind says so or
the caller asks). Each kind's module documents where its special ids come from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from megalite.data.tokenizer_spm import SentencePieceTokenizer, train_tokenizer
from megalite.errors import DataError

__all__ = ["Tokenizer", "detect_kind", "document_ids", "load_tokenizer", "train_tokenizer"]

KINDS = ("sentencepiece", "hf", "tiktoken")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+\r?$")


@runtime_checkable
class Tokenizer(Protocol):
    """What megalite needs from a tokenizer. `decode` drops special tokens (BOS/EOD decode to "")."""

    kind: str
    path: str
    vocab_size: int  # ids are in [0, vocab_size)
    eod_id: int  # appended after every document
    bos_id: int | None
    add_bos: bool  # the kind's convention: prepend bos_id to every document

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _resolve(path: str) -> str:
    """A directory stands for the tokenizer file inside it (an HF model directory, an export)."""
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        tiktoken_files = sorted(f for f in os.listdir(path) if f.endswith(".tiktoken"))
        if tiktoken_files:
            return os.path.join(path, tiktoken_files[0])
    return path


def train_command(path: str) -> str:
    """The tools/train_tokenizer.py command that writes `path`: the kind its name asks for (a `.json` name is a
    Hugging Face tokenizer.json, anything else a SentencePiece `.model`), the prefix that makes that name."""
    if path.endswith(".json"):
        return (f"`python tools/train_tokenizer.py --input corpus.jsonl --json-key text --model-prefix "
                f"{path[:-len('.json')]} --vocab-size 32000 --kind hf` writes {path}")
    prefix = path[:-len(".model")] if path.endswith(".model") else path
    return (f"`python tools/train_tokenizer.py --input corpus.jsonl --json-key text --model-prefix {prefix} "
            f"--vocab-size 32000` writes {prefix}.model")


def detect_kind(path: str) -> str:
    """'hf', 'tiktoken' or 'sentencepiece', from the first bytes of the file."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.lstrip()[:1] == b"{":
        return "hf"
    first_line = head.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return "tiktoken"
    return "sentencepiece"


def load_tokenizer(path: str) -> Tokenizer:
    """Load any supported tokenizer file; a missing, unreadable or unknown file is one DataError."""
    path = _resolve(str(path))
    if not os.path.isfile(path):
        raise DataError(f"tokenizer not found: {path!r}; pass a SentencePiece .model, a Hugging Face "
                        f"tokenizer.json or a tiktoken encoding file (or train one: {train_command(path)})")
    try:
        kind = detect_kind(path)
    except OSError as e:
        raise DataError(f"cannot read tokenizer {path!r}: {e.strerror or e}") from e
    if kind == "hf":
        from megalite.data.tokenizer_hf import HFTokenizer

        return HFTokenizer(path)
    if kind == "tiktoken":
        from megalite.data.tokenizer_tiktoken import TiktokenTokenizer

        return TiktokenTokenizer(path)
    try:
        return SentencePieceTokenizer.load(path)
    except DataError as e:
        raise DataError(f"cannot read tokenizer {path!r}: it is not a SentencePiece .model, a Hugging Face "
                        "tokenizer.json or a tiktoken encoding file") from e


def document_ids(tok: Tokenizer, text: str, add_bos: bool | None = None) -> list[int]:
    """The ids a document contributes to a training stream: [BOS] + encode(text) + [EOD].

    `add_bos` None follows the tokenizer's convention (`tok.add_bos`); True without a BOS token is an error.
    """
    bos = tok.add_bos if add_bos is None else add_bos
    if bos and tok.bos_id is None:
        raise DataError(f"tokenizer {tok.path!r} ({tok.kind}) has no BOS token to prepend: drop --add-bos")
    return ([tok.bos_id] if bos and tok.bos_id is not None else []) + tok.encode(text) + [tok.eod_id]
