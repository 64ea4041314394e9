"""The tokenizer half of a Hugging Face export: `tokenizer.json` + `tokenizer_config.json` that
`AutoTokenizer.from_pretrained(out)` loads as a fast tokenizer giving megalite's ids.

  hf        the `tokenizer.json` is copied as is; the config names its EOD/BOS (as megalite resolved them)
  tiktoken  the ranks become a byte-level BPE (`transformers`' TikTokenConverter: merges recovered from the
            ranks, tiktoken's split regex as a pre-tokenizer); special tokens get their tiktoken ids, gaps
            between them filled with reserved placeholders so that every id stays where tiktoken puts it
  sentencepiece  megalite's models (tools/train_tokenizer.py: identity normalisation, no dummy prefix, byte
            fallback) become a `tokenizers` BPE: the pieces keep their ids, every way of splitting a piece
            into two pieces is a merge ranked by the piece's score (SentencePiece BPE merges the highest-
            scoring piece first, `tokenizers` the lowest-ranked merge: the same order), text is cut into
            SentencePiece's "words" (a run of spaces starts one) and spaces become `▁`. The result is
            checked against SentencePiece on probe texts; a model that differs (another normaliser, a
            dummy prefix: Llama 2's) is refused with a clear line. One known difference: a literal `▁`
            (U+2581) in the text, which megalite encodes as its UTF-8 bytes, becomes the space piece.

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
        load_tiktoken_bpe = staticmethod(lambda tiktoken_url: ranks)  # the ranks we read, never a URL

    backend = _FromRanks(vocab_file=tok.path, pattern=tok.pattern).converted()
    by_id = {i: text for text, i in tok.special_tokens.items()}
    for i in range(backend.get_vocab_size(with_added_tokens=True), max(by_id) + 1):
        backend.add_special_tokens([AddedToken(by_id.get(i, f"<|reserved_{i}|>"), normalized=False, special=True)])
    for text, i in tok.special_tokens.items():
        if backend.token_to_id(text) != i:
            raise CheckpointError(f"cannot place tiktoken special token {text!r} at id {i} in tokenizer.json "
                                  "(its ranks are not dense)")
    backend.save(str(out / "tokenizer.json"))


# Texts on which a converted SentencePiece model must give SentencePiece's ids exactly.
_PROBES = ("def main(argv):\n    return 0\n", "  two  spaces,\ttab\r\n", "digits 1234567 x1.5e-3",
           "héllo wörld — 漢字 🙂", "\n\n\n    indented\n        more  ", "The quick brown fox. " * 3)


def _sentencepiece_to_json(tok: Any, out: Path) -> None:
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    sp = tok.processor
    n = sp.vocab_size()
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    plain = {p for p, i in vocab.items() if i not in special and not sp.is_byte(i)}
    ranked = []
    for piece in plain:
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in plain and right in plain:
                ranked.append((-sp.get_score(vocab[piece]), vocab[piece], vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=sp.id_to_piece(sp.unk_id()),
                                       byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581+[^\u2581]*|[^\u2581]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    for text in _PROBES:
        if backend.encode(text, add_special_tokens=False).ids != tok.encode(text):
            raise CheckpointError(f"--tokenizer {tok.path}: this SentencePiece model normalises text in a way the "
                                  "exported tokenizer.json would not reproduce (e.g. a dummy prefix or NFKC, as in "
                                  "Llama 2's); export a model trained by tools/train_tokenizer.py or a tokenizer.json")
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
        spm_tok: Any = tok
        _sentencepiece_to_json(spm_tok, out)
        eod_text, bos_text = spm_tok.processor.id_to_piece(tok.eod_id), None
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_text,
                              "bos_token": bos_text if tok.add_bos else None, "add_bos_token": tok.add_bos,
                              "add_eos_token": False, "clean_up_tokenization_spaces": False,
                              "model_max_length": None}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2))
