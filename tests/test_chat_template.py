"""SFT's chat rendering (megalite/data/chat_template.py) against the real transformers: the ids and the assistant
mask equal `apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)`; a template that
cannot mark the assistant's tokens is refused; the streamed chat labels are -100 exactly off that mask, and a
conversation with nothing to learn is a counted bad record, never a sample (nor a run) at loss 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalite.config.schema import Config
from megalite.data.chat_template import build_chat, encode_chat
from megalite.data.loader import RankSlice, StreamLoader
from megalite.data.tokenizer import load_tokenizer
from megalite.errors import DataError
from tests.tokenizer_utils import TEXTS

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "def main(argv):"}, {"role": "assistant", "content": "    return 0\n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld 漢字 🙂"},
     {"role": "assistant", "content": "The quick brown fox"}, {"role": "user", "content": "<|im_end|> again?"},
     {"role": "assistant", "content": "Pack my box with five dozen liquor jugs."}],
    [{"role": "user", "content": "only a question"}],
]


def chatml_tokenizer(root: Path, template: str = CHATML) -> Path:
    """A byte-level BPE with ChatML's special tokens and the template in its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>", "chat_template": template}))
    return root / "tokenizer.json"


def test_ids_and_assistant_mask_equal_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = chatml_tokenizer(tmp_path / "tok")
    template, encoder = build_chat(load_tokenizer(str(path)), "")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    for conv in CONVERSATIONS:
        ids, mask = encode_chat(template, encoder, conv)
        want = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == want["input_ids"]
        assert mask == want["assistant_masks"]
    assert sum(encode_chat(template, encoder, CONVERSATIONS[1])[1]) > 0
    assert sum(encode_chat(template, encoder, CONVERSATIONS[2])[1]) == 0  # no assistant turn: nothing to learn


@pytest.mark.parametrize("template,match", [
    (CHATML.replace("{% if m['role'] == 'assistant' %}", "{% if m['role'] != 'system' %}"), "mark the user's text"),
    (CHATML.replace("{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}",
                    "{% generation %}{% endgeneration %}{{ m['content'] }}<|im_end|>"), "mark no token"),
])
def test_a_template_that_cannot_mark_the_assistant_is_refused(tmp_path: Path, template: str, match: str) -> None:
    path = chatml_tokenizer(tmp_path / "tok", template)
    with pytest.raises(DataError, match=match):
        build_chat(load_tokenizer(str(path)), "")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "tokenizer.json").write_bytes(path.read_bytes())
    with pytest.raises(DataError, match="needs a chat template"):
        build_chat(load_tokenizer(str(tmp_path / "none" / "tokenizer.json")), "")


def test_streamed_chat_labels_are_ignored_off_the_assistant_tokens(tmp_path: Path) -> None:
    path = chatml_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(path))
    template, encoder = build_chat(tok, "")
    records = [{"messages": c} for c in CONVERSATIONS] + [{"messages": [{"content": "no role"}]}, {"messages": "x"},
                                                          {"messages": [{"role": "system", "content": "s"}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer, cfg.data.format = [str(tmp_path / "chat.jsonl")], str(path), "chat"
    cfg.data.workers, cfg.data.valid_fraction, cfg.data.streams = 0, 0.0, 1
    cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 256, 1, 1
    ld = StreamLoader(cfg, RankSlice(1, 0), tok)
    try:
        (ids, labels), = ld.next_step()
        counts = ld.counts()
    finally:
        ld.close()
    # The first sample packs the two conversations with an assistant turn (each + EOD), then the next epochs.
    tokens, targets = [], []
    for conv in CONVERSATIONS[:2]:
        conv_ids, mask = encode_chat(template, encoder, conv)
        tokens += conv_ids + [tok.eod_id]
        targets += mask + [0]
    n = len(tokens) - 1
    want = torch.where(torch.tensor(targets[1:], dtype=torch.bool), torch.tensor(tokens[1:]), -100)
    assert ids[0, :n].tolist() == tokens[:n]
    assert torch.equal(labels[0, :n], want)
    assert counts.bad["bad_chat"] == counts.bad["missing_key"] >= 1  # once per epoch read
    assert counts.bad["no_assistant"] == 2 * counts.bad["bad_chat"]  # the user-only and the system-only ones
