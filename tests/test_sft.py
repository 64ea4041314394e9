"""SFT of the demo model end to end: pretrain a few steps, fine-tune from those weights (`--train.init_from`) on a
small chat set with a template file, export, and chat with it through AutoTokenizer + generate. On the way: the
export's `apply_chat_template` gives the ids and assistant mask megalite trained on, the loss on an SFT batch
equals transformers' (labels -100 off the assistant tokens) on the exported model, and init_from takes the
weights only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalite.data import prepare_demo_data
from megalite.data.chat_template import build_chat, encode_chat
from megalite.data.tokenizer import load_tokenizer
from megalite.inference.load import load_model
from megalite.training.trainer import main as pretrain_main
from tests.conftest import SMALL_RUN
from tools.export_hf import main as export_main

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}### User:\n{{ m['content'] }}\n"
            "{% elif m['role'] == 'assistant' %}### Assistant:\n{% generation %}{{ m['content'] }}{{ eos_token }}"
            "{% endgeneration %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")
CHATS = [[{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}"}]
         for a in range(4) for b in range(3)]
# Same fp32 weights, another op order in attention and the loss: a few ulps of an O(1) mean.
LOSS_ATOL = 1e-5


def test_sft_of_the_demo_model_end_to_end(tmp_path: Path, demo_cache_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    run = [*SMALL_RUN, "--data.cache_dir", demo_cache_dir]
    assert pretrain_main([*run, "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "base"),
                          "--logging.dir", str(tmp_path / "log0")]) == 0
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    assert pretrain_main([*run, "--train.steps", "3", "--train.init_from", str(tmp_path / "base"),
                          "--data.path", str(tmp_path / "chat.jsonl"), "--data.format", "chat",
                          "--data.chat_template", str(tmp_path / "chat.jinja"), "--data.document_mask", "true",
                          "--data.workers", "0", "--checkpoint.dir", str(tmp_path / "sft"),
                          "--logging.dir", str(tmp_path / "log1")]) == 0
    # init_from takes the weights: a step at learning rate 1e-30 (below fp32 resolution) leaves the base model's.
    assert pretrain_main([*run, "--train.steps", "1", "--train.lr", "1e-30", "--train.min_lr", "1e-30",
                          "--train.init_from", str(tmp_path / "base"), "--data.path", str(tmp_path / "chat.jsonl"),
                          "--data.format", "chat", "--data.chat_template", str(tmp_path / "chat.jinja"),
                          "--data.workers", "0", "--checkpoint.dir", str(tmp_path / "lr0"),
                          "--logging.dir", str(tmp_path / "log2")]) == 0
    base, _ = load_model(tmp_path / "base")
    same, _ = load_model(tmp_path / "lr0")
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), same.state_dict().values()))
    rows = [json.loads(line) for line in (tmp_path / "log1" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["lr"] < 3e-3  # the schedule starts afresh (warmup), not at step 2
    assert rows[-1]["data"]["records"] > 0 and rows[-1]["data"]["bad_records"] == {}
    _, tok_path = prepare_demo_data(demo_cache_dir, 300_000, 512)
    assert export_main(["--input", str(tmp_path / "sft"), "--output", str(tmp_path / "hf"), "--tokenizer", tok_path,
                        "--quiet"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    # The export renders and tokenizes a chat as SFT did: the same ids, the same assistant tokens.
    tok = load_tokenizer(tok_path)
    template, encoder = build_chat(tok, str(tmp_path / "chat.jinja"))
    conv = CHATS[5]
    ids, mask = encode_chat(template, encoder, conv)
    want = hf_tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == want["input_ids"] and mask == want["assistant_masks"] and ids[-1] == tok.eod_id
    # The loss on an SFT sample: megalite's token mean equals transformers' with labels -100 off the assistant.
    x = torch.tensor([ids[:-1]])
    labels = torch.where(torch.tensor([mask[1:]], dtype=torch.bool), torch.tensor([ids[1:]]), -100)
    model, _ = load_model(tmp_path / "sft")
    with torch.no_grad():
        per_token = model(x, labels)
        ours = per_token.sum() / (labels != -100).sum()
        hf_labels = torch.where(torch.tensor([mask], dtype=torch.bool), torch.tensor([ids]), -100)
        theirs = hf_model(torch.tensor([ids]), labels=hf_labels).loss
    assert abs(ours.item() - theirs.item()) <= LOSS_ATOL
    # Chat with it.
    prompt = hf_tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    out = hf_model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
