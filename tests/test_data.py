"""Tests of megalite.data and tools/{train_tokenizer,preprocess_data}.py on tiny corpora written to tmp dirs.

All comparisons here are exact (token ids, bytes, sample indices): nothing in the data pipeline is
floating point except blend weights, whose tolerance is explained where it is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from megalite.data import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetWriter, Tokenizer,
                           build_data, load_tokenizer, prepare_demo_data, preprocess, split_documents,
                           train_tokenizer)
from megalite.data.indexed import HEADER_SIZE
from megalite.data.preprocess import ReadOptions
from megalite.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import preprocess_data as preprocess_tool  # noqa: E402
import train_tokenizer as train_tool  # noqa: E402

TRICKY = [
    "def f(x):\n\treturn  x  +  1\n",
    "  leading and trailing spaces   ",
    "\n\n\nblank lines\n\n",
    "windows\r\nline endings\r\n",
    "unicode: naïve café, 日本語, Ελληνικά, emoji 🎉🚀, combining e\u0301",
    "literal specials: </s> <s> <unk> <pad> ▁ \u2581",
    "digits 1234567890 and 3.14159e-10",
    "tabs\t\tand\tmixed \t whitespace",
    "x" * 3000,
    "",
    " ",
    "\n",
]

CORPUS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    for a in argv:\n        print(a)\n    return 0\n",
    "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Numbers: 12 345 6789.\tTabs\tand  double  spaces.\n" * 3,
    "Ünïcödé text: café, naïve, 東京, Москва.\n",
]


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(CORPUS * 4):  # repeated so that BPE has merges to learn
        (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def tokenizer_path(corpus_dir: Path) -> str:
    files = sorted(str(p) for p in corpus_dir.glob("*.txt"))
    return train_tokenizer(files, str(corpus_dir / "tok"), vocab_size=400)


@pytest.fixture(scope="session")
def tok(tokenizer_path: str) -> Tokenizer:
    return load_tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo_cache")


DEMO_BYTES, DEMO_VOCAB = 200_000, 512


@pytest.fixture(scope="session")
def demo(demo_dir: Path) -> tuple[str, str]:
    return prepare_demo_data(str(demo_dir), DEMO_BYTES, DEMO_VOCAB)


def write_dataset(prefix: Path, docs: list[list[int]], vocab_size: int = 1000) -> IndexedDataset:
    w = IndexedDatasetWriter(str(prefix), vocab_size)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return IndexedDataset(str(prefix))


# ---------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_exact(tok: Tokenizer) -> None:
    assert (tok.vocab_size, tok.eod_id) == (400, 2)
    for text in TRICKY:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, repr(text)
    # Newlines and indentation are learned pieces, not byte fallbacks.
    pieces = {tok.processor.id_to_piece(i) for i in tok.encode("def main(argv):\n    return 0\n")}
    assert not any(p.startswith("<0x0A") for p in pieces)
    assert tok.processor.unk_id() == 0 and tok.processor.bos_id() == 1 and tok.processor.pad_id() == -1


def test_tokenizer_training_deterministic_and_errors(corpus_dir: Path, tokenizer_path: str,
                                                     tmp_path: Path) -> None:
    files = sorted(str(p) for p in corpus_dir.glob("*.txt"))
    again = train_tokenizer(files, str(tmp_path / "tok2"), vocab_size=400)
    assert Path(again).read_bytes() == Path(tokenizer_path).read_bytes()
    with pytest.raises(DataError, match="not found.*train_tokenizer"):
        load_tokenizer(str(tmp_path / "nope.model"))
    with pytest.raises(DataError, match="Vocabulary size too high"):
        train_tokenizer(files[:1], str(tmp_path / "big"), vocab_size=100_000)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        load_tokenizer(str(bad))


# --------------------------------------------------------------------------------------------- preprocess
def test_preprocess_round_trip_and_workers(tmp_path: Path, tokenizer_path: str, tok: Tokenizer) -> None:
    docs = [t for t in TRICKY if t] + CORPUS
    files = []
    for i, text in enumerate(docs):
        p = tmp_path / f"in{i:02d}.txt"
        p.write_bytes(text.encode("utf-8"))  # bytes: keep \r\n as written... read back as \n (universal newlines)
        files.append(str(p))
    expected = [t.replace("\r\n", "\n") for t in docs]
    prefix = preprocess(files, tokenizer_path, str(tmp_path / "w1"), show_progress=False)
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert len(ds) == len(expected)
    lengths = [len(tok.encode(t)) + 1 for t in expected]
    assert ds.doc_lengths.tolist() == lengths
    assert ds.offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert ds.num_tokens == sum(lengths) and ds.dtype is np.uint16
    for i, text in enumerate(expected):
        doc = ds[i]
        assert doc[-1] == tok.eod_id
        assert tok.decode(doc[:-1].tolist()) == text
    prefix2 = preprocess(files, tokenizer_path, str(tmp_path / "w2"), workers=2, show_progress=False)
    for ext in (".bin", ".idx"):
        assert Path(prefix + ext).read_bytes() == Path(prefix2 + ext).read_bytes()


def test_preprocess_jsonl_and_paragraphs(tmp_path: Path, tokenizer_path: str, tok: Tokenizer) -> None:
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(CORPUS)) + "\n\n")
    # One process: JSON lines are read in the parent whatever the worker count (the pool path is
    # test_preprocess_round_trip_and_workers'; its error path is the json_key="body" case below).
    ds = IndexedDataset(preprocess([str(jl)], tokenizer_path, str(tmp_path / "j"), ReadOptions(json_key="text"),
                                   show_progress=False))
    assert [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == CORPUS
    para = tmp_path / "p.txt"
    para.write_text("first para\nline two\n\n  indented second\n \t\n\n\nthird\n")
    ds = IndexedDataset(preprocess([str(para)], tokenizer_path, str(tmp_path / "p"), ReadOptions(split_paragraphs=True),
                                   show_progress=False))
    assert [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == \
        ["first para\nline two", "  indented second", "third"]
    with pytest.raises(DataError, match="pass --json-key"):
        preprocess([str(jl)], tokenizer_path, str(tmp_path / "x"), show_progress=False)
    with pytest.raises(DataError, match=r"c\.jsonl:1: no key 'body'"):
        preprocess([str(jl)], tokenizer_path, str(tmp_path / "x"), ReadOptions(json_key="body"), workers=2,
                   show_progress=False)
    assert not list(tmp_path.glob("x.*")), "a failed run must leave no output or temp files"


def test_cli_tools(tmp_path: Path, corpus_dir: Path, tokenizer_path: str,
                   capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.txt")
    # As a script from the repo root (sys.path insertion), in the background while we test in-process.
    proc = subprocess.Popen([sys.executable, "tools/preprocess_data.py", "--input", missing, "--tokenizer",
                             tokenizer_path, "--output-prefix", str(tmp_path / "o")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert preprocess_tool.main(["--input", missing, "--tokenizer", tokenizer_path, "--output-prefix",
                                 str(tmp_path / "o")]) == DataError.exit_code
    assert train_tool.main(["--input", missing, "--model-prefix", str(tmp_path / "t"), "--vocab-size",
                            "400"]) == DataError.exit_code
    assert preprocess_tool.main(["--input", str(corpus_dir / "doc00.txt"), "--tokenizer",
                                 str(tmp_path / "no.model"), "--output-prefix", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "missing.txt" in err[0] and "missing.txt" in err[1] and "no.model" in err[2]
    # Success path of both tools.
    assert train_tool.main(["--input", str(corpus_dir / "doc00.txt"), str(corpus_dir / "doc01.txt"),
                            "--model-prefix", str(tmp_path / "t"), "--vocab-size", "300"]) == 0
    # --workers 1: the default (one per core) would start a spawn pool, each worker importing torch; the
    # pool path is test_preprocess_round_trip_and_workers'.
    assert preprocess_tool.main(["--input", str(corpus_dir / "doc00.txt"), "--tokenizer", tokenizer_path,
                                 "--output-prefix", str(tmp_path / "o"), "--quiet", "--workers", "1"]) == 0
    assert len(IndexedDataset(str(tmp_path / "o"))) == 1
    out, err_text = proc.communicate()  # pytest's own timeout guards a hang
    assert proc.returncode == DataError.exit_code
    assert err_text.strip().count("\n") == 0 and "Traceback" not in err_text and "missing.txt" in err_text


# ------------------------------------------------------------------------------------------ indexed files
def test_indexed_dataset_reads(tmp_path: Path) -> None:
    docs = [[5, 6, 7], [], [8], [9, 10, 11, 12]]
    ds = write_dataset(tmp_path / "d", docs)
    assert len(ds) == 4 and ds.num_tokens == 8 and ds.doc_lengths.tolist() == [3, 0, 1, 4]
    assert [ds[i].tolist() for i in range(4)] == docs
    assert ds.get(3, offset=1, length=2).tolist() == [10, 11] and ds.get(3, 2).tolist() == [11, 12]
    assert ds[-1].tolist() == [9, 10, 11, 12]
    with pytest.raises(IndexError):
        ds[4]
    big = write_dataset(tmp_path / "big", [[70000, 1]], vocab_size=100_000)
    assert big.dtype is np.uint32 and big[0].tolist() == [70000, 1]
    import pickle
    assert pickle.loads(pickle.dumps(ds))[3].tolist() == [9, 10, 11, 12]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_indexed_dataset_errors(tmp_path: Path) -> None:
    write_dataset(tmp_path / "a", [[1, 2, 3], [4, 5]])
    write_dataset(tmp_path / "b", [[1, 2, 3, 4], [5, 6, 7]])
    with pytest.raises(DataError, match=r"not found: .*nothing\.idx.*preprocess_data"):
        IndexedDataset(str(tmp_path / "nothing"))
    (tmp_path / "only.idx").write_bytes((tmp_path / "a.idx").read_bytes())
    with pytest.raises(DataError, match=r"not found: .*only\.bin"):
        IndexedDataset(str(tmp_path / "only"))
    with pytest.raises(DataError, match="no documents"):
        IndexedDatasetWriter(str(tmp_path / "e"), 100).finalize()
    assert not list(tmp_path.glob("e.*"))
    # An index claiming zero documents (e.g. hand-made) is reported as empty.
    hdr = bytearray((tmp_path / "a.idx").read_bytes()[:HEADER_SIZE])
    hdr[16:32] = bytes(16)  # num_docs = num_tokens = 0
    (tmp_path / "z.idx").write_bytes(bytes(hdr) + bytes(8))
    (tmp_path / "z.bin").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        IndexedDataset(str(tmp_path / "z"))
    # Truncated index: header only, or header plus part of the offsets.
    idx = (tmp_path / "a.idx").read_bytes()
    for cut in (10, HEADER_SIZE + 12):
        (tmp_path / "t.idx").write_bytes(idx[:cut])
        (tmp_path / "t.bin").write_bytes((tmp_path / "a.bin").read_bytes())
        with pytest.raises(DataError, match="truncated"):
            IndexedDataset(str(tmp_path / "t"))
    # Mismatched pair: a.idx with b.bin.
    (tmp_path / "m.idx").write_bytes(idx)
    (tmp_path / "m.bin").write_bytes((tmp_path / "b.bin").read_bytes())
    with pytest.raises(DataError, match="holds 7 tokens but .* says 5.*mismatched"):
        IndexedDataset(str(tmp_path / "m"))
    (tmp_path / "g.idx").write_bytes(b"GARBAGE!" + idx[8:])
    (tmp_path / "g.bin").write_bytes((tmp_path / "a.bin").read_bytes())
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(str(tmp_path / "g"))
    (tmp_path / "v.idx").write_bytes(idx[:8] + (9).to_bytes(4, "little") + idx[12:])
    (tmp_path / "v.bin").write_bytes((tmp_path / "a.bin").read_bytes())
    with pytest.raises(DataError, match="format version 9"):
        IndexedDataset(str(tmp_path / "v"))
    with pytest.raises(DataError, match="token id 5 but the tokenizer has only 5 ids"):
        IndexedDataset(str(tmp_path / "a"), vocab_size=5)
    with pytest.raises(DataError, match="outside"):
        IndexedDatasetWriter(str(tmp_path / "w"), 10).add_document([3, 10])


# ------------------------------------------------------------------------------------------ GPT datasets
def test_gpt_dataset_samples_match_hand_built_stream(tmp_path: Path) -> None:
    docs = [[100 + 10 * d + t for t in range(n)] for d, n in enumerate([3, 7, 1, 5, 4, 6])]
    ix = write_dataset(tmp_path / "g", docs)
    chosen = np.array([0, 2, 3, 5])
    S, seed = 3, 7
    ds = GPTDataset(ix, chosen, S, seed)
    order = np.random.default_rng(seed).permutation(chosen).tolist()
    assert sorted(order) == chosen.tolist() and ds.doc_order.tolist() == order
    stream: list[int] = sum((docs[d] for d in order), [])  # 3 + 1 + 5 + 6 = 15 tokens
    assert len(ds) == (15 - 1) // S == 4
    for i in range(len(ds)):
        x = ds[i]
        assert x.dtype == np.int64 and x.tolist() == stream[i * S: i * S + S + 1]
        if i:
            assert ds[i - 1][-1] == x[0]  # consecutive samples overlap by exactly one token
    assert GPTDataset(ix, chosen, S, seed + 1).doc_order.tolist() != order or len(chosen) < 2
    with pytest.raises(DataError, match="has 15 tokens, but one sample of model.seq_len=15 needs 16"):
        GPTDataset(ix, chosen, 15, seed)
    assert len(GPTDataset(ix, chosen, 14, seed)) == 1


class _Fake:
    """A dataset of n samples whose sample i is [tag, i]: enough to check a blend's bookkeeping."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        assert 0 <= i < self.n
        return np.array([self.tag, i])


def test_blended_dataset_proportions() -> None:
    parts = [_Fake(0, 50), _Fake(1, 30), _Fake(2, 20)]
    weights = [0.2, 0.5, 0.3]
    bl = BlendedDataset(parts, weights)  # type: ignore[arg-type]
    assert len(bl) == 100
    which = np.array([bl[j][0] for j in range(len(bl))])
    # The greedy rule keeps every prefix within one sample of its target count (float weights: the
    # bound is exactly 1 in exact arithmetic, 1 + 1e-9 absorbs round-off in w*(j+1)).
    for k in range(3):
        counts = np.cumsum(which == k)
        assert np.all(np.abs(counts - weights[k] * np.arange(1, 101)) <= 1 + 1e-9)
    # Member counters wrap: dataset 1 gets 50 samples from 30 -> indices 0..29 then 0..19.
    local = [bl[j][1] for j in range(len(bl)) if which[j] == 1]
    assert local == list(range(30)) + list(range(20))
    again = BlendedDataset(parts, weights)  # type: ignore[arg-type]
    assert np.array_equal(again.dataset_index, bl.dataset_index)  # deterministic
    assert which[:10].tolist() == [1, 2, 0, 1, 1, 2, 1, 0, 2, 1]  # worked by hand from the greedy rule
    with pytest.raises(ConfigError, match="one weight per dataset"):
        BlendedDataset(parts, [1.0])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=">= 0"):
        BlendedDataset(parts, [1.0, -1.0, 1.0])  # type: ignore[arg-type]


def test_split_documents() -> None:
    tr, va = split_documents(100, 0.1, seed=3)
    tr2, va2 = split_documents(100, 0.1, seed=3)
    assert tr.tolist() == tr2.tolist() and va.tolist() == va2.tolist()
    assert len(va) == 10 and sorted(tr.tolist() + va.tolist()) == list(range(100))
    assert split_documents(100, 0.1, seed=4)[1].tolist() != va.tolist()
    assert len(split_documents(2, 0.01, 0)[1]) == 1 and len(split_documents(2, 0.99, 0)[0]) == 1
    tr, va = split_documents(5, 0.0, 0)
    assert tr.tolist() == list(range(5)) and va.size == 0
    with pytest.raises(DataError, match="valid_fraction=0"):
        split_documents(1, 0.1, 0)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        split_documents(10, 1.0, 0)


# ----------------------------------------------------------------------------------------- demo / build
def test_demo_deterministic_cached_and_race(demo: tuple[str, str], tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    prefix, model = demo
    tok = load_tokenizer(model)
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert tok.vocab_size == DEMO_VOCAB and len(ds) > 3
    assert tok.decode(ds[0][:-1].tolist()).startswith(('"""', "#", "import", "from", "'''"))
    assert all(ds[i][-1] == tok.eod_id for i in range(len(ds)))
    # Cache reuse: same paths, nothing rebuilt, no note printed.
    mtime = os.path.getmtime(prefix + ".bin")
    capfd.readouterr()
    assert prepare_demo_data(str(Path(prefix).parents[1]), DEMO_BYTES, DEMO_VOCAB) == demo
    assert os.path.getmtime(prefix + ".bin") == mtime and "building" not in capfd.readouterr().err
    # A second build elsewhere, by two racing threads: one builds, the other waits; bytes identical.
    results: list[tuple[str, str]] = []
    threads = [threading.Thread(target=lambda: results.append(
        prepare_demo_data(str(tmp_path), DEMO_BYTES, DEMO_VOCAB))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert capfd.readouterr().err.count("building the demo corpus") == 1
    for ext in (".bin", ".idx"):
        assert Path(results[0][0] + ext).read_bytes() == Path(prefix + ext).read_bytes()
    assert Path(results[0][1]).read_bytes() == Path(model).read_bytes()
    assert sorted(os.listdir(tmp_path)) == [Path(results[0][0]).parent.name]  # no lock or temp left


def _cfg(**data: object) -> types.SimpleNamespace:
    d = dict(path=[], weights=[], tokenizer="", valid_fraction=0.1, cache_dir="", demo_max_bytes=DEMO_BYTES,
             demo_vocab_size=DEMO_VOCAB, document_mask=False)
    d.update(data)
    return types.SimpleNamespace(data=types.SimpleNamespace(**d), model=types.SimpleNamespace(seq_len=16),
                                 train=types.SimpleNamespace(seed=1, micro_batch_size=1))


def test_build_data(demo: tuple[str, str], demo_dir: Path, tmp_path: Path) -> None:
    try:
        from megalite.config import Config
        cfg = Config()
        cfg.data.cache_dir, cfg.data.demo_max_bytes, cfg.data.demo_vocab_size = str(demo_dir), DEMO_BYTES, DEMO_VOCAB
        cfg.model.seq_len = 16
    except Exception:  # config not importable yet: the data code only reads attributes
        cfg = _cfg(cache_dir=str(demo_dir))
    b = build_data(cfg)
    assert b.tokenizer.vocab_size == DEMO_VOCAB and b.valid is not None
    assert len(b.train) > len(b.valid) > 0 and b.train[0].shape == (17,)
    # Two datasets blended 3:1, split by documents.
    ix = IndexedDataset(demo[0])
    half = len(ix) // 2
    tokens = [ix[i].tolist() for i in range(len(ix))]
    for name, docs in (("x", tokens[:half]), ("y", tokens[half:])):
        write_dataset(tmp_path / name, docs, vocab_size=DEMO_VOCAB)
    b = build_data(_cfg(path=[str(tmp_path / "x"), str(tmp_path / "y")], weights=[3.0, 1.0],
                        tokenizer=demo[1], valid_fraction=0.0))
    assert isinstance(b.train, BlendedDataset) and b.valid is None
    assert b.train.weights.tolist() == [0.75, 0.25]
    # Data made with a bigger vocabulary than the tokenizer: rejected.
    write_dataset(tmp_path / "big", [[1, 2, 3000] * 10], vocab_size=4000)
    with pytest.raises(DataError, match="token id 3000 but the tokenizer has only 512"):
        build_data(_cfg(path=[str(tmp_path / "big")], tokenizer=demo[1]))
    with pytest.raises(ConfigError, match="data.tokenizer is empty"):
        build_data(_cfg(path=[str(tmp_path / "x")]))


def test_demo_stale_lock_is_taken_over(tmp_path: Path) -> None:
    """A lock left by a crashed process on this host (dead pid) must not block the build forever."""
    import socket

    from megalite.data.demo import _cache_key
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = tmp_path / f"demo-{_cache_key(DEMO_BYTES, DEMO_VOCAB)}.lock"
    lock.write_text(f"{socket.gethostname()} {int(dead.stdout)}")
    prefix, _ = prepare_demo_data(str(tmp_path), DEMO_BYTES, DEMO_VOCAB, timeout_s=30)
    assert os.path.isfile(prefix + ".bin") and not lock.exists()


def test_a_file_too_large_to_scan_at_open_is_checked_sample_by_sample(tmp_path: Path) -> None:
    """Beyond the scan-at-open limit nothing is scanned at open; a sample that holds an id above the header's
    max is a DataError naming the file when it is read (never an IndexError in the embedding), and the other
    samples read normally, also in a copy sent to another process (pickled)."""
    import pickle

    writer = IndexedDatasetWriter(str(tmp_path / "big"), 512)
    writer.add_document(list(range(1, 33)))
    writer.add_document([5] * 32)
    writer.finalize()
    raw = bytearray((tmp_path / "big.bin").read_bytes())
    raw[40:42] = (600).to_bytes(2, "little")  # token 20 (uint16 ids): beyond the header's max id 32
    (tmp_path / "big.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="holds token id 600"):
        IndexedDataset(str(tmp_path / "big"), vocab_size=512)  # small enough: scanned at open
    lazy = IndexedDataset(str(tmp_path / "big"), vocab_size=512, scan_at_open_max_bytes=16)
    for ds in (lazy, pickle.loads(pickle.dumps(lazy))):
        samples = GPTDataset(ds, np.arange(2), seq_len=8, seed=0)
        clean, refused = 0, 0
        for i in range(len(samples)):
            try:
                assert samples[i].max() <= 32
                clean += 1
            except DataError as e:
                assert "big.bin' holds token id 600" in str(e)
                refused += 1
        assert clean >= 5 and refused >= 1  # 7 samples of 8 (+1) tokens read tokens 0-56; the bad one in 1-2
