"""A tiktoken encoding file (`cl100k_base.tiktoken`, `o200k_base.tiktoken`, or one you wrote) through `tiktoken`.

The file holds only the mergeable ranks, one `<base64 bytes> <rank>` per line; the pre-tokenization
regex and the special tokens are not in it. They come from tiktoken's own definition of the encoding
named by the file (`cl100k_base.tiktoken` -> tiktoken's cl100k_base: its pattern, `<|endoftext|>` =
100257, ...); a file of any other name gets cl100k's pattern and one special token, `<|endoftext|>`,
right after the last rank. We read the file ourselves (tiktoken's loader caches by path, so an edited
file at the same path could be served stale).

EOD = `<|endoftext|>`; there is no BOS (the GPT/cl100k/o200k convention). Text is encoded with
`encode_ordinary`: special-token text inside a document is ordinary text, never a forged EOD.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence
from typing import Any
from unittest import mock

from megalite.errors import DataError

ENDOFTEXT = "<|endoftext|>"
SUFFIXES = (".tiktoken",)


MAX_RANK = 2**32 - 1  # ids are stored as uint32 (megalite/data/indexed.py)


def read_ranks(path: str) -> dict[bytes, int]:
    """The `<base64> <rank>` lines of a tiktoken file, checked as tiktoken itself does not (it would fail
    later, inside its Rust code): a malformed line, a rank that is negative, >= 2^32 or given twice, a token
    listed twice, or a missing single byte (tiktoken panics on text holding it) is a DataError naming it."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> the line that gave it
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_text, rank_text = line.split()
                token, rank = base64.b64decode(token_text, validate=True), int(rank_text)
            except (ValueError, binascii.Error) as e:
                raise DataError(f"{path!r} line {number} is not `<base64 token> <rank>` ({e}): not a tiktoken "
                                "encoding file") from e
            if not 0 <= rank <= MAX_RANK:
                raise DataError(f"{path!r} line {number}: rank {rank} is outside [0, 2^32): fix the file")
            if not token:
                raise DataError(f"{path!r} line {number}: the token is empty: fix the file")
            if rank in seen:
                raise DataError(f"{path!r} line {number}: rank {rank} is given twice (also line {seen[rank]}): "
                                "every token needs its own rank")
            if token in ranks:
                raise DataError(f"{path!r} line {number}: token {token!r} is listed twice: fix the file")
            ranks[token] = rank
            seen[rank] = number
    if not ranks:
        raise DataError(f"{path!r} is empty: not a tiktoken encoding file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"{path!r} lacks {len(missing)} of the 256 single-byte tokens (first: byte {missing[0]}): "
                        "a tiktoken file needs every byte to encode any text")
    return ranks


def _encoding_spec(name: str, ranks: dict[bytes, int]) -> dict[str, Any]:
    """tiktoken's definition (pattern, special tokens) of encoding `name`, built on `ranks` (no download:
    the constructor's loader is handed the ranks we read instead of fetching its URL)."""
    from tiktoken_ext import openai_public  # type: ignore[import-untyped]

    constructor = openai_public.ENCODING_CONSTRUCTORS.get(name)
    known = constructor is not None
    with mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: ranks):
        spec = dict((constructor or openai_public.ENCODING_CONSTRUCTORS["cl100k_base"])())
    if not known:
        spec["name"] = name
        spec["special_tokens"] = {ENDOFTEXT: max(ranks.values()) + 1}
    return spec


class TiktokenTokenizer:
    """A `tiktoken.Encoding` over a local encoding file (the `Tokenizer` protocol)."""

    kind = "tiktoken"

    def __init__(self, path: str) -> None:
        import tiktoken

        self.path = path
        stem = os.path.basename(path)
        for suffix in SUFFIXES:
            stem = stem.removesuffix(suffix)
        ranks = read_ranks(path)
        spec = _encoding_spec(stem, ranks)
        try:
            self.encoding = tiktoken.Encoding(spec["name"], pat_str=spec["pat_str"], mergeable_ranks=ranks,
                                              special_tokens=spec["special_tokens"])
        except ValueError as e:
            raise DataError(f"cannot build a tiktoken encoding from {path!r} ({e})") from e
        self.pattern: str = spec["pat_str"]
        self.special_tokens: dict[str, int] = dict(spec["special_tokens"])
        self.vocab_size: int = self.encoding.n_vocab
        if ENDOFTEXT not in self.special_tokens:
            raise DataError(f"tiktoken encoding {stem!r} has no {ENDOFTEXT} token to end documents with")
        self.eod_id: int = self.special_tokens[ENDOFTEXT]
        self.bos_id: int | None = None
        self.add_bos = False

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text is encoded as ordinary text."""
        return list(self.encoding.encode_ordinary(text))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens decode to nothing, as in the other kinds. Invalid UTF-8
        (a partial character at the end of a prefix) becomes U+FFFD."""
        ordinary = [int(i) for i in ids if int(i) not in self.special_tokens.values()]
        return self.encoding.decode(ordinary, errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"
