"""Train a BPE tokenizer that round-trips any text exactly: SentencePiece (default) or a Hugging Face tokenizer.json.

    python tools/train_tokenizer.py --input a.txt b.txt --model-prefix tok --vocab-size 32000
    python tools/train_tokenizer.py --input corpus.jsonl --json-key text --model-prefix tok --vocab-size 32000
    python tools/train_tokenizer.py --input corpus.jsonl --json-key text --model-prefix tok --vocab-size 32000 \
        --kind hf

--kind sentencepiece writes `<model-prefix>.model` (megalite/data/tokenizer_spm.py; ids: unk=0, bos=1, eos=2 =
end of document, no pad). --kind hf writes `<model-prefix>.json`, a GPT-2-style byte-level BPE
(`<|endoftext|>` = 0 ends documents): `--model-prefix tokenizer` makes the `tokenizer.json` the README's next
commands read. Both export for `AutoTokenizer` (tools/export_hf.py --tokenizer).

To start from a tokenizer people already use instead (GPT-2's or Llama 3's `tokenizer.json`, a tiktoken
file such as `cl100k_base.tiktoken`), skip this tool: tools/preprocess_data.py and `--data.tokenizer`
take those files directly.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/train_tokenizer.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.documents import Replacements  # noqa: E402
from megalite.data.tokenizer import train_tokenizer  # noqa: E402
from megalite.errors import ConfigError, entry_point, one_line_arguments  # noqa: E402
from megalite.data.tokenizer_hf import train_hf_tokenizer  # noqa: E402

__all__ = ["main", "train_tokenizer"]


def build_parser() -> argparse.ArgumentParser:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="text files (one document each) or .jsonl files (with --json-key)")
    p.add_argument("--model-prefix", required=True, metavar="P", help="writes P.model (sentencepiece) or P.json (hf: P=tokenizer gives tokenizer.json)")
    p.add_argument("--kind", default="sentencepiece", choices=("sentencepiece", "hf"),
                   help="sentencepiece .model (default) or Hugging Face tokenizer.json")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N", help="number of ids (>= 300)")
    p.add_argument("--json-key", default=None, metavar="K", help="inputs are JSON lines; documents are obj[K]")
    p.add_argument("--max-bytes", type=int, default=None, metavar="B",
                   help="train on at most B bytes of text (training memory grows with the corpus)")
    return p


MAX_VOCAB = 2**20


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vocab_size > MAX_VOCAB:
        raise ConfigError(f"--vocab-size {args.vocab_size} is above {MAX_VOCAB} (2^20, five times the largest "
                          "common tokenizer): training would need memory no machine has")
    if args.kind != "hf" and args.vocab_size < 300:  # SentencePiece with byte fallback
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: byte fallback alone needs 259 ids; use >= 300")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise ConfigError(f"--max-bytes {args.max_bytes} must be >= 1 (or left out for all the text)")
    replaced = Replacements()  # unpaired surrogates of JSON lines become U+FFFD: counted, and said below
    if args.kind == "hf":
        path = train_hf_tokenizer(args.input, args.model_prefix + ".json", args.vocab_size,
                                  json_key=args.json_key, max_bytes=args.max_bytes, replaced=replaced)
    else:
        path = train_tokenizer(args.input, args.model_prefix, args.vocab_size, json_key=args.json_key,
                               max_bytes=args.max_bytes, replaced=replaced)
    if replaced.note():
        print(replaced.note(), file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
