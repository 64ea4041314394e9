"""The tokenizer half of the HF export, against `transformers.AutoTokenizer`: for every tokenizer kind the
exported tokenizer gives megalite's ids exactly on digit runs, contractions, whitespace runs, unicode and
literal special-token text (ordinary text in both); tiktoken's split regex is translated for the
`tokenizers` regex engine (the untranslated one provably splits "2024" otherwise); and the issue-26 tokenizer
files (empty vocabulary, bad ranks, no byte alphabet) are one DataError each."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from megalite.checkpoint.interop.hf_tokenizer import export_tokenizer, onig_pattern
from megalite.data import load_tokenizer, train_tokenizer
from megalite.errors import DataError
from tests.tokenizer_utils import RICH_MERGES, TEXTS, train_hf_bpe, write_tiktoken

pytest.importorskip("tiktoken")
transformers = pytest.importorskip("transformers")

# Not the exporter's own probe texts: a second, independent set of the constructs that differ.
HARD_TEXTS = [
    "in 2024, 20240101 and 1234567890 (12,345.678) ٣٤٥٦٧ ১২৩৪",
    "it's they're we'll I've don't IT'S WE'LL O'Neil's rock'n'roll",
    "a  b   c    d\t\t e \n\n\n  f   \n ",
    "trailing spaces   ",
    "   leading\r\n\r\n  crlf  ",
    "héllo wörld — ünïcode 漢字 🙂 e\u0301 ǅ Ωmega\u3000wide\u00a0nbsp",
    "literal <|endoftext|> and </s> and <s> typed in a document",
    "<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """Each kind's tokenizer and its export directory (built once: AutoTokenizer loads are the slow part)."""
    d = tmp_path_factory.mktemp("export")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(TEXTS + HARD_TEXTS) * 20)
    sources = {
        "sentencepiece": Path(train_tokenizer([str(corpus)], str(d / "spm"), vocab_size=400)),
        "hf": train_hf_bpe(d / "gpt2like" / "tokenizer.json", texts=TEXTS + HARD_TEXTS),
        "hf-llama": train_hf_bpe(d / "llamalike" / "tokenizer.json", llama_style=True),
        "tiktoken": write_tiktoken(d / "rich.tiktoken", merges=RICH_MERGES),
    }
    result = {}
    for kind, path in sources.items():
        tok = load_tokenizer(str(path))
        out = d / f"out-{kind}"
        out.mkdir()
        export_tokenizer(tok, out)
        result[kind] = (tok, out)
    return result


@pytest.mark.parametrize("kind", ["sentencepiece", "hf", "hf-llama", "tiktoken"])
def test_autotokenizer_gives_megalite_ids(exported: dict[str, tuple[object, Path]], kind: str) -> None:
    tok, out = exported[kind]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in HARD_TEXTS + TEXTS:
        ids = tok.encode(text)  # type: ignore[attr-defined]
        assert hf_tok(text, add_special_tokens=False).input_ids == ids, (kind, text)
        framed = ([tok.bos_id] if tok.add_bos else []) + ids  # type: ignore[attr-defined]
        assert hf_tok(text).input_ids == framed, (kind, text)
    # The rule both follow: a literal special token is ordinary text, never the special id.
    eod = tok.eod_id  # type: ignore[attr-defined]
    assert eod not in hf_tok("x <|endoftext|> </s> y", add_special_tokens=False).input_ids
    assert hf_tok.convert_tokens_to_ids(hf_tok.eos_token) == eod  # the special id itself is still there
    assert json.loads((out / "tokenizer_config.json").read_text())["split_special_tokens"] is True


def test_tiktoken_digit_runs_would_differ_untranslated(exported: dict[str, tuple[object, Path]]) -> None:
    """The test above can fail: with tiktoken's pattern copied as is, "2024" is one piece in `tokenizers`."""
    from tokenizers import Regex, pre_tokenizers

    tok, _ = exported["tiktoken"]
    pattern = tok.pattern  # type: ignore[attr-defined]
    raw = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    fixed = pre_tokenizers.Split(Regex(onig_pattern(pattern)), behavior="isolated")
    assert [p for p, _ in raw.pre_tokenize_str("2024")] == ["2024"]
    assert [p for p, _ in fixed.pre_tokenize_str("2024")] == ["202", "4"]
    assert tok.encode("2024") == [256 + RICH_MERGES.index(b"202"), ord("4")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["r50k_base", "cl100k_base", "o200k_base"])
def test_translated_patterns_split_as_tiktoken(name: str) -> None:
    """OpenAI's real patterns: the translated one splits like the original read by the `regex` module
    (the same semantics as tiktoken's fancy-regex for these patterns)."""
    regex = pytest.importorskip("regex")
    from unittest import mock

    from tiktoken_ext import openai_public
    from tokenizers import Regex, pre_tokenizers

    with mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *a, **k: {}):
        pattern = openai_public.ENCODING_CONSTRUCTORS[name]()["pat_str"]
    split = pre_tokenizers.Split(Regex(onig_pattern(pattern)), behavior="isolated")
    for text in HARD_TEXTS + TEXTS:
        assert [p for p, _ in split.pre_tokenize_str(text)] == regex.findall(pattern, text), (name, text)


def test_onig_pattern_rewrites_only_what_differs() -> None:
    assert onig_pattern(r"\p{N}{1,3}+|[a-z]{2}+|(ab){1,}+") == r"(?>\p{N}{1,3})|(?>[a-z]{2})|(?>(ab){1,})"
    assert onig_pattern(r"\s++$|x{2,3}|[$]\$") == r"\s++\z|x{2,3}|[$]\$"
    assert onig_pattern(r"[^\]\p{L}]?+\p{L}++") == r"[^\]\p{L}]?+\p{L}++"


def _tiktoken_lines(tokens: list[tuple[bytes, int]]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in tokens)


BYTES = [(bytes([b]), b) for b in range(256)]


@pytest.mark.parametrize("lines,message", [
    (BYTES + [(b"ab", 255)], "rank 255 is given twice"),
    (BYTES + [(b"a", 300)], "listed twice"),
    (BYTES[1:] + [(b"ab", 2**32)], "outside [0, 2^32)"),
    (BYTES[:200], "lacks 56 of the 256 single-byte tokens"),
])
def test_bad_tiktoken_file_is_one_data_error(tmp_path: Path, lines: list[tuple[bytes, int]], message: str) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_text(_tiktoken_lines(lines))
    with pytest.raises(DataError, match=re.escape(message)):
        load_tokenizer(str(path))


def test_negative_rank_and_empty_vocab(tmp_path: Path) -> None:
    path = tmp_path / "neg.tiktoken"
    path.write_text(_tiktoken_lines(BYTES) + "YWI= -3\n")
    with pytest.raises(DataError, match="rank -3 is outside"):
        load_tokenizer(str(path))
    from tokenizers import Tokenizer, models

    empty = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(empty))
    with pytest.raises(DataError, match="empty vocabulary"):
        load_tokenizer(str(empty))
