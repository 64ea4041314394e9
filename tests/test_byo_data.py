"""The README's "bring your own tokenizer" path end to end: a tokenizer.json -> preprocess a jsonl -> train with
samples in the log -> export with the tokenizer -> transformers loads model and tokenizer with megalite's ids
and logits; tools/generate.py finds the tokenizer from the checkpoint by itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalite.data import load_tokenizer
from megalite.inference.load import load_model
from megalite.training.trainer import main as pretrain_main
from tests.tokenizer_utils import TEXTS, train_hf_bpe
from tools.export_hf import main as export_main
from tools.generate import main as generate_main
from tools.preprocess_data import main as preprocess_main

# Same fp32 weights and math, different op order in attention: a few ulps of O(1) logits (see test_hf.py).
LOGITS_ATOL = 1e-5


def test_tokenizer_json_to_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    tok_path = train_hf_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=320, llama_style=True)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 15))
    assert preprocess_main(["--input", str(corpus), "--json-key", "text", "--tokenizer", str(tok_path),
                            "--output-prefix", str(tmp_path / "data" / "c"), "--quiet", "--workers", "1"]) == 0
    assert pretrain_main(["--data.path", str(tmp_path / "data" / "c"), "--data.tokenizer", str(tok_path),
                          "--model.seq_len", "32", "--model.num_layers", "2", "--model.hidden_size", "64",
                          "--train.micro_batch_size", "2", "--train.steps", "4", "--train.eval_interval", "0",
                          "--checkpoint.dir", str(tmp_path / "ckpt"), "--logging.dir", str(tmp_path / "run"),
                          "--logging.sample_interval", "2", "--logging.sample_prompt", "def",
                          "--data.document_mask", "true"]) == 0  # as the README's example
    assert "sample at step 4: 'def' -> " in capsys.readouterr().out
    assert export_main(["--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--tokenizer",
                        str(tok_path), "--quiet"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tok = load_tokenizer(str(tok_path))
    model, _ = load_model(tmp_path / "ckpt")
    text = TEXTS[0]
    ids = hf_tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == [tok.bos_id] + tok.encode(text)
    with torch.no_grad():
        err = (model(ids)[..., :tok.vocab_size] - hf_model(ids).logits).abs().max().item()
    assert err <= LOGITS_ATOL
    # tools/generate.py: the tokenizer comes from the run's saved config.
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def", "--max-tokens", "5",
                          "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def")
