"""Reading raw documents from text and record files, shared by the tokenizer trainer and preprocessing.

Three input layouts:
  * plain text, one document per file (the default);
  * plain text, one document per blank-line-separated paragraph (`split_paragraphs=True`);
  * records (`json_key="text"`): what streaming takes (megalite/data/sources.py), read by the same readers —
    JSON lines plain, `.gz` or `.zst` (one object per line, the document is `obj[json_key]`), parquet (the
    column `json_key`), a directory of such files, a datasets save_to_disk directory. A cut compressed file,
    a FIFO or a device is refused as streaming refuses it.
Text is read as UTF-8 with Python's universal newlines, so `\\r\\n` becomes `\\n`. Documents that are empty
(or only whitespace, for paragraphs) are skipped: they would add nothing but an end-of-document token.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

from megalite.data.readers import check_regular, file_kind, lines
from megalite.data.sources import MISSING, Source, kind_of, list_files
from megalite.errors import DataError
from megalite.untrusted import loads_json

# A blank line: a newline, then any number of lines holding only spaces/tabs, then a newline.
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_inputs(paths: Sequence[str], json_key: str | None = None) -> None:
    """Fail before any work starts if an input is missing or in the wrong layout."""
    if not paths:
        raise DataError("no input files given: pass at least one --input FILE")
    for path in paths:
        kind = kind_of(path)
        if kind is None:
            if not os.path.lexists(path):
                raise DataError(f"input file not found: {path!r} (check the path)")
            check_regular(path, "input")
        elif json_key is None:
            raise DataError(f"{path!r} holds records (JSON lines, parquet or a directory of them): pass --json-key "
                            "KEY, the key / column holding the text (e.g. --json-key text)")
        elif not path.startswith("hf:"):
            note = list_files(path, kind).note(path)
            if note is not None:  # what a directory holds besides its data files: said once, not read
                print(f"note: {note.removeprefix('data.path ')}", file=sys.stderr)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path!r} is not UTF-8 text (byte {e.start}): convert it, e.g. `iconv -t utf-8`") from e


def _iter_records(path: str, json_key: str, replaced: Replacements | None) -> Iterator[str]:
    """The documents of a record source: JSON lines by line (errors name the line), tables by row."""
    src = Source.open(path, json_key, 0)
    for f, name in enumerate(src.files):
        if file_kind(name) in ("jsonl", "jsonl.gz", "jsonl.zst"):
            yield from _iter_jsonl(name, json_key, replaced)
            continue
        for index, _, value in src.records(f, 0, 0):
            if not isinstance(value, str):
                raise DataError(f"{name}: row {index}: column {json_key!r} is "
                                f"{'missing' if value is MISSING else type(value).__name__}, not a string: pass the "
                                "right --json-key")
            if value:
                yield without_lone_surrogates(value, replaced)


def _iter_jsonl(path: str, json_key: str, replaced: Replacements | None) -> Iterator[str]:
    kind = file_kind(path)
    assert kind is not None
    for lineno, (_, raw) in enumerate(lines(path, kind), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line): convert the file, e.g. "
                            "`iconv -t utf-8`") from None
        if not line.strip():
            continue
        try:
            obj = loads_json(line, f"{path}:{lineno}", DataError)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); --json-key expects one JSON "
                            "object per line") from e
        if not isinstance(obj, dict) or json_key not in obj:
            raise DataError(f"{path}:{lineno}: no key {json_key!r} in this JSON line: pass the right --json-key")
        text = obj[json_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: {json_key!r} is a {type(text).__name__}, not a string")
        if text:
            yield without_lone_surrogates(text, replaced)


@dataclass
class Replacements:
    """What `without_lone_surrogates` changed, so a tool can say so instead of altering text silently."""

    code_points: int = 0
    documents: int = 0

    def note(self) -> str | None:
        if not self.code_points:
            return None
        return (f"note: replaced {self.code_points} unpaired surrogate escape(s) (\\ud800-\\udfff, not text) by U+FFFD "
                f"in {self.documents} document(s)")


def without_lone_surrogates(text: str, replaced: Replacements | None = None) -> str:
    """`text` with each unpaired UTF-16 surrogate (JSON allows `"\\ud800"`; UTF-8 cannot encode it, so the
    tokenizer would crash) replaced by U+FFFD, the Unicode replacement character; valid text is unchanged.
    `replaced` counts the replacements and the documents that had any."""
    out, n = _SURROGATE.subn("\ufffd", text)  # a valid pair is already one code point after json.loads
    if n and replaced is not None:
        replaced.code_points += n
        replaced.documents += 1
    return out


def split_into_paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs, without the separating blank lines; whitespace-only ones dropped."""
    return [p.strip("\n") for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def iter_documents(paths: Sequence[str], json_key: str | None = None,
                   split_paragraphs: bool = False, replaced: Replacements | None = None,
                   checked: bool = False) -> Iterator[str]:
    """Yield the documents of `paths`, in order (files in the given order, then position in the file);
    `replaced` counts the unpaired surrogates of JSON lines replaced on the way."""
    if not checked:  # `checked`: the caller ran check_inputs already (its notes are said once)
        check_inputs(paths, json_key)
    for path in paths:
        if json_key is not None:
            yield from _iter_records(path, json_key, replaced)
            continue
        text = _read_text(path)
        if split_paragraphs:
            yield from split_into_paragraphs(text)
        elif text:
            yield text
