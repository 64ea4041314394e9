"""Export a megalite checkpoint (any layout) to a Hugging Face model directory.

    python tools/export_hf.py --input ckpt/step_00001000 --output hf_model

Writes config.json + model.safetensors (fp32) for LlamaForCausalLM (model.arch=llama) or GPT2LMHeadModel
(model.arch=gpt2); load it with `AutoModelForCausalLM.from_pretrained("hf_model")`. The tokenizer is
not part of a checkpoint: copy or convert it separately.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/export_hf.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.hf import export_hf  # noqa: E402
from megalite.errors import entry_point, one_line_arguments  # noqa: E402

__all__ = ["main", "export_hf"]


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--input", required=True, metavar="CKPT", help="checkpoint step directory or root")
    p.add_argument("--output", required=True, metavar="HF_DIR", help="directory for config.json + model.safetensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    out = export_hf(args.input, args.output, show_progress=not args.quiet)
    print(f"wrote {out}/config.json and {out}/model.safetensors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
