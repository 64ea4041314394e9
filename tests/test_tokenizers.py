"""The three tokenizer kinds (SentencePiece, HF tokenizer.json, tiktoken): detection, exact round trips,
explicit BOS/EOD framing, one-line errors, and uint32 datasets for vocabularies above 65,536. All exact."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from megalite.data import IndexedDataset, Tokenizer, document_ids, load_tokenizer, preprocess, train_tokenizer
from megalite.data.preprocess import ReadOptions
from megalite.data.indexed import HEADER_SIZE, MAGIC
from megalite.errors import DataError
from tests.tokenizer_utils import TEXTS, train_hf_bpe, write_tiktoken
from tools.preprocess_data import main as preprocess_main

pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

ROUND_TRIP = TEXTS + ["", " leading and trailing  ", "tabs\tand\r\nCRLF", "literal <|endoftext|> and </s> text"]


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("toks")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(TEXTS) * 20)
    train_tokenizer([str(corpus)], str(d / "spm"), vocab_size=400)
    train_hf_bpe(d / "gpt2like" / "tokenizer.json")
    train_hf_bpe(d / "llamalike" / "tokenizer.json", llama_style=True)
    write_tiktoken(d / "mini.tiktoken")
    return d


@pytest.mark.parametrize("name,kind,eod,bos_first", [
    ("spm.model", "sentencepiece", "</s>", False), ("gpt2like/tokenizer.json", "hf", "<|endoftext|>", False),
    ("llamalike", "hf", "</s>", True), ("mini.tiktoken", "tiktoken", "<|endoftext|>", False)])
def test_kind_detected_round_trip_and_framing(tokenizers_dir: Path, name: str, kind: str, eod: str,
                                              bos_first: bool) -> None:
    tok = load_tokenizer(str(tokenizers_dir / name))
    assert tok.kind == kind and isinstance(tok, Tokenizer)
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, (kind, text)
        # A document's literal special-token text never becomes the EOD/BOS id.
        assert tok.eod_id not in ids and (tok.bos_id is None or tok.bos_id not in ids)
    doc = document_ids(tok, "hello there")
    assert doc[-1] == tok.eod_id and tok.add_bos == bos_first
    assert (doc[0] == tok.bos_id) == bos_first
    assert doc[int(bos_first):-1] == tok.encode("hello there")
    if kind == "hf":
        vocab = json.loads((tokenizers_dir / name.removesuffix("/tokenizer.json") / "tokenizer.json").read_text())
        assert vocab["added_tokens"][[t["content"] for t in vocab["added_tokens"]].index(eod)]["id"] == tok.eod_id
    if kind == "tiktoken":
        assert tok.eod_id == 256 + 11 and tok.vocab_size == 256 + 11 + 1  # right after the last rank


def test_bos_override_and_config_file(tokenizers_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tokenizers_dir / "gpt2like"))
    with pytest.raises(DataError, match="no BOS token"):
        document_ids(load_tokenizer(str(tokenizers_dir / "mini.tiktoken")), "x", add_bos=True)
    assert document_ids(load_tokenizer(str(tokenizers_dir / "llamalike")), "x", add_bos=False)[0] != 0
    # tokenizer_config.json (what AutoTokenizer reads) decides EOD and BOS when present.
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tokenizers_dir / "llamalike" / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>", "bos_token": None,
                                                          "add_bos_token": False}))
    cfg_tok = load_tokenizer(str(d))
    assert (cfg_tok.eod_id, cfg_tok.add_bos) == (0, False) and tok.eod_id == 0


@pytest.mark.parametrize("content,match", [
    (b"\x00\x01garbage bytes", "not a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken"),
    (b"", "not a SentencePiece"),
    (b'{"not": "a tokenizer"}', "Hugging Face tokenizer.json"),
    (b"aGVsbG8= 0\nnot-base64!! 1\n", "line 2 is not"),
])
def test_wrong_or_unreadable_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
                                              match: str) -> None:
    bad = tmp_path / "tok.bin"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_tokenizer(str(bad))
    inp = tmp_path / "in.txt"
    inp.write_text("hello")
    code = preprocess_main(["--input", str(inp), "--tokenizer", str(bad), "--output-prefix", str(tmp_path / "o"),
                            "--quiet"])
    err = capsys.readouterr().err
    assert code == DataError.exit_code and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(DataError, match="tokenizer not found"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_preprocess_jsonl_with_tokenizer_json(tokenizers_dir: Path, tmp_path: Path) -> None:
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tok_path = str(tokenizers_dir / "llamalike" / "tokenizer.json")
    tok = load_tokenizer(tok_path)
    # One process: a worker encodes through the same load_tokenizer/document_ids, whatever the tokenizer's
    # kind; the pool path (byte-identical output for 1 and 2 workers) is tests/test_data.py's.
    for bos in (None, False):
        prefix = preprocess([str(jsonl)], tok_path, str(tmp_path / f"d{bos}"), ReadOptions(json_key="text"),
                                show_progress=False, add_bos=bos)
        ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
        assert ds.dtype is np.uint16 and len(ds) == len(TEXTS)
        for i, text in enumerate(TEXTS):
            assert ds[i].tolist() == document_ids(tok, text, bos)


def test_large_vocab_is_uint32(tmp_path: Path) -> None:
    path = write_tiktoken(tmp_path / "big.tiktoken", filler=65536)
    tok = load_tokenizer(str(path))
    assert tok.vocab_size == 256 + 65536 + 11 + 1
    text = "the theme is in there; def the()"
    ids = tok.encode(text)
    assert max(ids) > 65535 and tok.decode(ids) == text
    inp = tmp_path / "in.txt"
    inp.write_text(text)
    prefix = preprocess([str(inp)], str(path), str(tmp_path / "big"), show_progress=False)
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert ds.dtype is np.uint32 and ds[0].tolist() == ids + [tok.eod_id]
    assert struct.unpack_from("<I", Path(prefix + ".idx").read_bytes(), 12)[0] == 3  # dtype code recorded


def test_int32_files_of_earlier_megalite_still_load(tmp_path: Path) -> None:
    """Before uint32, vocabularies >= 65,500 were written as int32 (dtype code 2): those files still read."""
    docs = [[70000, 1, 2], [5]]
    tokens = np.asarray([t for d in docs for t in d], dtype="<i4")
    offsets = np.asarray([0, 3, 4], dtype="<i8")
    header = struct.pack("<8sIIQQQq", MAGIC, 1, 2, len(docs), len(tokens), 100_000, 70000)
    assert len(header) == HEADER_SIZE
    (tmp_path / "old.idx").write_bytes(header + offsets.tobytes())
    (tmp_path / "old.bin").write_bytes(tokens.tobytes())
    ds = IndexedDataset(str(tmp_path / "old"))
    assert ds.dtype is np.int32 and [ds[i].tolist() for i in range(2)] == docs


def test_train_tokenizer_tool_hf_kind(tmp_path: Path) -> None:
    from tools.train_tokenizer import main as train_main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 10))
    args = ["--input", str(corpus), "--json-key", "text", "--vocab-size", "320", "--kind", "hf"]
    assert train_main(args + ["--model-prefix", str(tmp_path / "a")]) == 0
    assert train_main(args + ["--model-prefix", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()  # deterministic
    tok = load_tokenizer(str(tmp_path / "a.json"))
    assert (tok.kind, tok.eod_id, tok.add_bos, tok.vocab_size) == ("hf", 0, False, 320)
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert train_main(args[:-2] + ["--kind", "hf", "--model-prefix", str(tmp_path / "c"), "--vocab-size", "10"]) \
        == DataError.exit_code
