"""Tokenize text or JSON-lines files into a megalite `.bin`/`.idx` dataset.

    python tools/preprocess_data.py --input a.txt b.txt --tokenizer tok.model --output-prefix data/mine
    python tools/preprocess_data.py --input corpus.jsonl --json-key text --tokenizer tokenizer.json \\
        --output-prefix data/mine
    python tools/preprocess_data.py --input shards/ --json-key text --tokenizer tokenizer.json \\
        --output-prefix data/mine

--input takes what `--data.path` streams, read by the same readers: JSON lines plain, .gz or .zst, parquet (the
--json-key column), a directory of them (every such file, sorted; what else it holds is named), a datasets
save_to_disk directory. Text files are one document each (--split-paragraphs: one per paragraph).

--tokenizer is a SentencePiece .model, a Hugging Face tokenizer.json (or a model directory holding one) or
a tiktoken encoding file; the kind is read from the file. Each document is followed by the tokenizer's
end-of-document id (and preceded by BOS where the tokenizer's convention adds one: --add-bos/--no-add-bos
overrides). Vocabularies above 65,536 ids are stored as uint32. The output is byte-identical for any
--workers (default: one per core; more workers than cores only compete for them). Train with `--data.path data/mine --data.tokenizer tokenizer.json`.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/preprocess_data.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.documents import Replacements  # noqa: E402
from megalite.data.indexed import strip_suffix  # noqa: E402
from megalite.data.preprocess import ReadOptions, preprocess  # noqa: E402
from megalite.runtime.threads import available_cores  # noqa: E402
from megalite.errors import ConfigError, entry_point, one_line_arguments  # noqa: E402

__all__ = ["main", "preprocess"]


def build_parser() -> argparse.ArgumentParser:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="text files (one document each), or with --json-key: .jsonl / .jsonl.gz / .jsonl.zst / "
                        ".parquet files, directories of them, datasets save_to_disk directories")
    p.add_argument("--tokenizer", required=True, metavar="FILE",
                   help="SentencePiece .model, Hugging Face tokenizer.json or tiktoken encoding file")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="prepend BOS to every document (default: the tokenizer's convention)")
    p.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin and P.idx")
    p.add_argument("--json-key", default=None, metavar="K",
                   help="inputs are records; documents are obj[K] (JSON lines) or column K (parquet, datasets)")
    p.add_argument("--split-paragraphs", action="store_true",
                   help="text inputs: one document per blank-line-separated paragraph")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help=f"tokenizer processes (default: the cores this process may use; more than that is slower; "
                        f"at most {max_workers()}, 4 per core)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def max_workers() -> int:
    """Each worker is a process importing torch and the tokenizer (~0.3 GB): beyond a few per core they
    only compete for the cores and memory."""
    return 4 * (os.cpu_count() or 1)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers is None:
        args.workers = available_cores()
    if not 1 <= args.workers <= max_workers():
        raise ConfigError(f"--workers {args.workers} must be between 1 and {max_workers()} (4 per core on this "
                          "machine)")
    name = os.path.basename(strip_suffix(args.output_prefix))  # `dir/.bin` is the prefix `dir/` too
    if name in ("", ".", ".."):
        raise ConfigError(f"--output-prefix {args.output_prefix!r} names a directory, not a file prefix: give "
                          f"e.g. {os.path.join(args.output_prefix, 'mine')!r} (writes mine.bin and mine.idx)")
    replaced = Replacements()
    read = ReadOptions(args.json_key, args.split_paragraphs)
    prefix = preprocess(args.input, args.tokenizer, args.output_prefix, read,
                        workers=args.workers, show_progress=not args.quiet, add_bos=args.add_bos, replaced=replaced)
    if replaced.note():
        print(replaced.note(), file=sys.stderr)
    print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
