"""Hugging Face export/import: transformers computes megalite's logits; import(export(x)) == x exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import load_sharded, read_index, save_sharded
from megalite.checkpoint.storage import SlabReader
from megalite.errors import CheckpointError
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB = 67
# Same weights, same fp32 math, different op order (HF's eager attention is matmul + softmax, megalite's is
# SDPA; HF's gelu_new is the tanh formula written out): logits of O(1) agree to a few ulps, ~1e-6. 1e-5 is
# far below any mapping error (a swapped q/k, an untransposed Conv1D or gate/up give O(0.1) differences).
LOGITS_ATOL = 1e-5


def _all_params(path: Path) -> dict[str, torch.Tensor]:
    index = read_index(path)
    reader = SlabReader(path, index)
    return {k: reader.read_region(k, (0,) * len(v["shape"]), tuple(v["shape"]))
            for k, v in index["tensors"].items() if k.startswith("param/")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_load_import(tmp_path: Path, arch: str) -> None:
    cfg = tiny_model_cfg(arch, vocab_size=VOCAB, seq_len=16)
    st = ParallelState()
    model = GPT(cfg, st, seed=5).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move norms off 1 and biases off 0, so a wrong mapping of them shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, st, keep=0)
    hf_dir = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(hf_dir), "--quiet"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, cfg.seq_len), generator=gen)
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf_model(ids).logits
    err = (ours - theirs).abs().max().item()
    assert err <= LOGITS_ATOL, f"{arch}: transformers logits differ from megalite's by {err:.2e}"

    back = tmp_path / "back"
    assert import_main(["--input", str(hf_dir), "--output", str(back), "--quiet"]) == 0
    before, after = _all_params(ckpt), _all_params(back)
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    fresh = GPT(cfg, st, seed=9).eval()
    extra = load_sharded(back, fresh, None, st)
    assert extra["step"] == 0 and not extra["has_optimizer_state"]
    with torch.no_grad():
        assert torch.equal(fresh(ids)[..., :VOCAB], ours)


def test_import_refuses_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    assert import_main(["--input", str(tmp_path), "--output", str(tmp_path / "out"), "--quiet"]) == \
        CheckpointError.exit_code


# ------------------------------------------------------------------------------- tokenizer and bf16 export
def _export_model(tmp_path: Path, vocab: int) -> tuple[GPT, Path]:
    cfg = tiny_model_cfg("llama", vocab_size=vocab, seq_len=16)
    model = GPT(cfg, ParallelState(), seed=5).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model, save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)


@pytest.mark.parametrize("kind", ["gpt2like", "llamalike", "tiktoken", "sentencepiece"])
def test_export_with_tokenizer_same_ids_and_logits(tmp_path: Path, kind: str) -> None:
    from megalite.data import load_tokenizer, train_tokenizer
    from tests.tokenizer_utils import TEXTS, train_hf_bpe, write_tiktoken

    pytest.importorskip("tiktoken")
    if kind == "tiktoken":
        tok_path = write_tiktoken(tmp_path / "mini.tiktoken")
    elif kind == "sentencepiece":
        (tmp_path / "c.txt").write_text("".join(TEXTS) * 20)
        tok_path = Path(train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "spm"), vocab_size=400))
    else:
        tok_path = train_hf_bpe(tmp_path / kind / "tokenizer.json", llama_style=kind == "llamalike")
    tok = load_tokenizer(str(tok_path))
    model, ckpt = _export_model(tmp_path, tok.vocab_size)
    out = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--tokenizer", str(tok_path), "--quiet"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for text in TEXTS + ["tabs\tand\r\nCRLF  end "]:
        ids = tok.encode(text)
        assert hf_tok(text, add_special_tokens=False).input_ids == ids, (kind, text)
        framed = ([tok.bos_id] if tok.add_bos else []) + ids  # AutoTokenizer's default framing = megalite's
        assert hf_tok(text).input_ids == framed, (kind, text)
        assert hf_tok.decode(ids) == text
    assert hf_model.config.eos_token_id == tok.eod_id and hf_tok.eos_token_id == tok.eod_id
    batch = hf_tok(TEXTS[0], return_tensors="pt").input_ids[:, :16]
    with torch.no_grad():
        err = (model(batch)[..., :tok.vocab_size] - hf_model(batch).logits).abs().max().item()
    assert err <= LOGITS_ATOL, f"{kind}: transformers logits differ from megalite's by {err:.2e}"


def test_export_bf16_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    model, ckpt = _export_model(tmp_path, VOCAB)
    out = tmp_path / "bf16"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--dtype", "bf16", "--quiet"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids)[..., :VOCAB], hf_model(ids).logits
    # bf16 keeps 8 mantissa bits: each weight moves by <= 2^-9 relative, logits of O(1) by ~1e-2. The
    # bound shows the export is the same model rounded, not another one (a wrong mapping is O(0.1) and up).
    assert (ours - theirs).abs().max().item() < 5e-2
    # A SentencePiece model that normalises text (dummy prefix, NFKC: Llama 2's defaults) has no exact
    # tokenizer.json here: refused in one line.
    import sentencepiece as spm
    from tests.tokenizer_utils import TEXTS

    (tmp_path / "c.txt").write_text("".join(TEXTS) * 20)
    model_path = str(tmp_path / "llama2like.model")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=model_path[:-6], vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    _, big_ckpt = _export_model(tmp_path / "v400", 400)
    capsys.readouterr()
    code = export_main(["--input", str(big_ckpt), "--output", str(tmp_path / "o2"), "--tokenizer", model_path,
                        "--quiet"])
    err = capsys.readouterr().err
    assert code == CheckpointError.exit_code and "normalises text" in err and len(err.strip().splitlines()) == 1
    # A tokenizer with more ids than the model: refused, naming the model's vocab_size.
    code = export_main(["--input", str(ckpt), "--output", str(tmp_path / "o3"), "--tokenizer", model_path, "--quiet"])
    err = capsys.readouterr().err
    assert code == CheckpointError.exit_code and "vocab_size 67" in err and len(err.strip().splitlines()) == 1


def test_lm_eval_constructs_the_export(tmp_path: Path) -> None:
    """The docs/checkpoints.md recipe: lm-eval's `hf` model type loads the export (model + tokenizer)."""
    # lm-eval's hf model also needs accelerate: either missing skips, with the reason.
    hf_models = pytest.importorskip("lm_eval.models.huggingface",
                                    reason="lm-eval (with accelerate) is not installed: pip install lm-eval")

    from tests.tokenizer_utils import train_hf_bpe
    from megalite.data import load_tokenizer

    tok_path = train_hf_bpe(tmp_path / "tok" / "tokenizer.json")
    _, ckpt = _export_model(tmp_path, load_tokenizer(str(tok_path)).vocab_size)
    out = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--tokenizer", str(tok_path), "--quiet"]) == 0
    lm = hf_models.HFLM(pretrained=str(out), device="cpu", batch_size=1)
    assert lm.tok_encode("def main") == load_tokenizer(str(tok_path)).encode("def main")


@pytest.mark.parametrize("rope", [
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=16.0, beta_slow=1.0)])
def test_import_scaled_rope_llama(tmp_path: Path, rope: dict) -> None:
    """A Llama with llama3 (Llama 3.1) or YaRN rope scaling imports (megalite/checkpoint/interop/hf_rope.py) and computes
    transformers' logits; export writes the same rope_parameters back."""
    import json

    from megalite.inference.load import load_model

    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      rope_parameters={"rope_theta": 10000.0, **rope}, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"), "--quiet"]) == 0
    model, _ = load_model(tmp_path / "ckpt")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = (model(ids)[..., :VOCAB] - hf_model(ids).logits).abs().max().item()
    assert err <= LOGITS_ATOL, f"{rope['rope_type']}: transformers logits differ from megalite's by {err:.2e}"
    assert export_main(["--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert written == {"rope_theta": 10000.0, **rope}
