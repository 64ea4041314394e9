"""Hugging Face MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen3ForCausalLM both ways through the tools: a
transformers-built tiny model (random init, save_pretrained) imported with tools/import_hf.py gives transformers'
logits and greedy generation in megalite, and tools/export_hf.py writes it back so that transformers loads the
very same tensors. Unsupported HF configs, and megalite models no HF architecture computes, are one line (exit 4)
and write nothing. (Training an import at ep 2 against transformers' loss: tests/test_hf_moe_train.py.)

Tolerance: fp32 and the same math in another order (SDPA vs transformers' eager attention; megalite's mixtral
router takes the softmax over the top-k logits, transformers' the softmax over all then renormalises): logits
of O(1) agree to ~1e-6, so 1e-5; a mapping error (q and k norms swapped, gate and up swapped, a wrong expert
or router row) moves them by O(0.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megalite.checkpoint.sharded import read_index
from megalite.errors import CheckpointError
from megalite.inference.generate import SamplingConfig, generate_ids
from megalite.inference.load import load_model
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.moe_utils import tiny_moe_cfg
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB, LOGITS_ATOL = 64, 1e-5
DIMS: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                            tie_word_embeddings=False)


def hf_model(kind: str, **over: Any) -> Any:
    """A transformers-built tiny model of `kind`, every weight (norms too) moved off its init, so a wrong
    mapping of any of them shows."""
    if kind != "mixtral":  # Qwen3's heads are wider than hidden / heads (128 in the released models)
        over = {"head_dim": 16, **over}
    if kind == "mixtral":
        cfg: Any = transformers.MixtralConfig(**DIMS, intermediate_size=24, num_local_experts=4,
                                              num_experts_per_tok=2, **over)
        model: Any = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":  # layer 0 dense (intermediate_size), layer 1 MoE: decoder_sparse_step 2
        cfg = transformers.Qwen3MoeConfig(**DIMS, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                          num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True, **over)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**DIMS, intermediate_size=48, **over)
        model = transformers.Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def assert_same_greedy(ours: GPT, theirs: Any) -> None:
    """megalite's KV-cached greedy decoder continues a prompt as transformers' generate does."""
    prompt = [3, 17, 5]
    greedy = list(generate_ids(ours, prompt, SamplingConfig(max_new_tokens=8)))
    hf_greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy == hf_greedy


def saved(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3"])
def test_import_export_against_transformers(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    theirs = hf_model(kind)
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(saved(theirs, tmp_path / "hf")), "--output", str(ckpt), "--quiet"]) == 0
    info = read_index(ckpt)["model"]
    assert info.get("qk_norm", False) == (kind != "mixtral")
    assert info.get("head_dim") == (None if kind == "mixtral" else 16)
    if kind == "qwen3_moe":
        assert (info["moe_router"], info["moe_renorm"], info["moe_first_dense"], info["moe_every"]) == \
            ("qwen3", True, 1, 2)
        _pretrain_takes_the_moe_shape(ckpt)
    ours, _ = load_model(ckpt)  # built from index.json alone, as tools/generate.py does
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids)[..., :VOCAB]
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"{kind}: megalite's logits differ from transformers' by {err:.2e}"

    assert_same_greedy(ours, theirs)

    out = tmp_path / "export"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(theirs).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(theirs)
    mine, orig = back.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(orig)
    for name, value in orig.items():
        assert torch.equal(mine[name], value), name  # fp32 copies: exact
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def _pretrain_takes_the_moe_shape(ckpt: Path) -> None:
    """pretrain.py --checkpoint.load of the import builds its MoE (model_shape), refusing a contradicting router."""
    from megalite.checkpoint.model_shape import apply_checkpoint_shape
    from megalite.config.schema import Config

    cfg = Config()
    cfg.checkpoint.load = str(ckpt)
    cfg = apply_checkpoint_shape(cfg, [])
    m, moe = cfg.model, cfg.moe
    assert (moe.experts, moe.top_k, moe.ffn_hidden_size, moe.router, m.qk_norm, moe.first_dense) == \
        (4, 2, 24, "qwen3", True, 1)
    cfg = Config()
    cfg.checkpoint.load, cfg.moe.router = str(ckpt), "mixtral"
    with pytest.raises(CheckpointError, match="moe.router='mixtral' but the checkpoint has 'qwen3'"):
        apply_checkpoint_shape(cfg, ["--moe.router", "mixtral"])


def test_megalite_moe_exports_as_mixtral_and_qwen3_moe(tmp_path: Path) -> None:
    """A megalite-built MoE (its own init, saved by megalite) loads into transformers and computes its logits."""
    from megalite.checkpoint.sharded import save_sharded

    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(2))
    # qwen3 with moe_renorm and no qk_norm (the tiny-moe preset's router, trained with a z-loss, a training loss
    # HF has no field for) is Mixtral's router: it exports as Mixtral.
    for router, qk, z in (("mixtral", False, 0.0), ("qwen3", True, 0.0), ("qwen3", False, 1e-3)):
        cfg = tiny_moe_cfg(seq_len=16, moe_router=router, qk_norm=qk, head_dim=8 if qk else 0, moe_z_loss=z,
                           moe_first_dense=int(qk),
                           moe_every=1 + int(qk), num_layers=2)
        st = ParallelState()
        model = GPT(cfg, st, seed=4).eval()
        ckpt = save_sharded(tmp_path / f"{router}{qk}", 1, model, None, {}, st, keep=0)
        out = tmp_path / f"hf_{router}{qk}"
        assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(ids)[..., :61], back(ids).logits, atol=LOGITS_ATOL, rtol=0)


BAD_IMPORTS = [  # (kind, config overrides, what the one line names)
    ("mixtral", {"sliding_window": 16}, "sliding-window attention is not supported"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise must be 0"),
    ("mixtral", {"n_shared_experts": 1}, "Mixtral has no shared experts (n_shared_experts)"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the 4 experts"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers must be empty"),
    ("qwen3_moe", {"scoring_func": "sigmoid"}, "the router's scoring_func 'sigmoid' is not softmax"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window attention"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 16}, "shared experts are not part of Qwen3-MoE"),
    ("qwen3_moe", {"head_dim": 7}, "Qwen3MoeForCausalLM config cannot be imported: head_dim=7 must be an even"),
    ("qwen3_moe", {"model_type": "qwen2_moe"}, "shared_expert_gate"),
    ("qwen3_moe", {"model_type": "deepseek_v3"}, "kv_lora_rank=None must be a positive integer"),
    ("qwen3_moe", {"model_type": "olmoe"}, "'olmoe' is not supported: import LlamaForCausalLM"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types other than full_attention"),
]


def test_bad_hf_configs_one_line_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {kind: saved(hf_model(kind), tmp_path / kind) for kind in ("mixtral", "qwen3_moe", "qwen3")}
    capsys.readouterr()  # transformers' progress bars
    for i, (kind, over, words) in enumerate(BAD_IMPORTS):
        src = tmp_path / f"bad{i}"
        src.mkdir()
        (src / "model.safetensors").symlink_to(base[kind] / "model.safetensors")
        cfg = json.loads((base[kind] / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, **over}))
        out = tmp_path / f"out{i}"
        code = import_main(["--input", str(src), "--output", str(out), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == CheckpointError.exit_code, (over, err)
        assert words in err and len(err.splitlines()) == 1, (over, err)
        assert not out.exists() and not list(tmp_path.glob(f"*out{i}*")), over


def test_export_refuses_what_no_hf_architecture_computes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megalite.checkpoint.sharded import save_sharded

    for i, (over, words) in enumerate([
            (dict(moe_router="deepseek"), "this one has moe.router=deepseek"),
            (dict(moe_router="mixtral", moe_shared_experts=1), "shared experts"),
            (dict(moe_router="qwen3", moe_renorm=False, qk_norm=False),
             "moe.router=qwen3, moe.renorm=False and qk_norm=False"),
            (dict(moe_router="mixtral", moe_first_dense=1), "dense layers (Mixtral's layers are all MoE)")]):
        st = ParallelState()
        cfg = tiny_moe_cfg(seq_len=16, **{"moe_z_loss": 0.0, **over})
        ckpt = save_sharded(tmp_path / f"c{i}", 1, GPT(cfg, st, seed=4), None, {}, st, keep=0)
        out = tmp_path / f"hf{i}"
        assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == CheckpointError.exit_code
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
        assert not out.exists()
