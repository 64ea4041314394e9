"""End to end: `pretrain.py --model.preset tiny-moe` trains and logs its MoE fields, and
`pretrain.py --model.preset tiny-moe --parallel.ep 2 --parallel.tp 2` at 4 ranks gives the single-process losses
(fp32; the same sums in another order: 1e-5 on O(1) losses, as tests/test_cp_pretrain.py). The 4 ranks are the
session's warm ones (tests/pool_pretrain.py): the claim is the layout's numbers, not torchrun's start-up, which
the launch tests (tests/test_launch.py, tests/test_reliability.py) run for real.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain import main
from tests.pool_pretrain import run_pretrain_in_pool
from tests.test_pretrain import _args, _losses

TOL = 1e-5
MOE = ["--model.preset", "tiny-moe", "--train.global_batch_size", "8", "--train.steps", "3"]


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_moe_single_process_vs_ep2_tp2(dist_world, demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    one_dir, ep_dir = tmp_path / "one", tmp_path / "ep"
    assert main(_args(demo_cache_dir, one_dir, *MOE)) == 0
    assert "M active)" in capsys.readouterr().out  # the startup line: total and active parameters
    rows = _rows(one_dir)
    moe = rows[-1]["moe"]
    assert set(moe["aux_loss"]) == {f"layers.{i}" for i in range(2)}
    assert all(v > 0 for v in moe["aux_loss"].values()) and all(v > 0 for v in moe["z_loss"].values())
    assert all(moe["load_max"][k] >= moe["load_mean"][k] > 0 for k in moe["load_max"])
    assert moe["dropped_tokens"] == {"layers.0": 0, "layers.1": 0}  # dropless by default
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, ep_dir, *MOE, "--parallel.ep", "2", "--parallel.tp", "2"),
                                nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, ep = _losses(one_dir), _losses(ep_dir)
    assert sorted(one) == sorted(ep) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - ep[step]) < TOL, f"step {step}: ep=2 tp=2 loss {ep[step]} != {one[step]}"
    last = _rows(ep_dir)[-1]
    assert last["comm_bytes"]["ep"] > 0
    assert last["moe"]["load_max"] == moe["load_max"]  # global loads: the same tokens went to the same experts
