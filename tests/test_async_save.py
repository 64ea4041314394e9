"""checkpoint.async_save: the same bytes as a synchronous save, at most one save in flight, errors raised on the
training thread, kill -9 during a write resumes from the last complete checkpoint. (SIGTERM waits for the write in
flight: tests/test_reliability.py's SIGTERM run saves in the background.)

The in-process tests hold the background writer at a barrier (its `on_barrier` hook) so that what happens
meanwhile is fixed by events, never by timing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.checkpoint.async_save import AsyncSaver, raise_if_failed
from megalite.checkpoint.sharded import plan_save, save_sharded
from megalite.config import CheckpointConfig
from megalite.data import DataSampler
from megalite.errors import CheckpointError
from megalite.optim.loss_scale import LossScaler
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.checkpointing import RunCheckpoints
from megalite.training.step import StepContext, train_step
from tests.parallel_utils import tiny_model_cfg, tiny_train_cfg
from tests.pool_pretrain import run_pretrain_in_pool
from tests.test_reliability import _args, _rows, _torchrun


def _tiny() -> tuple[ParallelState, nn.ModuleList, ReferenceOptimizer, StepContext]:
    cfg = tiny_model_cfg("llama", vocab_size=67)
    st = ParallelState(tp=1, pp=1, dp=1, rank=0)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=1, dtype=torch.float32)
    model = nn.ModuleList(engine.chunks)
    opt = ReferenceOptimizer(model, st, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(3), LossScaler(False), "1f1b")
    return st, model, opt, ctx


def _step(ctx: StepContext, opt: ReferenceOptimizer, i: int) -> None:
    data = torch.randint(0, 67, (2, 9), generator=torch.Generator().manual_seed(i))
    train_step(ctx, opt, [(data[j:j + 1, :-1], data[j:j + 1, 1:]) for j in range(2)], i)


def _files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir())}


def _gate(step: int) -> tuple[threading.Event, threading.Event, object]:
    """A barrier hook that parks the writer of `step` before its first barrier until `go` is set."""
    parked, go = threading.Event(), threading.Event()

    def hook(s: int, n: int) -> None:
        if s == step and n == 1:
            parked.set()
            go.wait()
    return parked, go, hook


def test_async_bytes_equal_sync_and_training_may_change_the_tensors_meanwhile(tmp_path: Path) -> None:
    st, model, opt, ctx = _tiny()
    _step(ctx, opt, 0)  # Adam moments exist: they are saved too
    extra = {"sampler": {"consumed_samples": 2}, "rng": {"default": torch.get_rng_state()}}
    save_sharded(tmp_path / "sync", 1, model, opt, extra, st, keep=2)
    parked, go, hook = _gate(1)
    saver = AsyncSaver(st, 60.0, pin=False, on_barrier=hook)  # type: ignore[arg-type]
    saver.submit(plan_save(tmp_path / "async", 1, model, opt, extra, st, keep=2))
    parked.wait()
    assert saver.busy() == 1
    with pytest.raises(RuntimeError, match="still in flight"):  # at most one save in flight
        saver.submit(plan_save(tmp_path / "async", 2, model, opt, extra, st, keep=2))
    _step(ctx, opt, 1)  # the loop goes on: parameters and moments change in place while the write waits
    go.set()
    _, outcome = saver.wait()
    assert outcome is not None and outcome.error is None, outcome
    want = _files(tmp_path / "sync" / "step_00000001")
    assert _files(tmp_path / "async" / "step_00000001") == want  # every file, index.json and sha256s included
    assert (tmp_path / "async" / "latest").read_text().strip() == "step_00000001"
    # The step really changed what a save now writes, so the equality above is the snapshot's doing.
    save_sharded(tmp_path / "after", 1, model, opt, extra, st, keep=2)
    assert _files(tmp_path / "after" / "step_00000001")["rank_00000.safetensors"] != want["rank_00000.safetensors"]


def _run_checkpoints(root: Path, st: ParallelState, model: nn.ModuleList, opt: ReferenceOptimizer) -> RunCheckpoints:
    return RunCheckpoints(CheckpointConfig(dir=str(root), interval=1, async_save=True), {"parallel": {"timeout_s": 60}},
                          model, opt, DataSampler(100, 2, 1, 0, 1, 0), LossScaler(False), RNGStreams(0, st), st)


def test_the_next_save_waits_for_the_one_in_flight_and_says_so(tmp_path: Path) -> None:
    st, model, opt, ctx = _tiny()
    rc = _run_checkpoints(tmp_path, st, model, opt)
    assert rc.saver is not None
    parked, go, hook = _gate(1)
    rc.saver.on_barrier = hook  # type: ignore[assignment]
    notes: list[str] = []

    def note(line: str) -> None:
        notes.append(line)
        if "waiting for the save of step 1" in line:
            go.set()  # only now may the first save finish: the second one is provably waiting

    assert rc.save(1, note) is None and "writing in the background" in notes[-1]
    parked.wait()
    _step(ctx, opt, 0)
    assert rc.save(2, note) is None
    rc.finish(note)
    text = "\n".join(notes)
    assert "checkpoint step 2: waiting for the save of step 1" in text
    assert text.index("saved checkpoint " + str(tmp_path / "step_00000001")) < text.index("waited")
    assert "saved checkpoint " + str(tmp_path / "step_00000002") in notes[-1]
    assert (tmp_path / "latest").read_text().strip() == "step_00000002" and rc.last_saved == tmp_path / "step_00000002"


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    st, model, opt, _ = _tiny()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    rc = _run_checkpoints(blocker / "ckpt", st, model, opt)
    assert rc.saver is not None
    rc.save(1, lambda _: None)
    while rc.saver.busy() is not None:  # the write fails at once; wait for the thread to end
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="cannot write checkpoint under"):
        rc.poll(lambda _: None)
    assert blocker.read_text() == "not a directory"


@pytest.mark.timeout(900)  # three 2-process runs
def test_two_ranks_kill_9_mid_write_resumes_from_the_last_complete_and_matches_sync(dist_world, demo_cache_dir: str,
                                                                                   tmp_path: Path) -> None:
    """2 processes (dp 2). Sync run vs async run killed (SIGKILL on rank 1) during step 4's write, after its file
    is durable and before the checkpoint is published; torchrun restarts it, it resumes from step 2 (the last
    complete one), and ends with the sync run's losses and the same checkpoint bytes."""
    common = ["--train.steps", "6", "--train.global_batch_size", "8", "--checkpoint.interval", "2"]
    # The sync run in the warm ranks (tests/pool_pretrain.py; one thread per rank like the torchrun job's ranks)
    sync = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, tmp_path / "l1", *common, "--checkpoint.dir",
                                                  str(tmp_path / "c1")), nproc=2)
    assert sync.returncode == 0, sync.stderr[-2000:]
    crash = _torchrun(_args(demo_cache_dir, tmp_path / "l2", *common, "--checkpoint.dir", str(tmp_path / "c2"),
                            "--checkpoint.async_save", "true"),
                      restarts=1, MEGALITE_FAULT="kill_save:rank=1:step=4")
    assert crash.returncode == 0, crash.stderr[-2000:]
    assert f"resumed from {tmp_path / 'c2' / 'step_00000002'}" in crash.stdout, crash.stdout[-2000:]
    want = {r["step"]: r["loss"] for r in _rows(tmp_path / "l1")}
    got = {r["step"]: r["loss"] for r in _rows(tmp_path / "l2")}
    assert sorted(got) == list(range(1, 7)) and all(got[s] == want[s] for s in want), (got, want)
    for step in ("step_00000004", "step_00000006"):
        a, b = _files(tmp_path / "c1" / step), _files(tmp_path / "c2" / step)
        assert sorted(a) == sorted(b)
        for name in a:
            if name.endswith(".safetensors"):
                assert a[name] == b[name], f"{step}/{name}"
        ia, ib = json.loads(a["index.json"]), json.loads(b["index.json"])
        ia["extra"].pop("config"), ib["extra"].pop("config")  # differ in checkpoint.async_save only
        assert ia == ib


def test_bench_smoke_writes_its_table(tmp_path: Path) -> None:
    from bench.async_save import main as bench

    assert bench(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    assert "loop blocked per save" in (tmp_path / "async_save_smoke.md").read_text()
    assert json.loads((tmp_path / "async_save_smoke.json").read_text())["host_buffer_bytes"] > 0


@pytest.mark.parametrize("name", ["step_00000002", "step_00000002.tmp"])
def test_a_users_file_in_the_way_is_the_same_refusal_sync_and_async(tmp_path: Path, name: str) -> None:
    """A user's file where the step directory (or its temporary name) goes: the same one-line CheckpointError
    (exit 4) whether the save runs in the background or not, the file untouched and no step_N.tmp left
    (before: a raw NotADirectoryError (exit 1) in a sync save, a CheckpointError in an async one, and the
    written step_N.tmp left on disk)."""
    st, model, opt, _ = _tiny()
    errors = []
    for mode in ("sync", "async"):
        root = tmp_path / mode
        root.mkdir()
        (root / name).write_text("mine")
        with pytest.raises(CheckpointError) as e:
            if mode == "sync":
                save_sharded(root, 2, model, opt, {}, st, keep=2)
            else:
                saver = AsyncSaver(st, 60.0, pin=False)
                saver.submit(plan_save(root, 2, model, opt, {}, st, keep=2))
                raise_if_failed(saver.wait()[1])
        errors.append(str(e.value).replace(str(root), "ROOT"))
        assert sorted(p.name for p in root.iterdir()) == [name] and (root / name).read_text() == "mine"
    assert errors[0] == errors[1] and "is a file, not a checkpoint directory" in errors[0]
