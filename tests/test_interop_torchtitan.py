"""torchtitan's Llama 3 DCP checkpoints both ways (tools/convert_checkpoint.py --from/--to torchtitan).

A tiny torchtitan Llama 3 (its own model code and config classes) is saved the way torchtitan's CheckpointManager
saves it (model keys flattened in from its `ModelWrapper`, the optimizer through its `get_flat_optim_state_dict`,
one `dcp.save`), converted, and:
- the converted megalite model's logits equal torchtitan's on the same tokens (fp32; the two compute the same
  function with different kernels and RoPE layouts, so they agree to round-off: atol 2e-5 on logits of size ~1,
  while one misplaced row of wq/wk or a wrong RoPE permutation moves them by > 1e-2);
- torchtitan -> megalite -> torchtitan loads back into torchtitan's model and AdamW (its `load_flat_optim_state_dict`)
  with every parameter and Adam moment bit-equal, and megalite -> torchtitan -> megalite is bit-exact.
Installed with `pip install --no-deps torchtitan` plus spmd_types, tyro and docstring_parser (its other
dependencies are for its data loaders and logging); the module is skipped, saying so, where it is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (pip install --no-deps torchtitan "
                    "spmd_types tyro docstring_parser)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.checkpoint import ModelWrapper  # noqa: E402
from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, load_flat_optim_state_dict  # noqa: E402

from megalite.checkpoint.interop.source import from_megalite  # noqa: E402
from megalite.inference.load import load_model  # noqa: E402
from tests.test_interop_dcp import _all, saved  # noqa: E402,F401  (the tiny megalite checkpoint fixture)
from tools.convert_checkpoint import main as convert  # noqa: E402

DIM, HEADS, KV, LAYERS, VOCAB, HIDDEN, THETA = 32, 4, 2, 2, 61, 64, 10000.0


def _titan(fuse_qkv: bool, seed: int) -> torch.nn.Module:
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    cfg = L.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(fuse_qkv=fuse_qkv, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV,
                                      hidden_dim=HIDDEN, attn_backend="flex",
                                      rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=THETA)))
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def _titan_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():  # flex attention has no CPU backward; the forward is all this needs
        return model(ids, pos, model.get_attention_masks(pos))


def _adam(model: torch.nn.Module) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(list(model.named_parameters()), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # synthetic gradients: what matters is Adam state of the real shapes and names
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


def _save_titan(model: torch.nn.Module, opt: torch.optim.Optimizer, out: Path) -> None:
    """What torchtitan's CheckpointManager.dcp_save writes: model keys at the top level, the flat optimizer."""
    dcp.save({**ModelWrapper(model).state_dict(), "optimizer": get_flat_optim_state_dict(opt)}, checkpoint_id=str(out),
             no_dist=True)


def _args(path: Path) -> Path:
    path.write_text(json.dumps({"n_heads": HEADS, "n_kv_heads": KV, "norm_eps": 1e-5, "rope_theta": THETA,
                                "max_seq_len": 64}))
    return path


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_torchtitan_to_megalite_same_logits_and_back_loads_in_torchtitan(tmp_path: Path, fuse_qkv: bool) -> None:
    model = _titan(fuse_qkv, seed=3)
    opt = _adam(model)
    _save_titan(model, opt, tmp_path / "titan")
    assert convert(["--from", "torchtitan", "--to", "megalite", "--input", str(tmp_path / "titan"), "--output",
                    str(tmp_path / "ml"), "--model-args", str(_args(tmp_path / "args.json")), "--quiet"]) == 0
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(tmp_path / "ml")
    with torch.no_grad():
        logits = ours(ids)[..., :VOCAB]  # every position
    torch.testing.assert_close(logits, _titan_logits(model, ids), rtol=0, atol=2e-5)
    # ... and back: torchtitan's own loaders restore every parameter and moment exactly.
    assert convert(["--from", "megalite", "--to", "torchtitan", "--input", str(tmp_path / "ml"), "--output",
                    str(tmp_path / "titan2")] + (["--torchtitan-fused-qkv"] if fuse_qkv else [])) == 0
    fresh = _titan(fuse_qkv, seed=9)
    fresh_opt = _adam(fresh)  # other values, same structure: loading must overwrite all of it
    want = {"model": ModelWrapper(model).state_dict(), "optimizer": get_flat_optim_state_dict(opt)}
    wrapper = ModelWrapper(fresh)
    template = {**wrapper.state_dict(), "optimizer": get_flat_optim_state_dict(fresh_opt)}
    dcp.load(template, checkpoint_id=str(tmp_path / "titan2"), no_dist=True)  # as torchtitan's CheckpointManager.load
    wrapper.load_state_dict(template)
    load_flat_optim_state_dict(fresh_opt, template["optimizer"])
    for k, v in want["model"].items():
        assert torch.equal(fresh.state_dict()[k], v), k
    got_state = get_flat_optim_state_dict(fresh_opt)
    for k, v in want["optimizer"].items():
        if isinstance(v, torch.Tensor) and not k.startswith("param_groups."):
            assert torch.equal(got_state[k], v), k


def test_megalite_to_torchtitan_to_megalite_is_bit_exact(saved: Path, tmp_path: Path) -> None:  # noqa: F811
    assert convert(["--from", "megalite", "--to", "torchtitan", "--input", str(saved), "--output",
                    str(tmp_path / "titan")]) == 0
    assert convert(["--from", "torchtitan", "--to", "megalite", "--input", str(tmp_path / "titan"), "--output",
                    str(tmp_path / "back"), "--tp", "2", "--quiet"]) == 0
    want, got = _all(saved), _all(tmp_path / "back")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    back = from_megalite(tmp_path / "back")
    assert back.step == 2 and back.optimizer_step == 2.0
    back.close()


def test_torchtitan_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _titan(False, seed=3)
    _save_titan(model, _adam(model), tmp_path / "titan")
    out = ["--from", "torchtitan", "--to", "megalite", "--input", str(tmp_path / "titan"), "--output", str(tmp_path / "o")]
    assert convert(out) == 4 and "--model-args" in capsys.readouterr().err  # no dims file
    (tmp_path / "wrong.json").write_text(json.dumps({"n_heads": HEADS, "dim": 64}))
    assert convert(out + ["--model-args", str(tmp_path / "wrong.json")]) == 4
    assert "dim=64 but the tensors have 32" in capsys.readouterr().err
    for bad, text in (({"n_heads": "4"}, "n_heads is '4', not a positive integer"), ([HEADS], "not a JSON object"),
                      ({"n_heads": 3}, "n_heads=3, n_kv_heads=3 do not fit dim=32"), ("{", "is not valid JSON")):
        (tmp_path / "bad.json").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        assert convert(out + ["--model-args", str(tmp_path / "bad.json")]) == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
    (tmp_path / "scaled.json").write_text(json.dumps({"n_heads": HEADS, "rope_scaling": "llama"}))
    assert convert(out + ["--model-args", str(tmp_path / "scaled.json")]) == 4
    assert "rope_scaling 'llama'" in capsys.readouterr().err
    moe = {**ModelWrapper(model).state_dict(), "layers.0.moe.experts.w1": torch.zeros(2, DIM, HIDDEN)}
    dcp.save(moe, checkpoint_id=str(tmp_path / "moe"), no_dist=True)  # a torchtitan MoE model's expert weights
    assert convert(out[:-4] + ["--input", str(tmp_path / "moe"), "--output", str(tmp_path / "o"),
                               "--model-args", str(_args(tmp_path / "args.json"))]) == 4
    err = capsys.readouterr().err.strip()
    assert "layers.0.moe.experts.w1 is a mixture-of-experts tensor" in err and len(err.splitlines()) == 1, err
    qk = {**ModelWrapper(model).state_dict(), "layers.0.attention.q_norm.weight": torch.ones(DIM // HEADS)}
    dcp.save(qk, checkpoint_id=str(tmp_path / "qk"), no_dist=True)  # a Qwen3-style extra: never dropped silently
    assert convert(out[:-4] + ["--input", str(tmp_path / "qk"), "--output", str(tmp_path / "o"),
                               "--model-args", str(_args(tmp_path / "args.json"))]) == 4
    err = capsys.readouterr().err.strip()
    assert "tensor layers.0.attention.q_norm.weight has no place" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_megalite_models_torchtitan_lacks_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Qwen3-style megalite model (q/k norms) or a MoE has tensors torchtitan's dense Llama 3 has no place for:
    refused in one line, nothing written (before the check they were dropped without a word)."""
    import torch.nn as nn

    from megalite.checkpoint.sharded import find, save_sharded
    from megalite.model.gpt import GPT
    from megalite.parallel.state import ParallelState
    from tests.moe_utils import tiny_moe_cfg
    from tests.parallel_utils import tiny_model_cfg

    for name, cfg, text in (("qk", tiny_model_cfg("llama", qk_norm=True), "layers.0.attn.k_norm.weight"),
                            ("moe", tiny_moe_cfg("llama"), "layers.0.")):
        model = nn.ModuleList([GPT(cfg, ParallelState(), seed=1)])
        save_sharded(tmp_path / name, 1, model, None, {}, ParallelState(), keep=1)
        src = find("latest", str(tmp_path / name))
        assert convert(["--from", "megalite", "--to", "torchtitan", "--input", str(src), "--output",
                        str(tmp_path / f"{name}_titan")]) == 4
        err = capsys.readouterr().err.strip()
        assert "which torchtitan's Llama 3 has no place for" in err and text in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / f"{name}_titan").exists()


def test_torchtitan_args_are_checked_against_the_tensors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every declared dim is compared with the tensors, types are checked, a tied head must be the embedding,
    and optimizer state megalite cannot hold is refused unless --weights-only: one line, exit 4, nothing
    written (before: k mangled and v dropped, lm_head dropped, "false" read as true, rows cut)."""
    model = _titan(False, seed=3)
    _save_titan(model, _adam(model), tmp_path / "titan")
    base = {"n_heads": HEADS, "n_kv_heads": KV, "norm_eps": 1e-5, "rope_theta": THETA, "max_seq_len": 64}

    def refused(src: Path, args: dict, text: str, *flags: str) -> None:
        (tmp_path / "a.json").write_text(json.dumps(args))
        assert convert(["--from", "torchtitan", "--to", "megalite", "--input", str(src), "--output",
                        str(tmp_path / "o"), "--model-args", str(tmp_path / "a.json"), *flags]) == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "o").exists()

    titan = tmp_path / "titan"
    refused(titan, dict(base, n_kv_heads=1), "wk.weight is [16, 32] but the model args (n_kv_heads=1) make it [8, 32]")
    refused(titan, dict(base, enable_weight_tying="false"), "enable_weight_tying is 'false', not true or false")
    refused(titan, dict(base, enable_weight_tying=True), "lm_head.weight differs from tok_embeddings.weight")
    refused(titan, dict(base, n_kv_heads=True), "n_kv_heads is True, not a positive integer")
    refused(titan, dict(base, max_seq_len=10**12), "max_seq_len is 1000000000000, not a positive integer")
    refused(titan, dict(base, step="abc"), "step is 'abc', not an integer")
    refused(titan, dict(base, step=-5), "step is -5, not an integer")
    wide = ModelWrapper(model).state_dict()  # layer 1 twice as wide as layer 0
    for w, shape in (("w1", (2 * HIDDEN, DIM)), ("w3", (2 * HIDDEN, DIM)), ("w2", (DIM, 2 * HIDDEN))):
        wide[f"layers.1.feed_forward.{w}.weight"] = torch.zeros(shape)
    dcp.save(wide, checkpoint_id=str(tmp_path / "wide"), no_dist=True)
    refused(tmp_path / "wide", base, "layers.1.feed_forward.w1.weight is [128, 32] but the model args (hidden_dim=64")
    sgd = torch.optim.SGD(list(model.named_parameters()), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    _save_titan(model, sgd, tmp_path / "sgd")
    refused(tmp_path / "sgd", base, "optimizer entry optimizer.state.")
    (tmp_path / "a.json").write_text(json.dumps(base))
    assert convert(["--from", "torchtitan", "--to", "megalite", "--input", str(tmp_path / "sgd"), "--output",
                    str(tmp_path / "o"), "--model-args", str(tmp_path / "a.json"), "--weights-only", "--quiet"]) == 0
    err = capsys.readouterr().err.strip()
    assert "not carried: the optimizer state (--weights-only)" in err and len(err.splitlines()) == 1, err
