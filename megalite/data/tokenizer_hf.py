"""A Hugging Face `tokenizer.json` (GPT-2's BPE, Llama 3, Mistral, Qwen ...) through the `tokenizers` package.

Special tokens are where a `tokenizer.json` says least, so they are resolved explicitly:
  * EOD (appended after every document) = `eos_token` of a `tokenizer_config.json` next to the file
    (what `AutoTokenizer` reads), else the first of the usual end-of-text tokens the vocabulary has
    (`<|endoftext|>` GPT-2/Qwen, `<|end_of_text|>` Llama 3, `</s>` Llama 2/Mistral, `<eos>` Gemma);
  * BOS = `bos_token` of that config, else the usual begin tokens; it is prepended (`add_bos`) when the
    config says `add_bos_token: true`, or, without that key, when the tokenizer's own post-processor
    puts it first (Llama 2/3 and Mistral do, GPT-2 does not);
  * text is encoded with `add_special_tokens=False` and special tokens are NOT recognised inside the
    text (`encode_special_tokens`): a document that literally contains "<|endoftext|>" cannot forge an
    end of document, it is tokenized as ordinary characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalite.errors import DataError
from megalite.untrusted import loads_json

if TYPE_CHECKING:
    from megalite.data.documents import Replacements

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


def _token_text(entry: Any) -> str | None:
    """A tokenizer_config.json special-token entry: a string, or {"content": ...} (AddedToken)."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a `tokenizer.json` (the `Tokenizer` protocol)."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.backend = RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception with serde's message
            raise DataError(f"cannot read tokenizer {path!r} as a Hugging Face tokenizer.json "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        self.path = path
        self.backend.encode_special_tokens = True
        vocab = self.backend.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"tokenizer {path!r} has an empty vocabulary: train it (tools/train_tokenizer.py "
                            "--kind hf) or pass another tokenizer.json")
        self.vocab_size: int = max(vocab.values()) + 1
        config = self._config(Path(path).with_name("tokenizer_config.json"))
        eod_text = _token_text(config.get("eos_token")) or next((t for t in EOD_CANDIDATES if t in vocab), None)
        if eod_text is None or eod_text not in vocab:
            raise DataError(f"tokenizer {path!r} has no end-of-text token (looked for a tokenizer_config.json "
                            f"eos_token, then {', '.join(EOD_CANDIDATES)}): add a tokenizer_config.json with "
                            '{"eos_token": "<your end token>"} next to it')
        self.eod_id: int = vocab[eod_text]
        bos_text = _token_text(config.get("bos_token")) or next((t for t in BOS_CANDIDATES if t in vocab), None)
        self.bos_id: int | None = vocab.get(bos_text) if bos_text else None
        if "add_bos_token" in config:
            self.add_bos = bool(config["add_bos_token"]) and self.bos_id is not None
        else:
            with_special = self.backend.encode("a", add_special_tokens=True).ids
            self.add_bos = self.bos_id is not None and self.bos_id != self.eod_id and \
                bool(with_special) and with_special[0] == self.bos_id
        self.eod_text, self.bos_text = eod_text, bos_text

    @staticmethod
    def _config(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            config = loads_json(path.read_text(encoding="utf-8"), str(path), DataError)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {str(path)!r} ({e}): fix or remove it") from e
        return config if isinstance(config, dict) else {}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added or recognised."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens (BOS, EOD) decode to nothing, as in the other kinds."""
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def train_hf_tokenizer(files: list[str], output: str, vocab_size: int, json_key: str | None = None,
                       max_bytes: int | None = None, replaced: Replacements | None = None) -> str:
    """Train a GPT-2-style byte-level BPE `tokenizer.json` on `files` (read like preprocessing inputs);
    returns the written path. No normalizer and no added prefix space, so `decode(encode(x)) == x` for any
    text; `<|endoftext|>` (id 0) ends documents. tools/export_hf.py --tokenizer copies it as is."""
    import os

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from megalite.data.documents import iter_documents
    from megalite.data.tokenizer_spm import training_sentences

    if vocab_size < 300:  # 1 special token + 256 byte symbols, plus some merges
        raise DataError(f"vocab_size={vocab_size} is too small: the byte alphabet alone needs 257 ids; use >= 300")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sentences = list(training_sentences(iter_documents(files, json_key, replaced=replaced), max_bytes))
    if not sentences:
        raise DataError(f"no text found in {files}: the tokenizer needs a non-empty corpus")
    tok.train_from_iterator(sentences, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, output)  # atomic: a reader never sees half a file
    return output
