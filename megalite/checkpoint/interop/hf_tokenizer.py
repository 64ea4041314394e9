"""The tokenizer half of a Hugging Face export: `tokenizer.json` + `tokenizer_config.json` that
`AutoTokenizer.from_pretrained(out)` loads as a fast tokenizer giving megalite's ids.

  hf        the `tokenizer.json` is copied as is; the config names its EOD/BOS (as megalite resolved them)
  tiktoken  the ranks become a byte-level BPE (`transformers`' TikTokenConverter: merges recovered from the
            ranks, tiktoken's split regex as a pre-tokenizer, translated for the regex engine of `tokenizers`
            (see `onig_pattern`)); special tokens get their tiktoken ids, gaps between them filled with
            reserved placeholders so that every id stays where tiktoken puts it. The result is checked
            against tiktoken on probe texts (digit runs, contractions, whitespace, unicode) before it is written
  sentencepiece  megalite's models (tools/train_tokenizer.py: identity normalisation, no dummy prefix, byte
            fallback) become a `tokenizers` BPE: the pieces keep their ids, every way of splitting a piece
            into two pieces is a merge ranked by the piece's score (SentencePiece BPE merges the highest-
            scoring piece first, `tokenizers` the lowest-ranked merge: the same order), text is cut into
            SentencePiece's "words" (a run of spaces starts one) and spaces become `▁`. The result is
            checked against SentencePiece on probe texts; a model that differs (another normaliser, a
            dummy prefix: Llama 2's) is refused with a clear line. One known difference: a literal `▁`
            (U+2581) in the text, which megalite encodes as its UTF-8 bytes, becomes the space piece.

`add_special_tokens=True` (AutoTokenizer's default) prepends BOS exactly when megalite's tokenizer does.

Special-token text inside a document (a literal "<|endoftext|>" typed in the text) is ordinary text in
megalite, for every kind (a document cannot forge an end of document): the exported config says
`split_special_tokens: true`, so AutoTokenizer encodes it the same way, as ordinary characters. The
special ids still come from `add_special_tokens` framing and from `convert_tokens_to_ids`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from megalite.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["export_tokenizer", "load_tokenizer"]
from megalite.errors import CheckpointError


_INTERVAL = re.compile(r"\{\d+(?:,\d*)?\}")


def _class_end(pattern: str, i: int) -> int:
    """The index just past the character class opening at `pattern[i] == '['` (nested classes, escapes)."""
    j = i + 1
    if pattern[j:j + 1] == "^":
        j += 1
    if pattern[j:j + 1] == "]":  # a leading ']' is a literal
        j += 1
    while j < len(pattern):
        c = pattern[j]
        if c == "\\":
            j = _escape_end(pattern, j)
        elif c == "[":
            j = _class_end(pattern, j)
        elif c == "]":
            return j + 1
        else:
            j += 1
    raise CheckpointError(f"cannot translate the tiktoken pattern {pattern!r}: unclosed character class")


def _escape_end(pattern: str, i: int) -> int:
    """The index just past the escape starting at `pattern[i] == '\\'` (`\\p{L}`, `\\x{..}`, `\\n` ...)."""
    if pattern[i + 1:i + 2] in ("p", "P", "x", "u") and pattern[i + 2:i + 3] == "{":
        return pattern.index("}", i) + 1
    return i + 2


def onig_pattern(pattern: str) -> str:
    """tiktoken's split regex (Rust `fancy-regex` syntax) rewritten for Oniguruma, the engine behind the
    `Split` pre-tokenizer of `tokenizers`, wherever the two read the same text differently:
      * a possessive interval `X{n,m}+` is, in Onig's Ruby syntax, `(?:X{n,m})+` (a repeat of the
        interval: "2024" -> one piece instead of tiktoken's "202", "4"); it becomes the atomic group
        `(?>X{n,m})`, which is what possessive means. (`?+`, `*+`, `++` are possessive in both.)
      * `$` is the end of the text in fancy-regex but the end of any line in Onig: it becomes `\\z`.
    Everything else (classes, `\\p{..}`, `(?i:..)`, look-ahead) reads the same in both engines."""
    out: list[str] = []
    open_groups: list[int] = []  # indices into `out` where each open group starts
    atom = 0  # index into `out` where the last complete atom starts
    i = 0
    while i < len(pattern):
        c = pattern[i]
        interval = _INTERVAL.match(pattern, i) if c == "{" else None
        if c == "\\":
            j = _escape_end(pattern, i)
            atom = len(out)
            out.append(pattern[i:j])
        elif c == "[":
            j = _class_end(pattern, i)
            atom = len(out)
            out.append(pattern[i:j])
        elif c == "(":
            j = i + 1
            open_groups.append(len(out))
            out.append(c)
        elif c == ")":
            j = i + 1
            out.append(c)
            atom = open_groups.pop()
        elif interval is not None:
            j = interval.end()
            if pattern[j:j + 1] == "+":  # possessive interval -> atomic group around atom + interval
                quantified = "".join(out[atom:]) + interval.group()
                del out[atom:]
                out.append(f"(?>{quantified})")
                j += 1
            else:
                out.append(interval.group())
        elif c == "$":
            j = i + 1
            out.append("\\z")
        else:
            j = i + 1
            if c not in "*+?|^":
                atom = len(out)
            out.append(c)
        i = j
    return "".join(out)


# Texts on which an exported tokenizer must give megalite's ids exactly: the constructs whose split rules
# differ between regex engines or tokenizer libraries (digit runs, contractions, whitespace runs at line and
# text ends, unicode letters, marks, digits and spaces).
PROBES = ("def main(argv):\n    return 0\n", "  two  spaces,\ttab\r\n", "digits 1234567 x1.5e-3 2024 12,345 ٣٤٥٦",
          "héllo wörld — 漢字 🙂 ǅungla Ωmega", "\n\n\n    indented\n        more  ", "The quick brown fox. " * 3,
          "I'm, you're, it's, we'll, they've, he'd, DON'T, O'Neil's", "end of text   ", "a\u3000b\u00a0c\u2003d",
          "line one  \nline two   \n\n", "CamelCase HTTPServer foo!!!\n\nbar??\r\n", "x = [1, 2, 3]  # ok")


def _tiktoken_to_json(tok: Any, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from megalite.data.tokenizer_tiktoken import read_ranks

    ranks = read_ranks(tok.path)

    class _FromRanks(TikTokenConverter):  # type: ignore[misc]
        load_tiktoken_bpe = staticmethod(lambda tiktoken_url: ranks)  # the ranks we read, never a URL

    backend = _FromRanks(vocab_file=tok.path, pattern=onig_pattern(tok.pattern)).converted()
    by_id = {i: text for text, i in tok.special_tokens.items()}
    for i in range(backend.get_vocab_size(with_added_tokens=True), max(by_id) + 1):
        backend.add_special_tokens([AddedToken(by_id.get(i, f"<|reserved_{i}|>"), normalized=False, special=True)])
    for text, i in tok.special_tokens.items():
        if backend.token_to_id(text) != i:
            raise CheckpointError(f"cannot place tiktoken special token {text!r} at id {i} in tokenizer.json "
                                  "(its ranks are not dense)")
    _check_probes(backend, tok, "its split pattern has a construct the `tokenizers` regex engine reads otherwise")
    backend.save(str(out / "tokenizer.json"))


def _check_probes(backend: Any, tok: Any, why: str) -> None:
    """Refuse an export whose tokenizer.json would give other ids than megalite's on a probe text."""
    backend.encode_special_tokens = True  # special-token text is ordinary text (`split_special_tokens`)
    for text in PROBES + ("a literal <|endoftext|> and </s> inside",):
        if backend.encode(text, add_special_tokens=False).ids != tok.encode(text):
            raise CheckpointError(f"--tokenizer {tok.path}: the exported tokenizer.json would tokenize {text!r} "
                                  f"differently ({why}): not exported")


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
    _check_probes(backend, tok, "this SentencePiece model normalises text in a way a tokenizer.json does not "
                  "reproduce, e.g. a dummy prefix or NFKC as in Llama 2's; export a model trained by "
                  "tools/train_tokenizer.py or a tokenizer.json")
    backend.save(str(out / "tokenizer.json"))


def export_tokenizer(tok: Tokenizer, out: Path, chat_template: str | None = None) -> None:
    """Write `out/tokenizer.json` and `out/tokenizer_config.json` for `tok` (from `load_tokenizer`). With a
    `chat_template` (an SFT model's) it is written too, and the special tokens are recognised in text
    (`split_special_tokens: false`, as in every Hugging Face chat tokenizer), so `apply_chat_template` gives the
    ids SFT trained on (megalite/data/chat_template.py recognises them in the rendered chat)."""
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
                              "split_special_tokens": chat_template is None,  # special-token text is ordinary text
                              "model_max_length": None, "chat_template": chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2))
