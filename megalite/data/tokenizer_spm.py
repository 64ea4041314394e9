"""A SentencePiece BPE tokenizer that round-trips any text exactly.

SentencePiece (Kudo & Richardson 2018) trains on "sentences" and by default normalizes text (NFKC),
collapses runs of spaces and adds a dummy leading space, so `decode(encode(x)) != x` for source code or
any text whose whitespace matters. We train it so that the round trip is exact:
  * `normalization_rule_name="identity"`, `remove_extra_whitespaces=False`, `add_dummy_prefix=False`:
    the text is taken as it is, spaces are kept (as the `▁` meta symbol) and nothing is prepended;
  * `byte_fallback=True`: a character not in the vocabulary is encoded as its UTF-8 bytes (`<0x..>`
    pieces, as in Llama), so there is no `<unk>` for unseen unicode;
  * training "sentences" are runs of whole lines *with* their `\\n`, so newlines (and indentation,
    via `allow_whitespace_only_pieces`) are ordinary learnable characters;
  * a literal `▁` (SentencePiece's space symbol) in the text is encoded as byte pieces (see `encode`);
  * `split_digits=True` (numbers tokenized digit by digit, as in PaLM/Llama), `num_threads=1` and no
    input shuffling so that training is deterministic: the same corpus gives the same model bytes.
Special ids: unk=0, bos=1, eos=2 (the end-of-document token), no pad piece. Any other SentencePiece
`.model` loads too (its eos piece is the end-of-document token); see megalite/data/tokenizer.py for the
other tokenizer kinds and the common interface.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from io import BytesIO

import sentencepiece as spm

from megalite.data.documents import Replacements, iter_documents
from megalite.atomic import atomic_output
from megalite.errors import DataError

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_META = "\u2581"  # SentencePiece's whitespace meta symbol
# SentencePiece skips training sentences longer than `max_sentence_length` bytes: we cut chunks below it.
_CHUNK_BYTES = 4096
_MAX_SENTENCE_BYTES = 8192


class SentencePieceTokenizer:
    """A loaded SentencePiece model (the `Tokenizer` protocol of megalite/data/tokenizer.py).

    EOD is the model's eos piece (required); BOS is its bos piece when it has one, and is not prepended
    by default (`add_bos=False`): megalite's own models mark documents by the EOD that follows them.
    """

    kind = "sentencepiece"

    def __init__(self, processor: spm.SentencePieceProcessor, path: str = "") -> None:
        self.processor = processor
        self.path = path
        self.vocab_size: int = processor.vocab_size()
        self.eod_id: int = processor.eos_id()
        self.bos_id: int | None = processor.bos_id() if processor.bos_id() >= 0 else None
        self.add_bos = False
        if self.eod_id < 0:
            raise DataError(f"tokenizer {path!r} has no end-of-sequence piece (eos_id=-1): retrain it with "
                            "tools/train_tokenizer.py, which reserves eos=2")
        meta_ids = [processor.piece_to_id(f"<0x{b:02X}>") for b in _META.encode("utf-8")]
        # Without byte pieces (a model not trained by us) a literal `▁` cannot round-trip anyway.
        self._meta_ids: list[int] | None = meta_ids if all(processor.is_byte(i) for i in meta_ids) else None

    @classmethod
    def load(cls, path: str) -> SentencePieceTokenizer:
        """Load a `.model` file; a missing or unreadable file is a DataError saying how to make one."""
        if not os.path.isfile(path):
            raise DataError(f"tokenizer model not found: {path!r}; train one with `python "
                            "tools/train_tokenizer.py --input FILE... --model-prefix P --vocab-size N` (writes "
                            "P.model), or set data.tokenizer=\"\" to use the demo tokenizer")
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"cannot read tokenizer model {path!r} ({e}): is it a SentencePiece .model file? "
                            "Retrain it with tools/train_tokenizer.py") from e
        return cls(processor, path)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no bos/eos added).

        SentencePiece writes spaces as the meta symbol `▁` (U+2581), so a literal `▁` in the text would
        decode as a space. We encode each literal one as its three UTF-8 byte pieces instead, which
        decode back to the character itself.
        """
        if _META not in text or self._meta_ids is None:
            return list(self.processor.encode(text, out_type=int))
        ids: list[int] = []
        for k, part in enumerate(text.split(_META)):
            if k:
                ids += self._meta_ids
            if part:
                ids += self.processor.encode(part, out_type=int)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of `ids` (control pieces such as eos decode to nothing)."""
        return str(self.processor.decode([int(i) for i in ids]))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _split_long_line(line: str, max_bytes: int) -> Iterator[str]:
    """Cut a line into pieces of at most `max_bytes` UTF-8 bytes, never inside a character."""
    piece: list[str] = []
    size = 0
    for ch in line:
        n = len(ch.encode("utf-8"))
        if size + n > max_bytes and piece:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(ch)
        size += n
    if piece:
        yield "".join(piece)


def training_sentences(documents: Iterator[str], max_bytes: int | None = None,
                       chunk_bytes: int = _CHUNK_BYTES) -> Iterator[str]:
    """Chunks of whole lines (newlines kept) of at most `chunk_bytes`, stopping after `max_bytes` in total."""
    total = 0
    for doc in documents:
        buf: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            for part in _split_long_line(line, chunk_bytes):
                n = len(part.encode("utf-8"))
                if max_bytes is not None and total + n > max_bytes:
                    if buf:
                        yield "".join(buf)
                    return
                if size + n > chunk_bytes and buf:
                    yield "".join(buf)
                    buf, size = [], 0
                buf.append(part)
                size += n
                total += n
        if buf:
            yield "".join(buf)


def train_tokenizer(files: list[str], model_prefix: str, vocab_size: int, json_key: str | None = None,
                    max_bytes: int | None = None, replaced: Replacements | None = None) -> str:
    """Train a byte-fallback BPE SentencePiece model on `files`; returns the written `<model_prefix>.model`.

    `files` are read like preprocessing inputs (one document per text file, or JSON lines with
    `json_key`); `max_bytes` caps the text used (training memory grows with the corpus).
    """
    if vocab_size < 300:
        # 3 special pieces + 256 byte pieces must fit, plus some characters and merges.
        raise DataError(f"vocab_size={vocab_size} is too small: byte fallback alone needs 259 ids; use >= 300")
    sentences = training_sentences(iter_documents(files, json_key, replaced=replaced), max_bytes)
    first = next(sentences, None)
    if first is None:
        raise DataError(f"no text found in {files}: the tokenizer needs a non-empty corpus")

    def all_sentences() -> Iterator[str]:
        yield first
        yield from sentences

    model = BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_sentences(), model_writer=model, model_type="bpe", vocab_size=vocab_size,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
            num_threads=1, shuffle_input_sentence=False, input_sentence_size=0,
            max_sentence_length=_MAX_SENTENCE_BYTES, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            minloglevel=2)
    except RuntimeError as e:
        # SentencePiece's own message says e.g. "Vocabulary size too high (50000). Please set it to a value
        # <= 13461." -- keep it, on one line.
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        # ...but not its advice to pass SentencePiece flags (--character_coverage) that our tool does not have.
        msg = re.sub(r"\s*(?:or )?decrease character_coverage with --character_coverage option\.?", "", msg)
        raise DataError(f"tokenizer training failed: {msg} (adjust --vocab-size or use more text)") from e
    path = model_prefix + ".model"
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with atomic_output(path) as tmp:  # temp name + fsync + rename: a reader never sees half a model
        tmp.write_bytes(model.getvalue())
    return path
