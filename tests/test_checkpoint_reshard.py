"""Sharded checkpoints: save at one layout, load at another, on 4 gloo ranks; faults on one process.

What is compared: every full (TP-gathered, unpadded) parameter and Adam moment after loading must equal
the saved run's bit for bit (the checkpoint stores fp32 and moves bytes, it does no arithmetic), and the
loss of the next training step must match the saved run continuing. At the same layout that loss is
identical; at another layout it agrees to LOSS_ATOL (see below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.checkpoint import sharded
from megalite.checkpoint.layout import layout_for, layout_of, local_shape_for, model_info
from megalite.checkpoint.sharded import find, load_sharded, save_sharded
from megalite.errors import CheckpointError
from megalite.model.gpt import GPT
from megalite.optim.reference import ReferenceOptimizer
from megalite.parallel.param_spec import Tied, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import train_step
from tests.parallel_utils import layout, reference_optimizer, step_context, tiny_model_cfg, tiny_train_cfg

GLOBAL, VOCAB = 8, 67  # 67 is prime: padded to 68 at tp 1, 72 at tp 2, 80 at tp 4 (make_vocab_divisible_by=4)
# A different layout splits the same sums differently (TP partial matmuls, the grad-norm sum per stage), so
# the next step's loss moves by fp32 round-off: ~1e-7 relative on a loss of ~4.2; 1e-5 leaves room for a
# few ulps of accumulated difference and is far below what a wrong or missing slice causes (>1e-3).
LOSS_ATOL = 1e-5


def _setup(lay: tuple[int, int, int, bool], cfg, seed: int):
    tp, pp, vpp, sp = lay
    st = layout(tp, pp, sp=sp)
    engine = build_pipeline(cfg, st, seed=seed, micro_batch_size=1, dtype=torch.float32, stages=StagePlan(vpp=vpp))
    model = nn.ModuleList(engine.chunks)
    info = model_info(cfg)
    for chunk in engine.chunks:  # the offline tool's name rules agree with the real model
        specs = named_param_specs(chunk, CheckpointError)
        for name, p in chunk.named_parameters():
            want = layout_of(name, specs[name].layout)
            assert layout_for(name, info) == want, name
            g = tuple(p.shape)
            if want.kind == "row":
                g = (p.shape[0], p.shape[1] * tp)
            elif want.split:
                g = (VOCAB if want.kind == "vocab" else p.shape[0] * tp,) + tuple(p.shape[1:])
            assert local_shape_for(name, g, want, tp, info) == tuple(p.shape), name
    return st, engine, model, reference_optimizer(model, st)


def _step(st, engine, opt, data: torch.Tensor, i: int, vpp: int) -> float:
    per = GLOBAL // st.dp
    mine = [(data[j:j + 1, :-1], data[j:j + 1, 1:]) for j in range(st.dp_rank * per, (st.dp_rank + 1) * per)]
    schedule = "interleaved" if vpp > 1 else "1f1b"
    return train_step(step_context(engine, st, torch.float32, tiny_train_cfg(3), schedule),
                      opt, mine, i).loss


def _full(model: nn.ModuleList, opt, st) -> dict[str, torch.Tensor]:
    """Every logical tensor, TP-gathered with the existing `unshard` (independent of the checkpoint code),
    collected from all stages."""
    states = opt.param_states()
    out: dict[str, torch.Tensor] = {}
    for chunk in model:
        specs = named_param_specs(chunk, CheckpointError)
        for name, p in chunk.named_parameters():
            if specs[name].tied is Tied.HEAD_COPY:
                continue
            for kind, t in [("param", p)] + [(k, v) for k, v in states.get(name, {}).items() if k != "step"]:
                full = unshard(t.detach(), specs[name].layout, st)
                out[f"{kind}/{name}"] = full[:VOCAB] if name in ("embedding.weight", "head.weight") else full
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, out if st.tp_rank == 0 and st.dp_rank == 0 else {})
    return {k: v for d in gathered for k, v in d.items()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: tensors differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max {(a[k] - b[k]).abs().max().item():.2e})"


def _save_then_load(rank: int, a: tuple, b: tuple, arch: str, root: str, tool: bool) -> dict:
    cfg = tiny_model_cfg(arch, num_layers=4, vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, VOCAB, (GLOBAL, cfg.seq_len + 1), generator=gen) for _ in range(2)]
    st, engine, model, opt = _setup(a, cfg, seed=5)
    _step(st, engine, opt, data[0], 0, a[2])
    rng = {"default": torch.get_rng_state()}
    save_sharded(root, 1, model, opt, {"sampler": {"consumed_samples": GLOBAL}, "rng": rng}, st, keep=2)
    saved = _full(model, opt, st)
    loss_a = _step(st, engine, opt, data[1], 1, a[2])
    st_b, engine_b, model_b, opt_b = _setup(b, cfg, seed=9)  # another init: loading must overwrite all of it
    extra = load_sharded(find("latest", root), model_b, opt_b, st_b)
    _assert_equal(saved, _full(model_b, opt_b, st_b), "direct load")
    if tool:  # the offline tool's outputs load to exactly the same tensors
        from tools.reshard_checkpoint import main as reshard_main

        if rank == 0:
            for out, args in (("tp1pp2", ["--tp", "1", "--pp", "2"]), ("full", ["--unsharded"])):
                assert reshard_main(["--input", root, "--output", f"{root}/../{out}", "--quiet"] + args) == 0
        dist.barrier()
        for out in ("tp1pp2", "full"):
            _, _, model_t, opt_t = _setup(b, cfg, seed=13)
            load_sharded(Path(root).parent / out, model_t, opt_t, st_b)
            _assert_equal(saved, _full(model_t, opt_t, st_b), f"tool output {out}")
    loss_b = _step(st_b, engine_b, opt_b, data[1], 1, b[2])
    rng_ok = extra["rng"] is not None and torch.equal(extra["rng"]["default"], rng["default"])
    return {"loss_a": loss_a, "loss_b": loss_b, "step": extra["step"], "sampler": extra["sampler"],
            "rng_restored": rng_ok, "rng_none": extra["rng"] is None}


CASES = [  # (arch, layout A, layout B) as (tp, pp, vpp, sp) on 4 ranks; dp = 4 / (tp * pp)
    ("llama", (2, 1, 1, True), (1, 1, 1, False)),   # tp2 + sp -> tp1 (dp 2 -> 4)
    ("gpt2", (1, 1, 1, False), (4, 1, 1, False)),   # tp1 -> tp4: padded vocab 68 -> 80, tied embedding
    ("gpt2", (1, 2, 1, False), (1, 1, 1, False)),   # pp2 -> pp1: the tied head copy disappears
    ("gpt2", (1, 2, 2, False), (1, 2, 1, False)),   # vpp2 -> vpp1
    ("llama", (2, 2, 1, False), (1, 2, 1, False)),  # tp2 pp2 -> tp1 pp2 dp2, and through the offline tool
]


@pytest.mark.parametrize("arch,a,b", CASES)
def test_reshard_load(dist_world, tmp_path: Path, arch: str, a: tuple, b: tuple) -> None:
    root = tmp_path / "ckpt"
    out = dist_world(4).run(_save_then_load, a, b, arch, str(root), a == (2, 2, 1, False))
    r = out[0]
    assert r["step"] == 1 and r["sampler"] == {"consumed_samples": GLOBAL}
    assert r["rng_none"], "a layout change must not restore per-rank RNG states"
    assert abs(r["loss_a"] - r["loss_b"]) <= LOSS_ATOL, (r["loss_a"], r["loss_b"])


def test_same_layout_is_bitwise(dist_world, tmp_path: Path) -> None:
    lay = (2, 2, 1, True)
    out = dist_world(4).run(_save_then_load, lay, lay, "gpt2", str(tmp_path / "ckpt"), False)
    assert all(r["loss_a"] == r["loss_b"] for r in out), [(r["loss_a"], r["loss_b"]) for r in out]
    assert all(r["rng_restored"] for r in out)


# ----------------------------------------------------------------------------- faults, one process
def _tiny(seed: int = 5, **kw) -> tuple[GPT, ReferenceOptimizer, ParallelState]:
    st = ParallelState()
    model = GPT(tiny_model_cfg("llama", vocab_size=VOCAB, **kw), st, seed=seed)
    return model, reference_optimizer(model, st), st


def test_corrupt_missing_and_mismatched(tmp_path: Path) -> None:
    model, opt, st = _tiny()
    path = save_sharded(tmp_path, 3, model, opt, {}, st, keep=0)
    fresh, opt2, _ = _tiny(seed=7)
    extra = load_sharded(path, fresh, opt2, st)
    assert extra["step"] == 3 and not extra["has_optimizer_state"]  # no step taken: the optimizer starts fresh
    for (name, x), y in zip(model.named_parameters(), fresh.parameters()):
        # The head's padded vocab rows start random and are never used (masked out of the softmax); the
        # checkpoint keeps only real rows, so a load re-creates the padding as zeros.
        assert torch.equal(x[:VOCAB], y[:VOCAB]), name
    wider, opt3, _ = _tiny(hidden_size=64)
    with pytest.raises(CheckpointError, match=r"hidden_size=32.*hidden_size=64"):
        load_sharded(path, wider, opt3, st)
    file = path / "rank_00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is corrupt"):
        load_sharded(path, fresh, opt2, st)
    file.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(CheckpointError, match="rank_00000.safetensors"):
        load_sharded(path, fresh, opt2, st)
    file.unlink()
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is missing"):
        load_sharded(path, fresh, opt2, st)


def test_partial_save_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, st = _tiny()
    save_sharded(tmp_path, 1, model, opt, {"sampler": {"consumed_samples": 1}}, st, keep=2)
    real_write = sharded.StreamingWriter.write
    calls = {"n": 0}

    def dies_half_way(self, key: str, tensor: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed during the save")  # what a SIGKILL between tensors leaves behind
        real_write(self, key, tensor)

    monkeypatch.setattr(sharded.StreamingWriter, "write", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(tmp_path, 2, model, opt, {"sampler": {"consumed_samples": 2}}, st, keep=2)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    fresh, opt2, _ = _tiny(seed=7)
    assert load_sharded(find("latest", str(tmp_path)), fresh, opt2, st)["sampler"] == {"consumed_samples": 1}
    save_sharded(tmp_path, 2, model, opt, {}, st, keep=1)  # the next save cleans up and prunes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]
