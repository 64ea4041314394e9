"""Reshard a megalite checkpoint offline (CPU, one process) for another tp/pp/vpp, or to full tensors.

    python tools/reshard_checkpoint.py --input ckpt/step_00001000 --output ckpt_tp2pp2 --tp 2 --pp 2
    python tools/reshard_checkpoint.py --input ckpt --output ckpt_full --unsharded

Any megalite checkpoint already loads under any layout (each rank reads the slices it needs); resharding
makes each target rank read exactly one file, or (--unsharded) gives one safetensors file of full,
unpadded tensors with its index. Tensors stream through one at a time: memory ~ the largest tensor.
--input may be a step directory or a checkpoint root (its `latest` is used). Continue training with
`--checkpoint.load OUTPUT`.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/reshard_checkpoint.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.offline import reshard  # noqa: E402
from megalite.checkpoint.sharded import find, read_index  # noqa: E402
from megalite.errors import CheckpointError, ConfigError, entry_point, one_line_arguments  # noqa: E402

__all__ = ["main", "reshard"]


def build_parser() -> argparse.ArgumentParser:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--input", required=True, metavar="CKPT", help="checkpoint step directory or root")
    p.add_argument("--output", required=True, metavar="DIR", help="new checkpoint directory (must not exist)")
    add_layout_arguments(p)
    p.add_argument("--unsharded", action="store_true", help="one file of full tensors (same as tp=pp=vpp=1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def add_layout_arguments(p: argparse.ArgumentParser, when: str = "") -> None:
    """--tp/--pp/--vpp/--pp-layers of a target checkpoint layout (`when`: a prefix for the help texts)."""
    p.add_argument("--tp", type=int, default=1, help=f"{when}target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help=f"{when}target pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help=f"{when}target virtual stages (chunks) per pipeline rank")
    p.add_argument("--pp-layers", default="", metavar="N,N,...", help=f"{when}layers per virtual stage (default: even)")


def parse_pp_layers(text: str) -> list[int] | None:
    """`--pp-layers 2,2,4` -> [2, 2, 4]; empty -> None (even split)."""
    if not text.strip():
        return None
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r} must be comma-separated whole numbers, e.g. 2,2,4") from None
    if any(n < 1 for n in layers):
        raise ConfigError(f"--pp-layers {text!r}: every stage needs at least 1 layer")
    return layers


def check_target(info: dict, tp: int, pp: int, vpp: int, pp_layers: list[int] | None) -> None:
    """The target layout must fit the checkpoint's model, or ConfigError naming the numbers."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--vpp", vpp)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    for dim in ("num_heads", "num_kv_heads", "ffn_hidden_size"):
        if info[dim] % tp:
            raise ConfigError(f"--tp {tp} does not divide model {dim}={info[dim]}: choose a tp that does")
    stages, layers = pp * vpp, info["num_layers"]
    if pp_layers is None and layers % stages:
        raise ConfigError(f"the model's {layers} layers do not split evenly over --pp {pp} x --vpp {vpp} = {stages} "
                          "stages: give --pp-layers")
    if pp_layers is not None and (len(pp_layers) != stages or sum(pp_layers) != layers):
        raise ConfigError(f"--pp-layers {','.join(map(str, pp_layers))} must have {stages} entries (--pp x --vpp) "
                          f"summing to the model's {layers} layers")


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    src = find(args.input, "")
    if src is None:
        raise CheckpointError(f"--input {args.input}: give a checkpoint directory, not {args.input!r}")
    tp, pp, vpp = (1, 1, 1) if args.unsharded else (args.tp, args.pp, args.vpp)
    pp_layers = None if args.unsharded else parse_pp_layers(args.pp_layers)
    check_target(read_index(src)["model"], tp, pp, vpp, pp_layers)
    out = reshard(src, args.output, tp, pp, vpp, pp_layers, show_progress=not args.quiet)
    print(f"wrote {out} (tp={tp} pp={pp} vpp={vpp})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
