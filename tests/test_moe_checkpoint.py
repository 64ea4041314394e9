"""MoE checkpoints reshard across expert parallelism, online and offline: saved at ep 2 after two steps under
ZeRO-3 (expert parameters and states sharded over 'edp' 2, the rest over dp 4), then loaded at ep 4 (ZeRO-1)
and at ep 1 (one process), both straight from the saved directory and after `tools/reshard_checkpoint.py`
rewrote it (to one file of full tensors, and to tp 2, which cuts the shared experts); optimizer, shared
experts and DeepSeek's router bias included. The third step's loss and every parameter after it equal the
single-process run's (tolerances as in tests/test_moe_ep.py: 1e-5 on losses, 1e-4 on parameters after AdamW
steps)."""

from __future__ import annotations

from pathlib import Path

import torch

from megalite.checkpoint.sharded import load_sharded, read_index, save_sharded
from megalite.errors import ConfigError
from megalite.optim import build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import StepContext, train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import ADAMW, random_steps, tiny_train_cfg
from tests.test_moe_ep import MICRO, M, SEQ, _local_batches, _reference
from tools.reshard_checkpoint import main as reshard_main

STEPS = 3


def _cfg():
    # DeepSeek's router: its bias (a buffer, moved every step) must come back from the checkpoint too; a
    # shared expert: a tensor-parallel MLP inside the MoE layer, which the offline tool cuts at tp 2.
    return tiny_moe_cfg(seq_len=SEQ, num_layers=2, moe_router="deepseek", moe_bias_rate=0.01, moe_shared_experts=1)


def _data(dp_max: int = 4) -> list[torch.Tensor]:
    return random_steps(_cfg(), STEPS, MICRO * M * dp_max)


def _build(st: ParallelState, zero: int):
    engine = build_pipeline(_cfg(), st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
    model = engine.chunks[0]
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = StepContext.build(engine, st, torch.float32, tiny_train_cfg(STEPS), LossScaler(False))
    return model, opt, ctx


def _save_at_ep(rank: int, root: str, ep: int) -> None:
    st = moe_layout(ep=ep)
    model, opt, ctx = _build(st, 3)
    data = _data()
    for i in range(2):
        train_step(ctx, opt, _local_batches(data[i], st), i)
    save_sharded(root, 2, [model], opt, {}, st, keep=2)


def _resume_at_ep(rank: int, step_dir: str, ep: int) -> tuple[float, dict[str, torch.Tensor]]:
    st = moe_layout(ep=ep) if ep > 1 or torch.distributed.is_initialized() else ParallelState()
    model, opt, ctx = _build(st, 1 if ep > 1 else 0)
    load_sharded(Path(step_dir), [model], opt, st)
    opt.step_count = 2
    result = train_step(ctx, opt, _local_batches(_data()[2], st), 2)
    specs = named_param_specs(model, ConfigError)
    out = {}
    for name, value in opt.full_parameters().items():  # experts: put back at their global rows
        out[name] = (value, st.rank_in("ep") * value.shape[0] if specs[name].grads == EXPERT_PARALLEL else None)
    out.update({name: (buf.clone(), None) for name, buf in model.named_buffers() if name.endswith("router.bias")})
    return result.loss, out


def _resume_each(rank: int, step_dirs: list[str], ep: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    return [_resume_at_ep(rank, d, ep) for d in step_dirs]  # one task: the directories share the world


def _compare(what: str, loss: float, params: dict, ref, ref_loss: float) -> None:
    assert abs(loss - ref_loss) <= 1e-5, f"{what}: step 3 loss {loss} != {ref_loss}"
    ref_params = dict(ref.named_parameters()) | dict(ref.named_buffers())
    for name, (value, start) in params.items():
        want = ref_params[name].detach()
        if start is not None:
            want = want[start:start + value.shape[0]]
        if name in ("head.weight", "embedding.weight"):  # padded vocabulary rows are not stored (re-created as 0)
            value, want = value[:_cfg().vocab_size], want[:_cfg().vocab_size]
        err = (value - want).abs().max().item()
        assert err <= 1e-4, f"{what}: {name} off by {err:.2e}"


def test_checkpoint_ep2_to_ep4_and_ep1_online_and_offline(dist_world, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    dist_world(4).run(_save_at_ep, str(root), 2)  # world 4: dp 4, ep 2 (edp 2)
    saved = root / "step_00000002"
    full, tp2 = tmp_path / "full", tmp_path / "tp2"
    assert reshard_main(["--input", str(saved), "--output", str(full), "--unsharded", "--quiet"]) == 0
    assert reshard_main(["--input", str(saved), "--output", str(tp2), "--tp", "2", "--quiet"]) == 0
    assert sorted(read_index(full)["files"]) == ["rank_00000.safetensors"]
    shared_up = read_index(tp2)["tensors"]["param/layers.0.mlp.shared.up.weight"]["slabs"]
    assert {s["file"] for s in shared_up} == {"rank_00000.safetensors", "rank_00001.safetensors"}  # cut over tp
    ref, results = _reference(_cfg(), [d for d in _data()], None)
    ref_loss = results[2].loss
    # Each source is read at one target or two (every source at every target costs ~2x and finds nothing
    # more: the reader sees only slabs, whoever cut them).
    at_ep4 = {"online": saved, "offline, tp 2": tp2}
    for rank_results in dist_world(4).run(_resume_each, [str(d) for d in at_ep4.values()], 4):
        for how, rank_result in zip(at_ep4, rank_results):
            _compare(f"ep2 -> ep4 ({how})", *rank_result, ref, ref_loss)
    for how, d in {"online": saved, "offline, full tensors": full}.items():
        _compare(f"ep2 -> ep1, one process ({how})", *_resume_at_ep(0, str(d), 1), ref, ref_loss)
