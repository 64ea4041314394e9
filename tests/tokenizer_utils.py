"""Tokenizers built inside the tests (never downloaded): a byte-level BPE `tokenizer.json` trained with the
`tokenizers` package, and tiktoken encoding files written by hand."""

from __future__ import annotations

import base64
from pathlib import Path

TEXTS = [
    "def main(argv):\n    return 0\n",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Pack my box with five dozen liquor jugs.\n",
    "import os\nimport sys\n\nprint(sys.argv)\n",
    "héllo wörld — ünïcode 漢字 🙂\n",
    "for i in range(10):\n    total += i * i\n",
]


def train_hf_bpe(path: Path, vocab_size: int = 400, llama_style: bool = False, texts: list[str] | None = None) -> Path:
    """A byte-level BPE like GPT-2's (`<|endoftext|>`, no BOS) or, with `llama_style`, one with `<s>`/`</s>`
    whose post-processor prepends `<s>` as Llama's does. Written as `path` (a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<s>", "</s>"] if llama_style else ["<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((texts or TEXTS) * 3, trainer)
    if llama_style:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


MERGES = [b"th", b"he", b"the", b" the", b"in", b"re", b"er", b"  ", b"    ", b"de", b"def"]


# Merges across the places where split rules differ: digit runs longer than 3, contractions, space runs.
RICH_MERGES = [b"20", b"02", b"24", b"202", b"024", b"2024", b"12", b"123", b"1234", b"'s", b"'r", b"'re", b"'t",
               b"'l", b"'ll", b"'v", b"'ve", b"  ", b"   ", b"    ", b" \n", b"\n\n", b"in", b"ing", b"th", b"the",
               b" the", b"<|", b"|>", b"<|e", b"nd", b"of", b"\xc3\xa9"]


def write_tiktoken(path: Path, filler: int = 0, merges: list[bytes] | None = None) -> Path:
    """A tiktoken file: the 256 single bytes (rank = byte value), `filler` unreachable 3-byte tokens (to
    push ids past 65,535), then a few real merges (`merges`, default MERGES; each must be two earlier tokens
    joined). Ranks are dense, as tiktoken's own files are."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [b"\x00" + i.to_bytes(2, "big") for i in range(filler)]
    tokens += MERGES if merges is None else merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path
