"""SFT on stock hub templates (no `{% generation %}` marks): the assistant spans found by difference, turn by
turn, give the ids and the assistant mask of the hand-marked template token for token, on Qwen2.5's, Llama 3's,
Mistral's and Gemma's templates, and equal transformers' `apply_chat_template(..., return_assistant_tokens_mask=
True)` on the marked one. A template that renders a conversation's start differently once it goes on, or whose
marks cover a user's or system's text, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalite.data.chat_template import PROBES, ChatEncoder, ChatTemplate, build_chat, encode_chat
from megalite.data.tokenizer import load_tokenizer
from megalite.errors import DataError
from tests.chat_templates import FAMILIES, SPECIALS, SYSTEM_IN_LAST_USER, Family
from tests.tokenizer_utils import TEXTS


def _conversations(system: bool) -> list[list[dict[str, Any]]]:
    sys_ = [{"role": "system", "content": "Be brief, and\nanswer in English."}] if system else []
    return [
        [{"role": "user", "content": "def main(argv):"}, {"role": "assistant", "content": "    return 0\n"}],
        [*sys_, {"role": "user", "content": "  héllo wörld 漢字 🙂 "},
         {"role": "assistant", "content": "The quick fox"},
         {"role": "user", "content": "<|im_end|></s><end_of_turn> again?"},
         {"role": "assistant", "content": "\nPack my box with five dozen liquor jugs.\n\n"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"},
         {"role": "assistant", "content": "import os"}],
        [{"role": "user", "content": "only a question"}],
    ]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One byte-level BPE holding every family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=440, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


def _family_dir(root: Path, tokenizer_json: Path, family: Family) -> Path:
    """The tokenizer with `family`'s bos/eos and its hand-marked template in tokenizer_config.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": family.eos, "chat_template": family.marked}
    if family.bos:
        config["bos_token"] = family.bos
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "stock.jinja").write_text(family.stock)
    return root


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_stock_template_masks_equal_the_hand_marked_ones(tmp_path: Path, tokenizer_json: Path,
                                                         family: Family) -> None:
    transformers = pytest.importorskip("transformers")
    root = _family_dir(tmp_path / family.name, tokenizer_json, family)
    tok = load_tokenizer(str(root / "tokenizer.json"))
    stock, encoder = build_chat(tok, str(root / "stock.jinja"))
    marked, _ = build_chat(tok, "")
    assert not stock.marked and marked.marked
    hf = transformers.AutoTokenizer.from_pretrained(str(root))
    learned = 0
    for conv in _conversations(family.system):
        ids, mask = encode_chat(stock, encoder, conv)
        assert (ids, mask) == encode_chat(marked, encoder, conv)
        want = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == want["input_ids"] and mask == want["assistant_masks"]
        learned += sum(mask)
        if all(m["role"] != "assistant" for m in conv):
            assert sum(mask) == 0
    assert learned > 0
    # The assistant's tokens end with the end-of-turn token, and the header before them is not learned.
    ids, mask = encode_chat(stock, encoder, _conversations(family.system)[0])
    eot, _ = encoder.encode(family.eot)
    last = max(i for i, m in enumerate(mask) if m)
    assert eot == [ids[last]] and mask[0] == 0


def test_a_template_that_renders_a_start_differently_is_refused(tmp_path: Path, tokenizer_json: Path) -> None:
    family = Family("v0.3-like", SYSTEM_IN_LAST_USER, "", "<s>", "</s>", "</s>", True)
    root = _family_dir(tmp_path / "t", tokenizer_json, family)
    with pytest.raises(DataError, match=r"cannot be found by difference: pass a template with \{% generation %\}"):
        build_chat(load_tokenizer(str(root / "tokenizer.json")), str(root / "stock.jinja"))


@pytest.mark.parametrize("wrapped", ["user", "system"])
def test_generation_marks_around_other_text_are_refused(tmp_path: Path, tokenizer_json: Path, wrapped: str) -> None:
    text = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] in ['assistant', '" + wrapped
            + "'] %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
            "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    encoder = ChatEncoder(load_tokenizer(str(tokenizer_json)))
    with pytest.raises(DataError, match=f"mark the {wrapped}'s text"):
        ChatTemplate(text, {"eos_token": "<|im_end|>"}).check(encoder)
    part = text.replace("'" + wrapped + "'] %}{% generation %}{{ m['content'] }}",
                        "''] %}{{ m['content'][:2] }}{% generation %}{{ m['content'][2:] }}")
    with pytest.raises(DataError, match="only part of an assistant reply"):
        ChatTemplate(part, {"eos_token": "<|im_end|>"}).check(encoder)


def test_probes_cover_a_system_message_and_two_turns() -> None:
    roles = [[m["role"] for m in p] for p in PROBES]
    assert ["user", "assistant"] in roles and any(r[0] == "system" and r.count("assistant") == 2 for r in roles)


def test_a_conversation_the_difference_cannot_read_stops_the_run_not_a_record() -> None:
    # Past the probes, the same rule per conversation: a DataError (the run stops, exit 3), never a guess. Here
    # a conversation without a system message reads fine, one with it (moved into the last user turn) cannot.
    template = ChatTemplate(SYSTEM_IN_LAST_USER, {"bos_token": "<s>", "eos_token": "</s>"})
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    text, spans = template.render(turns)
    assert [text[a:b] for a, b in spans] == [" a1</s>", " a2</s>"]
    with pytest.raises(DataError, match="assistant's tokens of message 2 cannot be found by difference"):
        template.render([{"role": "system", "content": "s"}, *turns])


def test_qwen_tool_calls_are_replies_and_tool_results_are_not() -> None:
    # The assistant's tool call (after the generation prompt's header) is learned; the tool's answer, rendered
    # as a user turn, is prompt.
    from tests.chat_templates import QWEN25

    call: dict[str, Any] = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    conv: list[dict[str, Any]] = [
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    text, spans = ChatTemplate(QWEN25, {"eos_token": "<|im_end|>"}).render(conv)
    assert [text[a:b] for a, b in spans] == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>', "It is 4.<|im_end|>"]
    assert "<tool_response>\n4\n</tool_response>" in text
