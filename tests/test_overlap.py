"""When the ZeRO optimizer's DP collectives run (`megalite.dp.overlap`), proven by the order of events,
never by timing, and that moving them changes nothing that is computed.

Events: the optimizer reports each launch / wait through its `on_event` sink; the tests add the model's
own moments with module hooks ("block j's forward ended", "block j's backward ended": the gradient of
the block's input is complete) to the same list, so the list is the interleaving as it happened.

Exactness (dp = 2, fp32): a DP sum of two values is commutative, so reducing a gradient element in one
bucket or another gives the same bits; AdamW is elementwise, so which rank's shard an element falls in
does not matter either. What bucketing can change at ZeRO >= 1 is the gradient norm's summation order (it
sums per-piece norms and a shard boundary cuts a parameter into different pieces): ~1e-7 relative; so
those runs do not clip (clip 1e9), to hold parameters and losses bitwise equal, and compare the norms
to 1e-6. At ZeRO 0 the pieces are whole parameters in the same order: everything is bitwise equal,
clipping included. At dp > 2 a ring reduction's summation order depends on an element's position in
its bucket, so there bucket sizes change results by round-off (not tested here).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from megalite.config import parse_args, validate
from megalite.dp import OverlapEvent
from megalite.dp.buckets import split_by_size
from megalite.dp.overlap import OverlapSettings
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.optim import SyncOptions, build_distributed_optimizer
from megalite.training.step import train_step
from tests.conftest import free_port
from tests.parallel_utils import (layout, micro_batches, random_steps, step_context, tiny_model_cfg,
                                  tiny_train_cfg)
from tests.parallel_utils import ADAMW
from tests.pool_pretrain import run_pretrain_in_pool
from tests.test_pretrain import _args

REPO = Path(__file__).resolve().parents[1]

MICRO, M, STEPS = 2, 2, 3
# The tiny llama's head (64 x 32 fp32 = 8 KiB) exceeds a 4 KiB first bucket, so it is alone in bucket 0;
# 16 KiB later buckets split the ~90 KB model into several.
SMALL = dict(first_bucket_bytes=4096, bucket_bytes=16384)
ONE_BUCKET: dict[str, Any] = {}  # the defaults: 1 MiB / 25 MiB hold the whole tiny model in one bucket


def _blocks(model: GPT) -> list[nn.Module]:
    return list(model.layers.values())


def _record_model_events(model: GPT, events: list[tuple]) -> None:
    """Append ("fwd_end", j) when block j's forward ends and ("bwd_end", j) when the gradient of its
    input is complete (its backward has finished); ("head_fwd_end",) after the output layer."""
    def on_forward(j: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            events.append(("fwd_end", j))
        return hook

    def on_input(j: int):
        def hook(module: nn.Module, args: Any) -> None:
            x = args[0]
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda g: events.append(("bwd_end", j)))
        return hook

    for j, blk in enumerate(_blocks(model)):
        blk.register_forward_hook(on_forward(j))
        blk.register_forward_pre_hook(on_input(j))
    model.head.register_forward_hook(lambda m, a, o: events.append(("head_fwd_end",)))


def _train(rank: int, stage: int, options: dict[str, Any], clip: float, num_layers: int = 2) -> dict[str, Any]:
    """STEPS steps of M micro-batches at dp = 2 with `options` for `build_distributed_optimizer`; the
    events, losses, norms and final parameters."""
    st = layout(1)
    cfg = tiny_model_cfg("llama", num_layers=num_layers)
    model = GPT(cfg, st, seed=5)
    events: list[tuple] = []
    _record_model_events(model, events)
    opt = build_distributed_optimizer(model, st, stage, dtype=torch.float32, optimizer=ADAMW, 
                                      sync=SyncOptions(OverlapSettings(**options),
                                                       on_event=lambda e: events.append((e.kind, e.bucket))))
    tcfg = SimpleNamespace(**{**vars(tiny_train_cfg(STEPS)), "clip_grad": clip})
    per_rank = MICRO * M
    data = random_steps(cfg, STEPS, per_rank * st.dp)
    st.counter.reset()
    results = []
    for i, d in enumerate(data):
        events.append(("step_start", i))
        results.append(train_step(step_context(model, st, torch.float32, tcfg), opt,
                                  micro_batches(d[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank], MICRO), i))
        events.append(("step_end", i))
    params = opt.full_parameters()
    return {"events": events, "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "params": params, "n_buckets": len(opt.sync.buckets), "dp_bytes": st.counter.exact_bytes("dp")}


def _assert_same_training(a: dict[str, Any], b: dict[str, Any], what: str, norm_rtol: float = 0.0) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} != {b['losses']}"
    for x, y in zip(a["norms"], b["norms"]):
        assert abs(x - y) <= norm_rtol * abs(y), f"{what}: grad norm {x} != {y}"
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), f"{what}: parameter {name} differs"


# ------------------------------------------------------------ 1. bucket sizing
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bucket_sizes_change_nothing_computed(dist_world, stage: int) -> None:
    clip = 1.0 if stage == 0 else 1e9  # see the module doc: ZeRO >= 1 norms differ by round-off
    small = dist_world(2).run(_train, stage, SMALL, clip)[0]
    one = dist_world(2).run(_train, stage, ONE_BUCKET, clip)[0]
    assert one["n_buckets"] == 1 and small["n_buckets"] >= 4, (one["n_buckets"], small["n_buckets"])
    _assert_same_training(small, one, f"zero={stage} small vs one bucket", norm_rtol=0.0 if stage == 0 else 1e-6)


def test_first_bucket_is_the_output_layer_alone() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (2048, 16, 1024, 1024, 1024, 4096)]  # fp32: x4 bytes
    sizes = [[p.numel() for p in g] for g in split_by_size(params, bucket_bytes=8192, first_bucket_bytes=4096)]
    assert sizes == [[2048], [16, 1024], [1024, 1024], [4096]]  # 8 KiB later buckets; 16 KiB alone
    # a first bucket larger than the others is capped at bucket_bytes; without one, all are alike
    assert split_by_size(params, 8192, 1 << 20) == split_by_size(params, 8192)


# ------------------------------------------------------------ 2. reduction during the backward
def _last_index(events: list[tuple], event: tuple) -> int:
    return max(i for i, e in enumerate(events) if e == event)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_first_bucket_reduction_starts_before_the_backward_ends(dist_world, stage: int) -> None:
    """With a small first bucket (the head's gradient), its reduction is launched in the last
    micro-batch's backward before any block's backward has ended (the first layers' gradients do not
    exist yet); with one bucket for the whole model it can only start after the first block's backward
    (the contrast shows the check bites). ZeRO-3 reduces per gather unit, not per sized bucket."""
    small = dist_world(2).run(_train, stage, SMALL, 1.0)[0]["events"]
    first_step = small[:small.index(("step_end", 0))]
    reduce0 = first_step.index(("reduce", 0))
    backwards = [i for i, e in enumerate(first_step) if e[0] == "bwd_end"]
    assert len(backwards) == 2 * M, first_step  # 2 blocks x M micro-batches
    assert backwards[M - 1] < reduce0, "a reduction started inside no_sync (before the last micro-batch)"
    last_mb = backwards[M:]
    assert reduce0 < min(last_mb), f"zero={stage}: first bucket launched after a block's backward ended: {first_step}"
    one = dist_world(2).run(_train, stage, ONE_BUCKET, 1.0)[0]["events"]
    one = one[:one.index(("step_end", 0))]
    assert one.index(("reduce", 0)) > _last_index(one, ("bwd_end", 0)), one


# ------------------------------------------------------------ 3. ZeRO-1/2 gathers inside the next forward
@pytest.mark.parametrize("stage", [1, 2])
def test_param_gathers_are_waited_on_inside_the_next_forward(dist_world, stage: int) -> None:
    on = dist_world(2).run(_train, stage, SMALL, 1.0)[0]
    off = dist_world(2).run(_train, stage, {**SMALL, "param_gather": False}, 1.0)[0]
    _assert_same_training(on, off, f"zero={stage} overlapped vs waited gathers")
    n = on["n_buckets"]
    ev = on["events"]
    for step in range(STEPS - 1):  # the gathers launched by step `step` are waited on in step `step + 1`
        end, nxt_end = ev.index(("step_end", step)), ev.index(("step_end", step + 1))
        launched = [e[1] for e in ev[:end] if e[0] == "gather"][-n:]
        assert launched == list(range(n))[::-1], "every bucket's gather is launched by the step, in forward order"
        between = ev[ev.index(("step_start", step + 1)):nxt_end]
        waits = [i for i, e in enumerate(between) if e[0] == "gather_wait"]
        assert sorted(between[i][1] for i in waits) == list(range(n)), "each bucket waited on once"
        head_wait = between.index(("gather_wait", 0))  # bucket 0: the head alone
        # the head's bucket is waited on after the blocks' forwards ran, just before the head's
        assert between.index(("fwd_end", 1)) < head_wait < between.index(("head_fwd_end",)), between
        this_step = ev[ev.index(("step_start", step)):end]  # the step itself returns without waiting
        assert _last_index(this_step, ("gather", 0)) > max(
            (i for i, e in enumerate(this_step) if e[0] == "gather_wait"), default=-1), this_step
    ev_off = off["events"]
    for step in range(STEPS):  # switched off: every wait happens inside the step that launched it
        between = ev_off[ev_off.index(("step_start", step)):ev_off.index(("step_end", step))]
        assert sum(e[0] == "gather_wait" for e in between) == n


# ------------------------------------------------------------ 4. ZeRO-3 prefetch depth
def _prefetch_run(rank: int, depth: int) -> dict[str, Any]:
    out = _train(rank, 3, {"zero3_prefetch": depth}, 1.0, 4)
    return {k: v for k, v in out.items() if k != "events"}


def _gathered_at_each_forward(rank: int, depth: int) -> list[int]:
    """How many of the 4 blocks are gathered (or in flight) as each block's forward starts."""
    st = layout(1)
    cfg = tiny_model_cfg("llama", num_layers=4)
    model = GPT(cfg, st, seed=5)
    opt = build_distributed_optimizer(model, st, 3, dtype=torch.float32, optimizer=ADAMW,
                                      sync=SyncOptions(OverlapSettings(zero3_prefetch=depth)))
    assert opt.sync.zero3 is not None
    zero3 = opt.sync.zero3
    counts: list[int] = []
    blocks = [b for _, unit in zero3.blocks for b in unit]  # one bucket per block (one gradient group)
    for blk in _blocks(model):  # registered after the optimizer's hooks: sees their gathers
        blk.register_forward_pre_hook(lambda m, a: counts.append(sum(zero3.is_gathered(b) for b in blocks)))
    ids = random_steps(cfg, 1, 2)[0][:, :-1]
    with torch.no_grad():
        model(ids)
    return counts


@pytest.mark.parametrize("depth", [0, 2])
def test_zero3_prefetch_depth_changes_nothing_computed(dist_world, depth: int) -> None:
    base = dist_world(2).run(_prefetch_run, 1)[0]
    other = dist_world(2).run(_prefetch_run, depth)[0]
    _assert_same_training(other, base, f"zero3_prefetch={depth} vs 1")
    assert other["dp_bytes"] == base["dp_bytes"], "the depth changed what is gathered"


def test_zero3_prefetch_depth_is_how_many_blocks_are_gathered_ahead(dist_world) -> None:
    for depth in (0, 1, 2):
        counts = dist_world(2).run(_gathered_at_each_forward, depth)[0]
        assert counts == [min(depth + 1, 4 - j) for j in range(4)], (depth, counts)


def test_overlap_event_is_typed() -> None:
    e = OverlapEvent("reduce", 3)
    assert (e.kind, e.bucket) == ("reduce", 3)


# ------------------------------------------------------------ the settings, end to end
def test_settings_are_validated() -> None:
    cfg = parse_args(["--parallel.bucket_mb", "0", "--parallel.first_bucket_mb", "-1", "--parallel.zero3_prefetch", "-1"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    for needle in ("parallel.bucket_mb must be > 0", "parallel.first_bucket_mb must be > 0",
                   "parallel.zero3_prefetch must be >= 0"):
        assert needle in str(err.value)


def test_pretrain_overlapped_equals_waited(dist_world, demo_cache_dir: str, tmp_path: Path) -> None:
    """pretrain.py at 2 ranks (in the warm pool: tests/pool_pretrain.py), dp = 2, ZeRO-2, small buckets, with a
    checkpoint save, validation and a text sample between steps (each reads the parameters: `finish_param_sync`):
    overlapping the gathers and switching it off give bitwise the same losses, validation losses and samples."""
    extra = ["--train.steps", "4", "--parallel.zero", "2", "--parallel.first_bucket_mb", "0.01",
             "--parallel.bucket_mb", "0.05", "--train.eval_interval", "2", "--logging.sample_interval", "2",
             "--checkpoint.interval", "2"]
    rows = {}
    for overlap in ("true", "false"):
        out = tmp_path / overlap
        proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, out, *extra, "--parallel.overlap_param_gather",
                                                      overlap, "--checkpoint.dir", str(out / "ckpt")), nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[overlap] = [{k: r[k] for k in ("step", "loss", "valid_loss", "sample") if k in r}
                         for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert any("sample" in r for r in rows["true"]) and any("valid_loss" in r for r in rows["true"])
    assert rows["true"] == rows["false"]


def test_overlap_bench_smoke(tmp_path: Path, dist_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/overlap_compare.py runs end to end (it checks each pair's losses equal before timing): its main here,
    its two ranks' part (`measure_on_rank`, all the script runs on a rank but the group's start) in the warm gloo
    ranks instead of two new processes."""
    from bench import overlap_compare

    def pool_ranks(worker: Any, world: int, port: int, args: dict[str, Any]) -> Any:
        assert worker is overlap_compare._worker  # what the script starts on fresh processes
        return dist_world(world).run(overlap_compare.measure_on_rank, world, args)[0]

    monkeypatch.setattr(overlap_compare, "spawn_ranks", pool_ranks)
    assert overlap_compare.main(["--smoke", "--out", str(tmp_path), "--port", str(free_port())]) == 0
    res = json.loads((tmp_path / "overlap_compare_smoke.json").read_text())
    assert {r["variant"] for r in res["ratios"]} >= {"z1 gathers overlapped", "z3 prefetch 2"}
    # Every paired ratio is a real measurement (a broken timer gives 0, inf or nan), not just its ordering.
    assert all(0 < q[k] < float("inf") for q in res["ratios"] for k in ("min", "median", "max")), res["ratios"]
