"""tools/convert_checkpoint.py carries every tensor, buffer and optimizer state, or refuses (issue 44, item 1).

The fixture is the hardest case megalite writes: a DeepSeek-routed MoE model (its routers' learned correction
bias is a buffer, not a parameter) trained two steps with Muon (its momentum sits in the "exp_avg" slot, with
"exp_avg_sq" zero on Muon's matrices; AdamW's moments on the rest). Every direction that can hold it round-trips
bit for bit, every logical tensor compared; the ones that cannot refuse in one line (exit 4) unless
--weights-only, and the success line names what was not carried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpoint.interop.source import from_megalite
from megalite.checkpoint.sharded import find, save_sharded
from megalite.optim import build_distributed_optimizer
from megalite.optim.config import MuonConfig, OptimizerConfig
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import train_step
from tests.moe_utils import tiny_moe_cfg

MUON = OptimizerConfig(name="muon", weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8)
from tests.parallel_utils import micro_batches, random_steps, step_context, tiny_train_cfg
from tests.test_interop_dcp import _all
from tools.convert_checkpoint import main as convert


@pytest.fixture(scope="module")
def muon_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_moe_cfg("llama", moe_router="deepseek", moe_bias_rate=1e-3, num_layers=2)
    st = ParallelState()
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=1, dtype=torch.float32)
    opt = build_distributed_optimizer(engine.chunks, st, 0, dtype=torch.float32, optimizer=MUON,
                                      muon=MuonConfig(momentum=0.95))
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(2))
    for i, d in enumerate(random_steps(cfg, 2, 2)):
        train_step(ctx, opt, micro_batches(d, 1), i)
    for name, buf in engine.chunks[0].named_buffers():  # the learned bias: make sure no conversion can pass by luck
        if name.endswith("router.bias"):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(len(name))))
    root = tmp_path_factory.mktemp("carry")
    extra = {"config": {"train": {"optimizer": "muon", "lr": 0.01}}, "sampler": {"consumed_samples": 4}}
    save_sharded(root / "ckpt", 2, engine.chunks, opt, extra, st, keep=1)
    return find("latest", str(root / "ckpt"))  # type: ignore[return-value]


def _one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _same(a: Path, b: Path) -> None:
    want, got = _all(a), _all(b)
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_the_fixture_has_what_must_travel(muon_moe: Path) -> None:
    tensors = _all(muon_moe)
    buffers = [k for k in tensors if k.startswith("buffer/")]
    assert buffers and all(tensors[k].abs().sum() > 0 for k in buffers)
    zero_sq = [k for k in tensors if k.startswith("exp_avg_sq/") and not tensors[k].any()]  # Muon's matrices
    assert zero_sq and len(zero_sq) < len([k for k in tensors if k.startswith("exp_avg_sq/")])


def test_megalite_dcp_megalite_carries_buffers_and_muon_state(muon_moe: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "dcp"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(muon_moe), "--output", str(out)]) == 0
    assert "wrote" in _one_line(capsys)
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(out), "--output", str(tmp_path / "back"),
                    "--tp", "2", "--quiet"]) == 0
    _same(muon_moe, tmp_path / "back")
    # What a plain DCP reader sees: the router bias in "model" (as torch's state dict holds a buffer), Muon's
    # momentum under torch.optim.Muon's name, so an AdamW cannot take it for its first moment.
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert any(k.startswith("model.") and k.endswith("router.bias") for k in keys)
    muon = [k for k in keys if k.endswith(".momentum_buffer")]
    assert muon and all(k.replace("momentum_buffer", "exp_avg_sq") not in keys for k in muon)
    assert any(k.endswith("embedding.weight.exp_avg_sq") for k in keys)  # AdamW's part keeps both moments
    assert convert(["--from", "megalite", "--to", "megalite", "--input", str(muon_moe), "--output",
                    str(tmp_path / "re"), "--pp", "2", "--quiet"]) == 0  # a reshard carries it all too
    _same(muon_moe, tmp_path / "re")


def test_muon_state_into_torchtitans_adamw_is_refused_unless_weights_only(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from tests.parallel_utils import tiny_model_cfg

    cfg = tiny_model_cfg("llama", num_layers=2)
    st = ParallelState()
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=1, dtype=torch.float32)
    opt = build_distributed_optimizer(engine.chunks, st, 0, dtype=torch.float32, optimizer=MUON,
                                      muon=MuonConfig(momentum=0.95))
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(1))
    train_step(ctx, opt, micro_batches(random_steps(cfg, 1, 2)[0], 1), 0)
    save_sharded(tmp_path / "ck", 1, engine.chunks, opt, {"config": {"train": {"optimizer": "muon"}}}, st, keep=1)
    src = find("latest", str(tmp_path / "ck"))
    args = ["--from", "megalite", "--to", "torchtitan", "--input", str(src), "--output", str(tmp_path / "t")]
    capsys.readouterr()
    assert convert(args) == 4
    assert "Muon's" in _one_line(capsys) and not (tmp_path / "t").exists()
    save_sharded(tmp_path / "bare", 1, engine.chunks, opt, {}, st, keep=1)  # no run config: the data tells
    assert convert(["--from", "megalite", "--to", "torchtitan", "--input", str(find("latest", str(tmp_path / "bare"))),
                    "--output", str(tmp_path / "t")]) == 4
    assert "has no second moment" in _one_line(capsys) and not (tmp_path / "t").exists()
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(find("latest", str(tmp_path / "bare"))),
                    "--output", str(tmp_path / "d")]) == 4
    assert "has no second moment" in _one_line(capsys) and not (tmp_path / "d").exists()
    assert convert(args + ["--weights-only"]) == 0
    err = _one_line(capsys)
    assert "not carried: the muon optimizer state (--weights-only)" in err and "config" in err, err
    assert not any(k.startswith("optimizer.state.") for k in dcp.FileSystemReader(str(tmp_path / "t")).read_metadata()
                   .state_dict_metadata)
    assert convert(["--from", "torchtitan", "--to", "megalite", "--input", str(tmp_path / "t"), "--output",
                    str(tmp_path / "back"), "--quiet"]) == 0
    want, got = _all(src), _all(tmp_path / "back")  # the weights, bit for bit; no optimizer state at all
    assert sorted(got) == sorted(k for k in want if k.startswith("param/"))
    assert all(torch.equal(want[k], got[k]) for k in got)


def test_dcp_with_state_megalite_cannot_place_is_refused(muon_moe: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """A DCP input with an extra tensor (a foreign optimizer's state, a buffer the entry does not list as one)
    is refused, not dropped; a bad megalite entry (step, dims, buffers) is one line, nothing written."""
    out = tmp_path / "dcp"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(muon_moe), "--output", str(out)]) == 0
    capsys.readouterr()
    meta = json.loads(dcp_object(out))
    cases = [({"model": {"w": torch.zeros(2)}, "optimizer": {"state": {"w": {"max_exp_avg_sq": torch.zeros(2)}}}},
              meta["model"], "optimizer.state.w.max_exp_avg_sq has no place"),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, step="abc"), "step='abc' must be an integer"),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, step=-5), "step=-5 must be an integer"),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, model=dict(meta["model"], seq_len=10**12)), "seq_len="),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, extra=[1]), "extra=[1] must be a JSON object"),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, buffers="w"), "buffers='w' must be a list"),
             ({"model": {"w": torch.zeros(2)}}, dict(meta, model=dict(meta["model"], tie_embeddings="false")),
              "tie_embeddings='false' must be true or false")]
    for i, (sd, m, text) in enumerate(cases):
        crafted = tmp_path / f"c{i}"
        entry = m if "format" in m else dict(meta, model=m)
        dcp.save({**sd, "megalite": json.dumps(entry)}, checkpoint_id=str(crafted), no_dist=True)
        assert convert(["--from", "dcp", "--to", "megalite", "--input", str(crafted), "--output",
                        str(tmp_path / "o")]) == 4
        assert text in _one_line(capsys) and not (tmp_path / "o").exists()
    md = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    sd = {"model": {k[len("model."):]: torch.zeros(tuple(v.size)) for k, v in md.items() if k.startswith("model.")}}
    name = next(k for k in sd["model"] if k.endswith("norm1.weight"))
    sd["optimizer"] = {"state": {name: {"exp_avg": torch.zeros(sd["model"][name].shape)}}}  # one moment of two
    dcp.save({**sd, "megalite": json.dumps(meta)}, checkpoint_id=str(tmp_path / "half"), no_dist=True)
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(tmp_path / "half"), "--output",
                    str(tmp_path / "o")]) == 4
    assert f"exp_avg/{name} without its other moment" in _one_line(capsys) and not (tmp_path / "o").exists()
    dcp.save({"model": {"w": torch.zeros(2)}, "megalite": json.dumps(dict(meta, optimizer_step=None))},
             checkpoint_id=str(tmp_path / "other"), no_dist=True)
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(tmp_path / "other"), "--output",
                    str(tmp_path / "o")]) == 4  # a 'model' tensor that is not the model's: the write refuses
    _one_line(capsys)
    assert not (tmp_path / "o").exists()


def dcp_object(path: Path) -> str:
    from megalite.checkpoint.interop.dcp import load_object

    return load_object(path, "megalite")


def test_megalite_reader_names_dropped_rng(muon_moe: Path) -> None:
    src = from_megalite(muon_moe)
    src.close()
    assert src.dropped == [] or src.dropped == ["per-rank RNG states (a new layout re-seeds them)"]
