"""Chat templates for SFT: a `messages` list rendered to text, tokenized, and the assistant tokens marked.

The template is the Jinja text Hugging Face tokenizers carry (`tokenizer_config.json`'s `chat_template`) or
a file (`data.chat_template`). It is rendered the way transformers' `apply_chat_template` renders it, in a
sandbox with a time and a size bound (megalite/data/chat_render.py), with the tokenizer's special tokens as
variables. Where the assistant's tokens are:

* a template that wraps them in `{% generation %} ... {% endgeneration %}` says so: each block's output is
  wrapped in two private-use marker characters, found and removed after rendering;
* a stock template without such blocks (Qwen2.5's, Llama 3's, Mistral's, Gemma's) is read by difference,
  turn by turn (`ChatTemplate`), which gives the spans the hand-marked templates give
  (tests/test_chat_stock_templates.py holds them equal token for token).

The whole text is tokenized once, and a token is an assistant token when its character span overlaps an
assistant span: the rule of `apply_chat_template(..., return_assistant_tokens_mask=True)`, so the mask equals
transformers' (tests/test_chat_template.py holds it on the real transformers). `ChatTemplate.check` refuses,
when the run starts, a template that marks no reply, marks a user's or system's text, or cannot be read by
difference; never a mask of all ones or all zeros.

Special tokens in the rendered text (`<|im_start|>`, the template's `{{ eos_token }}`) are recognised as
transformers does: a Hugging Face tokenizer's added special tokens, unless its tokenizer_config.json says
`split_special_tokens: true`; a SentencePiece model's bos/eos pieces; tiktoken's special tokens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megalite.data.chat_render import END, START, Bounds, bounded_render, compile_bounded, environment
from megalite.data.tokenizer import Tokenizer
from megalite.errors import DataError, one_line

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Conversations every template is tried on before training; contents distinct, so each is found in the text.
_SYSTEM = {"role": "system", "content": "Answer in one word."}
_TURNS = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there."},
          {"role": "user", "content": "And two plus two?"}, {"role": "assistant", "content": "Four."}]
PROBES = [_TURNS[:2], _TURNS, [_SYSTEM, *_TURNS]]


def load_template_text(tokenizer_path: str, template: str) -> str:
    """`template` (a file) when given, else the `chat_template` of the tokenizer's tokenizer_config.json."""
    if template:
        try:
            return Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read data.chat_template {template!r} ({e}): give a Jinja chat template file") from e
    base = Path(tokenizer_path)
    config = (base if base.is_dir() else base.parent) / "tokenizer_config.json"
    text = None
    if config.is_file():
        try:
            text = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"cannot read {str(config)!r} ({e})") from e
    if isinstance(text, list):  # the named-templates form: [{"name": "default", "template": ...}, ...]
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja = config.parent / "chat_template.jinja"
    if text is None and jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
    if not isinstance(text, str) or not text:
        raise DataError(f"data.format=chat needs a chat template: tokenizer {tokenizer_path!r} has none (no "
                        "chat_template in its tokenizer_config.json): pass one with --data.chat_template FILE")
    return text


def _generation_extension() -> type:
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):  # type: ignore[misc]
        """`{% generation %}...{% endgeneration %}`: the block's output between the START and END markers."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Callable[[], str]) -> str:
            return START + caller() + END

    return Generation


def _has_marker(value: Any) -> bool:
    if isinstance(value, str):
        return START in value or END in value
    if isinstance(value, dict):
        return any(_has_marker(k) or _has_marker(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_marker(v) for v in value)
    return False


def _split_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the START/END markers and the character spans they enclosed."""
    spans: list[tuple[int, int]] = []
    out: list[str] = []
    length, start = 0, -1
    for piece in re.split(f"([{START}{END}])", marked):
        if piece == START:
            if start >= 0:
                raise ValueError("nested {% generation %} blocks")
            start = length
        elif piece == END:
            spans.append((start, length))
            start = -1
        else:
            out.append(piece)
            length += len(piece)
    return "".join(out), spans


_FIX = "pass a template with {% generation %} marks with --data.chat_template FILE (docs/data.md, SFT)"


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens as its variables.

    `marked`: the template has `{% generation %}` blocks, which say where the assistant's tokens are. Else
    they are found by difference, turn by turn (the rule LLaMA-Factory and axolotl-style SFT apply to stock
    templates): for the assistant message i, the conversation up to it rendered with the generation prompt
    (`messages[:i]`, `add_generation_prompt=True`: the assistant's header belongs to the prompt) is a prefix
    of the conversation up to and including it (`messages[:i + 1]`), and what that adds, less the whitespace
    a template writes after the end-of-turn token (the separator before the next turn, outside the block in
    the hand-marked templates), is the assistant's span; both must also start the whole conversation's
    rendering. A template for which that does not hold (it renders a conversation's start differently once
    the conversation goes on) cannot be read this way: a DataError that asks for a marked template.
    """

    def __init__(self, text: str, variables: dict[str, str], bounds: Bounds = Bounds()) -> None:
        import jinja2

        self.text, self.variables = text, variables
        self.marked = bool(_GENERATION.search(text))
        self.bounds = bounds
        self._env = environment(_generation_extension())
        try:
            self._template = compile_bounded(self._env, text)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template does not compile: {one_line(str(e))}") from e

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        import jinja2

        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                         documents=None, **self.variables)
        try:
            return bounded_render(self._env, self._template, variables, self.bounds)
        except (jinja2.exceptions.TemplateError, TypeError, AttributeError, KeyError, IndexError, ValueError,
                ArithmeticError) as e:
            raise ValueError(f"the chat template failed on this conversation: {one_line(str(e))}") from e

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of the assistant's tokens. ValueError: a bad conversation
        (the template raised, or a message holds a marker character); DataError: the template ran past its
        bounds, or has no marks and cannot be read by difference."""
        if _has_marker(messages):
            raise ValueError("a message holds a private-use marker character (U+E000/U+E001)")
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text, spans = _split_marks(self._render(clean, False))
        return (text, spans) if self.marked else (text, self._derived_spans(clean, text))

    def _derived_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = _split_marks(self._render(messages[:i], True))[0]
            turn = _split_marks(self._render(messages[: i + 1], False))[0]
            start = len(prompt)
            end = start + len(turn[start:].rstrip())
            if not turn.startswith(prompt) or not text.startswith(turn[:end]):
                raise DataError(f"the chat template has no {{% generation %}} marks, and what it renders for the "
                                f"first {i} messages and a generation prompt is not the start of what it renders "
                                f"for the first {i + 1} (or for the whole conversation), so the assistant's tokens "
                                f"of message {i} cannot be found by difference: {_FIX}")
            if end > start:
                spans.append((start, end))
        return spans

    def check(self, encoder: ChatEncoder) -> None:
        """Refuse, before any training, a template that cannot say which tokens are the assistant's: one that
        fails on every probe conversation, marks none of a reply, marks a user's or system's text, or (without
        marks) renders a conversation's start differently once it goes on."""
        failures = []
        for probe in PROBES:
            try:
                text, spans = self.render(probe)
            except ValueError as e:
                failures.append(str(e))
                continue
            ids, offsets = encoder.encode(text)
            if not any(assistant_mask(offsets, spans)):
                raise DataError("the chat template's {% generation %} blocks mark no token of an assistant reply "
                                f"(probe {probe}): put each assistant message's content inside them")
            for m in probe:
                at = text.find(m["content"])
                inside = any(a <= at and at + len(m["content"]) <= b for a, b in spans)
                overlaps = at >= 0 and any(a < at + len(m["content"]) and at < b for a, b in spans)
                if m["role"] != "assistant" and overlaps:
                    raise DataError(f"the chat template's {{% generation %}} blocks mark the {m['role']}'s text "
                                    f"({m['content']!r}), which the model would learn to write: mark only the "
                                    "assistant's replies (and their end-of-turn token)")
                if m["role"] == "assistant" and at >= 0 and not inside:
                    raise DataError("the chat template's {% generation %} blocks mark only part of an assistant "
                                    f"reply ({m['content']!r}): put the whole reply inside them")
        if len(failures) == len(PROBES):
            raise DataError(f"the chat template fails on every probe conversation ({failures[0]}): fix it or "
                            "pass another with --data.chat_template FILE")


class ChatEncoder:
    """Token ids and character offsets of a rendered chat, special tokens recognised (see the module doc)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.kind = tok.kind
        self.specials: dict[str, int] = {}
        self.split_special = False
        if tok.kind == "hf":
            config = Path(tok.path).with_name("tokenizer_config.json")
            if config.is_file():
                try:
                    self.split_special = bool(json.loads(config.read_text(encoding="utf-8"))
                                              .get("split_special_tokens", False))
                except (OSError, ValueError, AttributeError):
                    self.split_special = False
        elif tok.kind == "sentencepiece":
            proc: Any = getattr(tok, "processor")
            self.specials = {proc.id_to_piece(i): i for i in (tok.bos_id, tok.eod_id) if i is not None and i >= 0}
        else:
            self.specials = dict(getattr(tok, "special_tokens"))

    def variables(self) -> dict[str, str]:
        """bos_token / eos_token for the template, as transformers passes its special_tokens_map."""
        out: dict[str, str] = {}
        if self.kind == "hf":
            eod, bos = getattr(self.tok, "eod_text", None), getattr(self.tok, "bos_text", None)
        elif self.kind == "sentencepiece":
            proc: Any = getattr(self.tok, "processor")
            eod = proc.id_to_piece(self.tok.eod_id)
            bos = proc.id_to_piece(self.tok.bos_id) if self.tok.bos_id is not None else None
        else:
            eod, bos = "<|endoftext|>", None
        if eod:
            out["eos_token"] = eod
        if bos:
            out["bos_token"] = bos
        return out

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self.kind == "hf":
            backend: Any = getattr(self.tok, "backend")
            before = backend.encode_special_tokens
            backend.encode_special_tokens = self.split_special
            try:
                enc = backend.encode(text, add_special_tokens=False)
            finally:
                backend.encode_special_tokens = before
            return list(enc.ids), [tuple(o) for o in enc.offsets]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pattern = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        pos = 0
        for part in (re.split(f"({pattern})", text) if pattern else [text]):
            if part in self.specials:
                ids.append(self.specials[part])
                offsets.append((pos, pos + len(part)))
            elif part:
                part_ids, part_offsets = self._ordinary(part)
                ids += part_ids
                offsets += [(pos + a, pos + b) for a, b in part_offsets]
            pos += len(part)
        return ids, offsets

    def _ordinary(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of text without special tokens, each with its character span."""
        ids = self.tok.encode(text)
        # Character spans from the cumulative byte length of each token's bytes (exact for byte-level and
        # byte-fallback vocabularies): a token ending inside a multi-byte character spans that character.
        byte_ends: list[int] = []
        total = 0
        for piece in self._token_bytes(ids):
            total += len(piece)
            byte_ends.append(total)
        char_at = _byte_to_char(text)
        offsets, start = [], 0
        for end in byte_ends:
            a, b = char_at(start, False), char_at(end, True)
            offsets.append((a, max(a, b)))
            start = end
        return ids, offsets

    def _token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        if self.kind == "tiktoken":
            enc: Any = getattr(self.tok, "encoding")
            return [enc.decode_single_token_bytes(i) for i in ids]
        proc: Any = getattr(self.tok, "processor")
        out = []
        for i in ids:
            if proc.is_byte(i):
                out.append(bytes([int(proc.id_to_piece(i)[3:5], 16)]))
            else:
                out.append(proc.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return out


def _byte_to_char(text: str) -> Callable[[int, bool], int]:
    """Byte offset (UTF-8) -> character offset; `up` rounds a position inside a character up."""
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode("utf-8")))

    def convert(byte: int, up: bool) -> int:
        import bisect

        i = bisect.bisect_left(starts, byte)
        if i < len(starts) and starts[i] == byte:
            return i
        return i if up else i - 1

    return convert


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose character span overlaps a generation span (transformers' one pass over both)."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def encode_chat(template: ChatTemplate, encoder: ChatEncoder,
                messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) of one conversation."""
    text, spans = template.render(messages)
    ids, offsets = encoder.encode(text)
    return ids, assistant_mask(offsets, spans)


def build_chat(tok: Tokenizer, template_file: str, max_record_bytes: int = 0) -> tuple[ChatTemplate, ChatEncoder]:
    """The template and encoder for `tok`, checked to mark assistant tokens. The size bound grows with
    `max_record_bytes` (a record's rendering is about its size), so a record the run accepts always fits."""
    encoder = ChatEncoder(tok)
    bounds = Bounds(max_chars=max(Bounds.max_chars, 4 * max_record_bytes))
    template = ChatTemplate(load_template_text(tok.path if os.path.exists(tok.path) else "", template_file),
                            encoder.variables(), bounds)
    template.check(encoder)
    return template, encoder
