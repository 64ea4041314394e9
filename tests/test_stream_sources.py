"""Raw sources are read whole or refused (megalite/data/readers.py, sources.py, checks.py): a cut compressed
file is an error naming the file and offset, a directory reads every supported kind and names what it skips,
special files are refused before the run, a file rewritten to the same size is named on resume (or read from
its start with data.on_change restart), an all-bad source stops before step 1 with exit 3 and the counts, and a
SIGTERM while the loader waits ends the run at once."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from megalite.data.readers import content_digest, file_kind, lines
from megalite.data.sources import Source
from megalite.errors import DataError
from megalite.training.trainer import main as pretrain_main
from tests.tokenizer_utils import TEXTS, train_hf_bpe

RECORDS = [f"{t} #{i}" for i, t in enumerate(TEXTS * 2)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(train_hf_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _jsonl(records: list[Any], key: str = "text") -> bytes:
    return "".join(json.dumps({key: r}) + "\n" for r in records).encode()


def _zst(raw: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(raw)


def _args(path: str, tok: str, run: Path, *more: str) -> list[str]:
    return ["--data.path", path, "--data.tokenizer", tok, "--data.workers", "0", "--model.seq_len", "16",
            "--model.num_layers", "1", "--model.hidden_size", "32", "--train.global_batch_size", "2",
            "--train.micro_batch_size", "2", "--train.steps", "2", "--train.eval_interval", "0",
            "--logging.interval", "1", "--logging.dir", str(run), *more]


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], code: int, pattern: str) -> str:
    got = pretrain_main(args)
    err = capsys.readouterr().err
    assert got == code, err
    lines_ = [line for line in err.splitlines() if line.startswith("megalite: error")]
    assert len(lines_) == 1 and re.search(pattern, lines_[0]), err
    return lines_[0]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_compressed_file_cut_mid_frame_is_refused_with_its_offset(tmp_path: Path, suffix: str) -> None:
    raw = _jsonl([f"{r} {i}" for i in range(400) for r in RECORDS])  # over 64 KiB: several reads a member
    packed = gzip.compress(raw) if suffix == ".jsonl.gz" else _zst(raw)
    whole = tmp_path / f"whole{suffix}"
    whole.write_bytes(packed + packed)  # two members / frames: both read
    kind = file_kind(str(whole))
    assert kind is not None
    assert b"".join(line for _, line in lines(str(whole), kind)) == raw + raw
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(packed + packed[: len(packed) // 2])  # the second member cut in its middle
    with pytest.raises(DataError, match=rf"'{cut}' is truncated: .* ends at byte {len(packed) + len(packed) // 2} "
                                        "in the middle of a frame"):
        for _ in lines(str(cut), kind):
            pass


def test_a_cut_zst_stops_the_run_with_exit_3(tmp_path: Path, tok: str, capsys: pytest.CaptureFixture[str]) -> None:
    packed = _zst(_jsonl(RECORDS))
    (tmp_path / "cut.jsonl.zst").write_bytes(packed[: len(packed) - 7])
    _refused(_args(str(tmp_path / "cut.jsonl.zst"), tok, tmp_path / "run", "--train.steps", "30"), capsys, 3,
             r"cut\.jsonl\.zst' is truncated")


def test_a_directory_reads_every_kind_and_names_what_it_skips(tmp_path: Path, tok: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    d = tmp_path / "mixed"
    (d / "sub").mkdir(parents=True)
    parts = [RECORDS[i::4] for i in range(4)]
    (d / "a.jsonl").write_bytes(_jsonl(parts[0]))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(parts[1])))
    (d / "c.jsonl.zst").write_bytes(_zst(_jsonl(parts[2])))
    pq.write_table(pa.table({"text": parts[3]}), d / "d.parquet")
    (d / "README.md").write_text("about the data")
    src = Source.open(str(d), "text", 0)
    assert [os.path.basename(f) for f in src.files] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    got = [raw for f in range(4) for _, _, raw in src.records(f, 0, 0)]
    assert [json.loads(r)["text"] if isinstance(r, bytes) else r for r in got] == sum(parts, [])
    assert pretrain_main(_args(str(d), tok, tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert f"data.path {str(d)!r}: read 4 file(s); skipped 2: README.md (not .jsonl, .jsonl.gz, .jsonl.zst or " \
           ".parquet), sub/ (a subdirectory: not read)" in out, out


def _unblock_later(fifo: Path, done: threading.Event) -> None:
    """Only a regression needs this: a reader blocked on `fifo` gets a writer (and so an end of file) once the
    test has waited long, so the test fails instead of hanging the suite."""
    while not done.wait(60):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader has it open: nothing blocked on it
            pass


def test_special_files_are_refused_before_the_run(tmp_path: Path, tok: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO in a data directory, or given itself, or as a .idx, would block the reader forever: refused at
    start, by stat, before anything opens it."""
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(RECORDS))
    os.mkfifo(d / "b.jsonl")
    os.mkfifo(tmp_path / "c.idx")
    (tmp_path / "c.bin").write_bytes(b"")
    done = threading.Event()
    for fifo in (d / "b.jsonl", tmp_path / "c.idx"):
        threading.Thread(target=_unblock_later, args=(fifo, done), daemon=True).start()
    try:
        for path, what in ((d, "b.jsonl"), (d / "b.jsonl", "b.jsonl"), (tmp_path / "c", "c.idx")):
            _refused(_args(str(path), tok, tmp_path / "run"), capsys, 3, rf"{what}' is a FIFO \(named pipe\), not a "
                     "regular file")
    finally:
        done.set()
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


@pytest.mark.parametrize("kind", ["invalid_json", "parquet_without_column", "chat_read_as_text", "many_invalid"])
def test_an_all_bad_source_stops_before_step_1(tmp_path: Path, tok: str, capsys: pytest.CaptureFixture[str],
                                               kind: str) -> None:
    """Every record bad: the limits act as records are read (1,000 records for the share), and a whole epoch
    with no usable record ends a small file: exit 3 with the counts by kind, no step logged."""
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    path = tmp_path / "d.jsonl"
    if kind == "invalid_json":
        path.write_text("{oops\n" * 30)
    elif kind == "many_invalid":
        path.write_text("{oops\n" * 3000)
    elif kind == "chat_read_as_text":
        path.write_bytes(_jsonl([[{"role": "user", "content": "hi"}]] * 30, key="messages"))
    else:
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"body": RECORDS}), path)
    want = {"invalid_json": "invalid_json", "many_invalid": "invalid_json"}.get(kind, "missing_key")
    for more in ([], ["--data.valid_fraction", "0", "--data.max_bad_fraction", "1.0"]):
        line = _refused(_args(str(path), tok, tmp_path / "run", "--train.steps", "50", *more), capsys, 3,
                        rf"\d+ bad \({want} \d+\) of \d+ records")
        assert ("whole epoch" in line) == (kind != "many_invalid" or bool(more)), line
        assert not (tmp_path / "run" / "metrics.jsonl").exists() or '"loss"' not in \
            (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_rewritten_file_is_named_on_resume_or_read_from_its_start(tmp_path: Path, tok: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(RECORDS))
    ck = ["--checkpoint.dir", str(tmp_path / "ck")]
    assert pretrain_main(_args(str(data), tok, tmp_path / "run", *ck)) == 0
    swapped = _jsonl([r.swapcase() for r in RECORDS])
    assert len(swapped) == data.stat().st_size
    data.write_bytes(swapped)  # the same size, other text
    capsys.readouterr()
    _refused(_args(str(data), tok, tmp_path / "run", *ck, "--train.steps", "4"), capsys, 3,
             rf"the data changed since the checkpoint \('{data}': 'd.jsonl' was rewritten since the checkpoint "
             r"\(same size, other content\)\).*--data.on_change restart")
    assert pretrain_main(_args(str(data), tok, tmp_path / "run", *ck, "--train.steps", "4", "--data.on_change",
                               "restart")) == 0
    out = capsys.readouterr().out
    assert "data.on_change restart: reading the data from its start" in out and "step     4/4" in out, out


def test_content_digest_sees_same_size_edits(tmp_path: Path) -> None:
    f = tmp_path / "big.jsonl"
    body = bytearray(os.urandom(3 << 20))  # over the whole-file bound: sampled blocks (first and last included)
    f.write_bytes(body)
    before = content_digest([str(f)])
    body[-1] ^= 1
    f.write_bytes(body)
    assert content_digest([str(f)]) != before
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"a" * 1000)
    first = content_digest([str(small)])
    small.write_bytes(b"a" * 500 + b"b" + b"a" * 499)  # whole-file below 1 MiB: any byte counts
    assert content_digest([str(small)]) != first


def test_chat_flags_on_token_files_are_refused(tmp_path: Path, tok: str, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(_args(str(tmp_path / "c"), tok, tmp_path / "run", "--data.format", "chat"), capsys, 2,
             r"data.format chat with '.*c': a .bin/.idx dataset holds token ids")
    _refused(["--data.format", "chat", "--train.steps", "1"], capsys, 2, r"data.format chat with 'the demo corpus")
    (tmp_path / "d.jsonl").write_bytes(_jsonl(RECORDS))
    _refused(_args(str(tmp_path / "d.jsonl"), tok, tmp_path / "run", "--data.chat_template", "t.jinja"), capsys, 2,
             r"data.chat_template 't.jinja' is set but data.format is 'text'")
    _refused(_args(str(tmp_path / "d.jsonl"), tok, tmp_path / "run", "--data.on_change", "ignore"), capsys, 2,
             r"data.on_change = 'ignore': choose refuse")


def _slow_source(path: Path, good: bytes = b"") -> None:
    """`good` records, then a billion invalid lines in 2 MB of gzip members: with the bad-record limits off, a
    loader reading it makes no sample for much longer than any test runs."""
    member = gzip.compress(b"{\n" * (1 << 19))
    with open(path, "wb") as f:
        if good:
            f.write(gzip.compress(good))
        for _ in range(2000):
            f.write(member)


def _signal_when_loading(signum: int, done: threading.Event) -> None:
    """Send `signum` to this process once the loader thread runs (the loop has asked for step 1's data)."""
    while not done.is_set():
        if any(t.name == "megalite-data" for t in threading.enumerate()):
            os.kill(os.getpid(), signum)
            return
        done.wait(0.05)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_sigterm_while_the_loader_waits_stops_the_run(tmp_path: Path, tok: str, capfd: pytest.CaptureFixture[str],
                                                      workers: str) -> None:
    """The loader never makes step 1 (a slow all-bad source, the limits off); the first SIGTERM ends the wait:
    exit 0, one line, nothing trained, in the loader thread or with a tokenizer worker (the loader stops between
    two records or while waiting for the worker). The signal is sent once the loader thread exists."""
    _slow_source(tmp_path / "slow.jsonl.gz")
    done = threading.Event()
    threading.Thread(target=_signal_when_loading, args=(signal.SIGTERM, done), daemon=True).start()
    try:
        code = pretrain_main(_args(str(tmp_path / "slow.jsonl.gz"), tok, tmp_path / "run", "--data.max_bad_fraction",
                                   "1.0", "--data.valid_fraction", "0", "--data.workers", workers))
    finally:
        done.set()
    out, err = capfd.readouterr()  # the signal handler writes to fd 2 itself (megalite/training/stop.py)
    assert code == 0, err
    assert "stop requested by signal while waiting for data: exiting before step 1" in out, out + err
    assert "SIGTERM: stopping" in err


def test_preprocess_takes_what_streaming_takes(tmp_path: Path, tok: str) -> None:
    """tools/preprocess_data.py reads through the streaming readers: .gz, .zst, parquet and a directory give the
    plain .jsonl's dataset byte for byte; a cut file is refused as streaming refuses it."""
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    from megalite.data.preprocess import ReadOptions, preprocess

    raw = _jsonl(RECORDS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(_zst(raw))
    pq.write_table(pa.table({"text": RECORDS}), tmp_path / "a.parquet")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "1.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS[:5])))
    pq.write_table(pa.table({"text": RECORDS[5:]}), tmp_path / "dir" / "2.parquet")
    read = ReadOptions(json_key="text")

    def bin_of(name: str) -> bytes:
        prefix = preprocess([str(tmp_path / name)], tok, str(tmp_path / "out" / name), read, show_progress=False)
        return Path(prefix + ".bin").read_bytes()

    want = bin_of("a.jsonl")
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.parquet", "dir"):
        assert bin_of(name) == want, name
    (tmp_path / "cut.jsonl.zst").write_bytes(_zst(raw)[:-5])
    with pytest.raises(DataError, match="cut.jsonl.zst' is truncated"):
        bin_of("cut.jsonl.zst")


def test_a_rewritten_token_file_is_named_on_resume(tmp_path: Path, tok: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The `.bin`/`.idx` sampler's position carries the files' digest too: the same documents and tokens, other
    ids, refused on resume (or read from the start with data.on_change restart)."""
    from megalite.data.indexed import IndexedDatasetWriter
    from megalite.data.tokenizer import document_ids, load_tokenizer

    t = load_tokenizer(tok)

    def write(records: list[str]) -> None:
        with IndexedDatasetWriter(str(tmp_path / "c"), t.vocab_size) as w:
            for r in records:
                w.add_document(document_ids(t, r))
            w.finalize()

    write(RECORDS)
    args = _args(str(tmp_path / "c"), tok, tmp_path / "run", "--checkpoint.dir", str(tmp_path / "ck"),
                 "--data.valid_fraction", "0")
    assert pretrain_main(args) == 0
    before = (tmp_path / "c.bin").read_bytes()
    write(list(reversed(RECORDS)))  # the same documents in another order: same sizes, other content
    assert len((tmp_path / "c.bin").read_bytes()) == len(before) and (tmp_path / "c.bin").read_bytes() != before
    capsys.readouterr()
    _refused([*args, "--train.steps", "3"], capsys, 3, r"'c' was rewritten since the checkpoint \(same size")
    assert pretrain_main([*args, "--train.steps", "3", "--data.on_change", "restart"]) == 0
    assert "data.on_change restart: reading the data from its start" in capsys.readouterr().out


def test_an_overlong_line_is_not_held_whole(tmp_path: Path) -> None:
    """A line past data.max_record_bytes is read as its first max + 1 bytes (so it counts as oversized) and the
    rest skipped: a binary file named .jsonl cannot fill the memory; the offsets stay the lines' own."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"a" * 200_000 + b"\n" + b'{"text": "x"}\n' + b"b" * 50)
    got = list(lines(str(f), "jsonl", max_line=10))
    assert [(o, len(line)) for o, line in got] == [(0, 11), (200_001, 11), (200_015, 11)]
    assert list(lines(str(f), "jsonl", max_line=100))[1] == (200_001, b'{"text": "x"}\n')


def _signal_after_steps(metrics: Path, steps: int, done: threading.Event) -> None:
    while not done.is_set():
        if metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            os.kill(os.getpid(), signal.SIGINT)
            return
        done.wait(0.05)


def _pretrain_rank_signalled(rank: int, world: int, argv: list[str], metrics: str, steps: int) -> tuple[int, str, str]:
    """A warm rank's pretrain.py run that sends itself Ctrl-C once `steps` steps are logged (every rank gets the
    signal, as a terminal's Ctrl-C or a scheduler's SIGTERM reaches every rank)."""
    from tests.pool_pretrain import _pretrain_rank

    done = threading.Event()
    threading.Thread(target=_signal_after_steps, args=(Path(metrics), steps, done), daemon=True).start()
    try:
        return _pretrain_rank(rank, world, argv)
    finally:
        done.set()


def test_ctrl_c_at_dp_2_while_both_ranks_wait_saves_the_last_step(dist_world: Any, tmp_path: Path, tok: str) -> None:
    """Two ranks, each waiting for data that never comes (its good records used up, then a billion invalid
    lines): Ctrl-C ends both waits, the ranks agree before the step, the last finished step is saved with its
    data position and the run exits 0. The signal comes once every step the good records can make is logged,
    so the ranks are then waiting by construction, not by timing."""
    from megalite.data.sources import Selection
    from megalite.data.tokenizer import document_ids, load_tokenizer

    t, seq = load_tokenizer(tok), 16  # global batch 2 over 2 streams: one sample per stream and step
    good = RECORDS[:5]
    _slow_source(tmp_path / "d.jsonl.gz", _jsonl(good))
    tokens = [sum(len(document_ids(t, r)) for i, r in enumerate(good) if Selection(v, 2, False, 0.0, 0).mine(0, i, 0))
              for v in range(2)]
    steps = min((n - 1) // seq for n in tokens)  # samples of seq + 1 tokens, each seq after the last
    assert steps >= 1
    log, ck = tmp_path / "run", tmp_path / "ck"
    args = [*_args(str(tmp_path / "d.jsonl.gz"), tok, log, "--checkpoint.dir", str(ck), "--train.steps", "1000",
                   "--data.max_bad_fraction", "1.0", "--data.valid_fraction", "0", "--train.seed", "0"),
            "--parallel.dp", "2", "--train.micro_batch_size", "1", "--data.streams", "2"]
    results = dist_world(2).run(_pretrain_rank_signalled, 2, args, str(log / "metrics.jsonl"), steps)
    out = "".join(o for _, o, _ in results)
    assert [code for code, _, _ in results] == [0, 0], "".join(e for _, _, e in results)[-3000:]
    assert f"stop requested by signal while waiting for data: exiting before step {steps + 1}" in out, out[-2000:]
    assert (ck / "latest").read_text().strip() == f"step_{steps:08d}"
    saved = json.loads((ck / f"step_{steps:08d}" / "index.json").read_text())["extra"]["data_stream"]
    assert saved["steps"] == steps


def test_a_record_longer_than_a_step_counts_as_read(tmp_path: Path, tok: str) -> None:
    """After step 1 of a source whose records are longer than a step, the record being read is counted (the log
    said "0 records read" while training on it)."""
    from megalite.config.schema import Config
    from megalite.data.loader import RankSlice, StreamLoader
    from megalite.data.tokenizer import load_tokenizer

    (tmp_path / "d.jsonl").write_bytes(_jsonl([" ".join(RECORDS) * 4] * 3))
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer = [str(tmp_path / "d.jsonl")], tok
    cfg.data.workers, cfg.data.valid_fraction = 0, 0.0
    cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 2, 2
    loader = StreamLoader(cfg, RankSlice(1, 0), load_tokenizer(tok))
    try:
        loader.next_step()
        assert loader.counts().records == 1
    finally:
        loader.close()


def test_a_validation_split_too_small_is_refused_before_step_1(tmp_path: Path, tok: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The run evaluates, and the held-out share of a small corpus is empty: refused before step 1 (the loader
    builds the validation batches first), not after training up to the first evaluation."""
    from megalite.data.sources import Selection

    records = RECORDS[:6]
    seed = next(s for s in range(100) if not any(Selection(0, 1, True, 0.05, s).mine(0, i, 0) for i in range(6)))
    (tmp_path / "d.jsonl").write_bytes(_jsonl(records))
    run = tmp_path / "run"
    _refused(_args(str(tmp_path / "d.jsonl"), tok, run, "--data.valid_fraction", "0.05", "--train.seed", str(seed),
                   "--train.eval_interval", "3", "--train.steps", "6"), capsys, 3,
             "got no validation record in a whole epoch")
    assert not (run / "metrics.jsonl").exists() or '"loss"' not in (run / "metrics.jsonl").read_text()
