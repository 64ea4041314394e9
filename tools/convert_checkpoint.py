"""Convert checkpoints between megalite and other frameworks (CPU, one process).

    python tools/convert_checkpoint.py --from megalite --to dcp --input ckpt --output ckpt_dcp
    python tools/convert_checkpoint.py --from dcp --to megalite --input ckpt_dcp --output ckpt2 --tp 2 --pp 2
    python tools/convert_checkpoint.py --from megalite --to torchtitan --input ckpt --output titan_step
    python tools/convert_checkpoint.py --from torchtitan --to megalite --input titan/checkpoint/step-1000 \\
        --output ckpt --model-args titan_model_args.json
    python tools/convert_checkpoint.py --from megatron --to megalite --input megatron_ckpt --output ckpt --tp 2

Formats: `megalite` (a step directory or a root with `latest`); `dcp`: plain torch.distributed.checkpoint in
megalite's names, with the optimizer state (docs/checkpoints.md); `torchtitan`: torchtitan's Llama 3 DCP
checkpoint (its names, its RoPE layout; model and optimizer state); `megatron`: a Megatron-LM checkpoint,
`torch_dist` (DCP) or legacy `iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt`, Llama- or GPT-2-style (input only;
the model weights and the iteration; a checkpoint with optimizer state needs --weights-only).
A megalite output can be laid out for any --tp/--pp/--vpp; the model dims always come from the input.
Every tensor and buffer is carried or the conversion is refused; optimizer state the target cannot hold (Muon's
momentum into torchtitan's AdamW, Megatron's optimizer) is refused unless --weights-only; what is knowingly not
carried (a scheduler, RNG states) is named on one line. The output is read back by megalite's own reader before
the tool reports success. Bad input is one line and exit code 4; the output is written under a temporary name
and renamed when complete, so nothing that exists is changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/convert_checkpoint.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.interop.source import Source, from_megalite, to_megalite, weights_only  # noqa: E402
from megalite.checkpoint.files import refuse_output_in_checkpoint  # noqa: E402
from megalite.checkpoint.sharded import find  # noqa: E402
from megalite.errors import CheckpointError, entry_point, one_line_arguments  # noqa: E402
from tools.reshard_checkpoint import add_layout_arguments, check_target, parse_pp_layers  # noqa: E402

SOURCES = ("megalite", "dcp", "torchtitan", "megatron")
TARGETS = ("megalite", "dcp", "torchtitan")


def build_parser() -> argparse.ArgumentParser:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--from", dest="src", required=True, choices=SOURCES, help="input format")
    p.add_argument("--to", dest="dst", required=True, choices=TARGETS, help="output format")
    p.add_argument("--input", required=True, metavar="DIR", help="input checkpoint directory")
    p.add_argument("--output", required=True, metavar="DIR", help="new output directory (must not exist)")
    add_layout_arguments(p, "--to megalite: ")
    p.add_argument("--model-args", default="", metavar="JSON",
                   help="--from torchtitan: what its checkpoint does not record (a JSON file of torchtitan's "
                        "model args: n_heads, n_kv_heads, norm_eps, rope_theta, max_seq_len; dim, n_layers, "
                        "vocab_size, hidden_dim are read from the tensors and, if given, checked); default: the "
                        "input's 'megalite_model_args.json', which megalite writes into every torchtitan output")
    p.add_argument("--torchtitan-fused-qkv", action="store_true",
                   help="--to torchtitan: for a model built with fuse_qkv=True (its optimizer state is of the fused wqkv)")
    p.add_argument("--weights-only", action="store_true",
                   help="convert the model's tensors and buffers alone, leaving the optimizer state behind (the "
                        "target starts it fresh); needed where the target cannot hold the input's optimizer state")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def read_source(fmt: str, path: Path, model_args: str, no_optimizer: bool = False) -> Source:
    if fmt == "megalite":
        src = find(str(path), "")
        if src is None:
            raise CheckpointError(f"--input {path}: give a checkpoint directory")
        return from_megalite(src)
    if fmt == "dcp":
        from megalite.checkpoint.interop.dcp import from_dcp

        return from_dcp(path)
    if fmt == "torchtitan":
        from megalite.checkpoint.interop.torchtitan import from_torchtitan

        return from_torchtitan(path, Path(model_args) if model_args else None, no_optimizer)
    from megalite.checkpoint.interop.megatron import from_megatron

    return from_megatron(path, no_optimizer)


def check_written(fmt: str, out: Path, source: Source) -> None:
    """Read `out` back with megalite's own reader (index or metadata checks, every tensor's shape, the step): a
    conversion never reports success for a checkpoint megalite would refuse. On a failure `out` (which this
    run created) is removed."""
    try:
        back = read_source(fmt, out, "")
        back.close()
        if back.shapes != source.shapes or back.step != source.step:
            diff = sorted(set(back.shapes) ^ set(source.shapes)) or \
                [k for k in source.shapes if back.shapes.get(k) != source.shapes[k]] or ["the step"]
            raise CheckpointError(f"the written {out} reads back differently ({diff[0]}): a megalite bug, please "
                                  "report it")
        check_loadable(back)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def check_loadable(source: Source) -> None:
    """The model its dims describe (built on the meta device: no memory) must hold exactly its tensors, as
    `load_sharded` will ask for them; optimizer state only for the model's parameters, of their shapes."""
    import torch

    from megalite.checkpoint.index_check import model_info_problems
    from megalite.checkpoint.sharded import stored_shapes
    from megalite.inference.load import model_config_from_info
    from megalite.model.gpt import GPT
    from megalite.mtp.config import MTPConfig
    from megalite.parallel.state import ParallelState

    problems = model_info_problems(source.info)
    if problems:
        raise CheckpointError(f"the input's model dims are not a model megalite builds ({'; '.join(problems)}): "
                              "the checkpoint's metadata is damaged or contradicts itself; not converted")
    try:
        cfg = model_config_from_info(source.info)
        cfg.mtp = MTPConfig(num_layers=int(source.info.get("mtp_layers", 0)))  # carried, not left out as generation does
        with torch.device("meta"):
            model = GPT(cfg, ParallelState(), seed=0)
    except Exception as e:  # noqa: BLE001  (any failure to build the model is the dims' fault, said in one line)
        raise CheckpointError(f"the input's model dims do not build a megalite model ({type(e).__name__}: {e}): "
                              "the checkpoint's metadata is inconsistent; not converted") from None
    want = stored_shapes(model)
    for key, shape in source.shapes.items():
        kind, name = key.split("/", 1)
        need = want.get(key if kind in ("param", "buffer") else f"param/{name}")
        if need != shape:
            raise CheckpointError(f"tensor {key} {list(shape)} is not in the model its dims describe"
                                  + (f" (which has {list(need)})" if need else "") + ": the input checkpoint's "
                                  "dims contradict its tensors; not converted")
    other = {"exp_avg": "exp_avg_sq", "exp_avg_sq": "exp_avg"}
    half = next((k for k in source.shapes if k.split("/", 1)[0] in other
                 and f"{other[k.split('/', 1)[0]]}/{k.split('/', 1)[1]}" not in source.shapes), None)
    if half is not None:  # the optimizer would resume one moment with the other missing
        raise CheckpointError(f"the input has {half} without its other moment: its optimizer state is incomplete; "
                              "convert with --weights-only")
    missing = sorted(set(want) - set(source.shapes))
    if missing:
        raise CheckpointError(f"the model its dims describe needs {missing[0]}, which the input lacks: the input "
                              "checkpoint is incomplete; not converted")


def not_carried(source: Source, dst: str) -> list[str]:
    """What the output knowingly lacks, one phrase each (the reader's list, and what the target has no place for)."""
    out = list(source.dropped)
    if dst == "torchtitan" and source.extra:
        out.append(f"megalite's {', '.join(sorted(source.extra))} (torchtitan's checkpoint has no place for them)")
    return out


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.src == args.dst and args.src != "megalite":
        raise CheckpointError(f"--from {args.src} --to {args.dst}: nothing to convert")
    out = Path(args.output)
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"--output {out} already exists: choose a new directory or delete it first")
    refuse_output_in_checkpoint(out, "--output")
    src = Path(args.input).resolve()
    if src == out.resolve() or src in out.resolve().parents:  # the input must stay as it was
        raise CheckpointError(f"--output {out} lies inside --input {args.input}: it would change the input "
                              f"checkpoint; write it beside it, e.g. {src.parent / out.name}")
    pp_layers = parse_pp_layers(args.pp_layers)
    source = read_source(args.src, Path(args.input), args.model_args, args.weights_only)
    if args.weights_only:
        source = weights_only(source)
    try:
        check_loadable(source)  # before anything is written
    except BaseException:
        source.close()
        raise
    if args.dst == "megalite":
        check_target(source.info, args.tp, args.pp, args.vpp, pp_layers)
        to_megalite(source, out, args.tp, args.pp, args.vpp, pp_layers, show_progress=not args.quiet)
        where = f" (tp={args.tp} pp={args.pp} vpp={args.vpp})"
    elif args.dst == "dcp":
        from megalite.checkpoint.interop.dcp import to_dcp

        to_dcp(source, out)
        where = " (torch.distributed.checkpoint)"
    else:
        from megalite.checkpoint.interop.torchtitan import to_torchtitan

        to_torchtitan(source, out, fused_qkv=args.torchtitan_fused_qkv)
        where = " (torchtitan DCP)"
    check_written(args.dst, out, source)
    missing = not_carried(source, args.dst)
    print(f"wrote {out}{where}" + (f"; not carried: {'; '.join(missing)}" if missing else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
