"""Chat templates for SFT: a `messages` list rendered to text, tokenized, and the assistant tokens marked.

The template is the Jinja text Hugging Face tokenizers carry (`tokenizer_config.json`'s `chat_template`) or
a file (`data.chat_template`). It is rendered the way transformers' `apply_chat_template` renders it (a
sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`,
`strftime_now`, and the tokenizer's special tokens as variables). The parts a template wraps in
`{% generation %} ... {% endgeneration %}` are what the model learns to write: their character spans are
recorded (each block's output is wrapped in two private-use marker characters, found and removed after
rendering), the whole text is tokenized once, and a token is an assistant token when its character span
overlaps a generation span: the rule of `apply_chat_template(..., return_assistant_tokens_mask=True)`, so the
mask equals transformers' (tests/test_chat_template.py holds it on the real transformers).

A template without generation blocks cannot say which tokens are the assistant's: that is refused when the
run starts (`check_marks_assistant`), never turned into a mask of all ones or all zeros.

Special tokens in the rendered text (`<|im_start|>`, the template's `{{ eos_token }}`) are recognised as
transformers does: a Hugging Face tokenizer's added special tokens, unless its tokenizer_config.json says
`split_special_tokens: true`; a SentencePiece model's bos/eos pieces; tiktoken's special tokens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from megalite.data.tokenizer import Tokenizer
from megalite.errors import DataError

START, END = "\ue000", "\ue001"  # private-use characters around each generation block's output
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
PROBE = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there."}]


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


def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: the block's output between the START and END markers."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Callable[[], str]) -> str:
            return START + caller() + END

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _has_marker(value: Any) -> bool:
    if isinstance(value, str):
        return START in value or END in value
    if isinstance(value, dict):
        return any(_has_marker(k) or _has_marker(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_marker(v) for v in value)
    return False


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens as its variables."""

    def __init__(self, text: str, variables: dict[str, str]) -> None:
        import jinja2

        self.text = text
        self.variables = variables
        try:
            self._template = _environment().from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template does not compile: {e}") from e

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its generation blocks. ValueError: a bad conversation
        (the template raised, or a message holds a marker character)."""
        import jinja2

        if _has_marker(messages):
            raise ValueError("a message holds a private-use marker character (U+E000/U+E001)")
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            marked = self._template.render(messages=clean, add_generation_prompt=False, tools=None, documents=None,
                                           **self.variables)
        except (jinja2.exceptions.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise ValueError(f"the chat template failed on this conversation: {e}") from e
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

    def check_marks_assistant(self, encoder: ChatEncoder) -> None:
        """Refuse a template that cannot mark the assistant's tokens (before any training)."""
        if not _GENERATION.search(self.text):
            raise DataError("the chat template has no {% generation %} block, so it cannot say which tokens are the "
                            "assistant's (the loss would be on every token or none): wrap each assistant turn in "
                            "{% generation %}...{% endgeneration %} (docs/data.md, SFT) and pass it with "
                            "--data.chat_template FILE")
        try:
            _, mask = encode_chat(self, encoder, PROBE)
        except ValueError as e:
            raise DataError(f"the chat template fails on a two-turn probe conversation: {e}") from e
        if not any(mask):
            raise DataError("the chat template's {% generation %} blocks mark no token of an assistant reply "
                            f"(probe {PROBE}): put each assistant message's content inside them")


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


def build_chat(tok: Tokenizer, template_file: str) -> tuple[ChatTemplate, ChatEncoder]:
    """The template and encoder for `tok`, checked to mark assistant tokens."""
    encoder = ChatEncoder(tok)
    template = ChatTemplate(load_template_text(tok.path if os.path.exists(tok.path) else "", template_file),
                            encoder.variables())
    template.check_marks_assistant(encoder)
    return template, encoder
