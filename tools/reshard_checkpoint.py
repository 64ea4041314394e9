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
from megalite.errors import CheckpointError, ConfigError, MegaliteError, report  # noqa: E402

__all__ = ["main", "reshard"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, metavar="CKPT", help="checkpoint step directory or root")
    p.add_argument("--output", required=True, metavar="DIR", help="new checkpoint directory (must not exist)")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="target virtual stages (chunks) per pipeline rank")
    p.add_argument("--pp-layers", default="", metavar="N,N,...", help="layers per virtual stage (default: even)")
    p.add_argument("--unsharded", action="store_true", help="one file of full tensors (same as tp=pp=vpp=1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        src = find(args.input, "")
        if src is None:
            raise CheckpointError(f"--input {args.input}: give a checkpoint directory, not {args.input!r}")
        tp, pp, vpp = (1, 1, 1) if args.unsharded else (args.tp, args.pp, args.vpp)
        info = read_index(src)["model"]
        for dim in ("num_heads", "num_kv_heads", "ffn_hidden_size"):
            if info[dim] % tp:
                raise ConfigError(f"--tp {tp} does not divide model {dim}={info[dim]}: choose a tp that does")
        pp_layers = [int(x) for x in args.pp_layers.split(",") if x] or None
        out = reshard(src, args.output, tp, pp, vpp, pp_layers, show_progress=not args.quiet)
    except MegaliteError as e:
        return report(e)
    print(f"wrote {out} (tp={tp} pp={pp} vpp={vpp})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
