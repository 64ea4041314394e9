"""Raw data streamed as it comes (megalite/data/sources.py, loader.py): every source kind gives the same tokens,
bad records are counted by kind, and the token stream after save -> resume -> save -> resume, across file and
epoch boundaries and with dp changing between the runs, is the uninterrupted run's, token for token."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from megalite.config.schema import Config
from megalite.data.indexed import IndexedDatasetWriter
from megalite.data.loader import RankSlice, StreamLoader
from megalite.data.packing import check_bad_records
from megalite.data.packing import Counts
from megalite.data.tokenizer import document_ids, load_tokenizer
from megalite.errors import ConfigError, DataError
from megalite.training.trainer import main as pretrain_main
from tests.tokenizer_utils import TEXTS, train_hf_bpe

RECORDS = [t * (1 + i % 3) + f" #{i}" for i, t in enumerate(TEXTS * 4)]  # 24 documents of varied lengths


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(train_hf_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _cfg(paths: list[str], tok: str, **data: Any) -> Config:
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer, cfg.data.workers, cfg.data.valid_fraction = paths, tok, 0, 0.0
    cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 8, 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def _lines(records: list[str]) -> bytes:
    return "".join(json.dumps({"text": r}) + "\n" for r in records).encode()


def _steps(cfg: Config, tok: str, dp: int, n: int, position: dict | None = None) -> tuple[list[torch.Tensor], dict]:
    """`n` steps of the whole run at `dp` (every rank's loader in this process): each step's (inputs | labels)
    in the canonical order [G, 2S], and the data position after them (gathered as a checkpoint gathers it)."""
    loaders = [StreamLoader(cfg, RankSlice(dp, r), load_tokenizer(tok)) for r in range(dp)]
    try:
        for ld in loaders:
            if position is not None:
                ld.load_position(json.loads(json.dumps(position)))  # through JSON, as index.json holds it
        out = []
        for _ in range(n):
            per_rank = [torch.cat([torch.cat(b, dim=1) for b in ld.next_step()]) for ld in loaders]
            out.append(torch.cat(per_rank))
        states = [ld.local_states() for ld in loaders]
        return out, loaders[0].position(lambda _: states)
    finally:
        for ld in loaders:
            ld.close()


def test_every_source_kind_streams_the_same_tokens(tmp_path: Path, tok: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    datasets = pytest.importorskip("datasets")

    raw = _lines(RECORDS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": RECORDS}), tmp_path / "a.parquet", row_group_size=5)  # several row groups
    datasets.Dataset.from_dict({"text": RECORDS}).save_to_disk(str(tmp_path / "ds"))
    want, _ = _steps(_cfg([str(tmp_path / "a.jsonl")], tok, streams=2), tok, 1, 3)
    t = load_tokenizer(tok)
    # Stream 0 starts at record 0 or 1 (records alternate between the 2 streams, from a seeded rotation).
    assert want[0][0, :5].tolist() in [document_ids(t, r)[:5] for r in RECORDS[:2]]
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.parquet", "ds"):
        got, _ = _steps(_cfg([str(tmp_path / name)], tok, streams=2), tok, 1, 3)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    with pytest.raises(DataError, match="local Hugging Face cache"):
        _steps(_cfg(["hf:megalite-test/surely-not-cached"], tok), tok, 1, 1)


def test_bad_records_are_counted_by_kind_and_stop_the_run(tmp_path: Path, tok: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    good = [json.dumps({"text": r}).encode() for r in RECORDS]
    bad = [b"{not json", json.dumps({"txt": "x"}).encode(), b'{"text": "\xff\xfe"}', json.dumps({"text": ""}).encode(),
           json.dumps({"text": "y" * 2000}).encode(), b"[1, 2]", json.dumps({"text": 7}).encode()]
    lines = good[:3] + bad + good[3:] + [b""]  # a blank line is no record
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cfg = _cfg([str(tmp_path / "d.jsonl")], tok, streams=1, max_record_bytes=1000)
    cfg.train.global_batch_size = 2
    ld = StreamLoader(cfg, RankSlice(1, 0), load_tokenizer(tok))
    try:
        while ld.counts().records < len(good) + len(bad):  # through the whole file once
            ld.next_step()
        bad_counts = ld.counts().bad
    finally:
        ld.close()
    assert bad_counts == {"invalid_json": 2, "missing_key": 2, "non_utf8": 1, "empty": 1, "oversized": 1,
                          "bad_chat": 0, "no_assistant": 0}
    with pytest.raises(DataError, match=r"7 bad \(empty 1, invalid_json 2, missing_key 2, non_utf8 1, oversized 1\)"):
        check_bad_records(Counts(31, bad_counts), max_records=6, max_fraction=1.0)
    check_bad_records(Counts(31, bad_counts), max_records=7, max_fraction=1.0)
    with pytest.raises(DataError, match="max_bad_fraction"):
        check_bad_records(Counts(1000, {"empty": 11}), max_records=-1, max_fraction=0.01)
    # The run stops with one line and the data exit code; the count is in the progress line up to then.
    code = pretrain_main(["--data.path", str(tmp_path / "d.jsonl"), "--data.tokenizer", tok, "--data.workers", "0",
                          "--data.max_bad_records", "0", "--model.seq_len", "16", "--model.num_layers", "1",
                          "--model.hidden_size", "32", "--train.micro_batch_size", "2", "--train.steps", "8",
                          "--train.eval_interval", "0", "--logging.interval", "1", "--data.valid_fraction", "0",
                          "--logging.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert re.fullmatch(r"megalite: error: data: \d+ bad \(.*invalid_json 1.*\) of \d+ records read, over "
                        r"data.max_bad_records = 0: .*\n", err), err


def test_resume_is_token_for_token_across_files_epochs_and_dp(tmp_path: Path, tok: str) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    short = [f"record {i}: {t[:24]}" for i, t in enumerate(TEXTS * 4)]
    for i in range(3):  # three files: shard boundaries; short records: every stream wraps its epoch
        (shards / f"part{i}.jsonl").write_bytes(_lines(short[i * 8: i * 8 + 8]))
    t = load_tokenizer(tok)
    with IndexedDatasetWriter(str(tmp_path / "bin" / "c"), t.vocab_size) as w:  # a .bin/.idx source in the blend
        for r in RECORDS:
            w.add_document(document_ids(t, r))
        w.finalize()
    cfg = _cfg([str(shards), str(tmp_path / "bin" / "c")], tok, streams=4, weights=[3.0, 1.0])
    want, end = _steps(cfg, tok, 1, 9)
    assert min(s["subs"][0]["cursor"]["pos"][0] for s in end["states"]) >= 1, "no stream crossed an epoch"
    got, pos = _steps(cfg, tok, 2, 3)
    more, pos = _steps(cfg, tok, 4, 3, pos)
    cfg.data.workers = 1  # the tokenizer workers change nothing either
    last, pos = _steps(cfg, tok, 1, 3, pos)
    for i, (a, b) in enumerate(zip(got + more + last, want)):
        assert torch.equal(a, b), f"step {i + 1} differs from the uninterrupted run's"
    assert pos == end
    with pytest.raises(ConfigError, match="not a multiple of dp = 8"):  # 4 streams cannot split over 8 ranks
        _steps(cfg, tok, 8, 1, pos)
    cfg.model.seq_len = 32
    with pytest.raises(DataError, match="model.seq_len 16"):
        _steps(cfg, tok, 1, 1, pos)


def _losses(log: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_checkpointed_stream_resumes_at_another_dp(dist_world, tmp_path: Path, tok: str) -> None:
    """Through real checkpoints: 2 steps at dp 2 (the streams' states gathered into index.json), then steps 3-4 at
    dp 1 give the uninterrupted dp-1 run's losses (the same samples in each step; fp32 sums over another split
    of the batch: a few ulps)."""
    from tests.pool_pretrain import run_pretrain_in_pool

    (tmp_path / "d.jsonl").write_bytes(_lines(RECORDS))
    args = ["--data.path", str(tmp_path / "d.jsonl"), "--data.tokenizer", tok, "--data.workers", "0",
            "--data.streams", "2", "--data.valid_fraction", "0", "--model.seq_len", "16", "--model.num_layers", "1",
            "--model.hidden_size", "32", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
            "--train.eval_interval", "0", "--logging.interval", "1"]
    assert pretrain_main([*args, "--train.steps", "4", "--logging.dir", str(tmp_path / "whole")]) == 0
    first = run_pretrain_in_pool(dist_world, [*args, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "ck"),
                                              "--logging.dir", str(tmp_path / "part")], 2)
    assert first.returncode == 0, first.stderr
    saved = json.loads((tmp_path / "ck" / "step_00000002" / "index.json").read_text())["extra"]["data_stream"]
    assert saved["streams"] == 2 and saved["steps"] == 2 and len(saved["states"]) == 2
    assert pretrain_main([*args, "--train.steps", "4", "--checkpoint.dir", str(tmp_path / "ck"),
                          "--logging.dir", str(tmp_path / "part")]) == 0
    whole, part = _losses(tmp_path / "whole"), _losses(tmp_path / "part")
    assert sorted(part) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert abs(whole[step] - part[step]) <= 1e-5, (step, whole[step], part[step])
