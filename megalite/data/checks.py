"""The data.* checks that look at the data's files, made before any process group or model exists.

`check_data` refuses, with one line each, what the loader could only meet later or would silently misread: a
flag that cannot apply to the data given (chat on token files, a chat template on text records), an unknown
`data.on_change`, a missing file, a FIFO / device / socket (which would block or never end), a directory with
no data file in it, a parquet file without its footer (a cut copy). Streaming's own listing (`list_files`) does
the file checks, so what is checked here is what the loader reads.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megalite.data.readers import check_regular
from megalite.data.sources import kind_of, list_files
from megalite.errors import ConfigError

if TYPE_CHECKING:
    from megalite.config.schema import Config

ON_CHANGE = ("refuse", "restart")


def check_data(cfg: Config) -> None:
    """A ConfigError / DataError for data flags that cannot apply and data files that cannot be read whole."""
    data = cfg.data
    if data.format not in ("text", "chat"):
        raise ConfigError(f"data.format = {data.format!r}: choose text or chat")
    if data.on_change not in ON_CHANGE:
        raise ConfigError(f"data.on_change = {data.on_change!r}: choose refuse (the default) or restart")
    paths = list(data.path)
    tokens = [p for p in paths if kind_of(p) is None] if paths else ["the demo corpus (data.path is empty)"]
    if data.format == "chat" and tokens:
        raise ConfigError(f"data.format chat with {', '.join(map(repr, tokens))}: a .bin/.idx dataset holds token ids, "
                          "not conversations, so the chat template and the assistant-only loss cannot apply (it would "
                          "train on every token): give chat records (.jsonl, .parquet, a directory of them) in "
                          "data.path, or drop --data.format chat to pretrain")
    if data.format != "chat" and data.chat_template:
        raise ConfigError(f"data.chat_template {data.chat_template!r} is set but data.format is {data.format!r}: a "
                          "template renders chat records only; add --data.format chat, or drop the template")
    for p in paths:
        kind = kind_of(p)
        if kind is None:  # a .bin/.idx prefix: IndexedDataset says what is missing; a special file is refused here
            for f in (p + ".idx", p + ".bin"):
                if os.path.lexists(f):
                    check_regular(f)
        elif not p.startswith("hf:"):
            list_files(p, kind)
