"""Import a Hugging Face LlamaForCausalLM / GPT2LMHeadModel / MixtralForCausalLM / Qwen3MoeForCausalLM /
Qwen3ForCausalLM / DeepseekV3ForCausalLM (DeepSeek's FP8 release too) / GptOssForCausalLM (the hub's MXFP4 release
too) / Gemma3ForCausalLM / Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM (the hub's
Qwen3.5 ForConditionalGeneration releases: their text model) directory as a megalite checkpoint.

    python tools/import_hf.py --input hf_model --output ckpt_from_hf
    python pretrain.py --checkpoint.load ckpt_from_hf --data.path ... --data.tokenizer hf_model

The checkpoint is at step 0 with no optimizer state (the optimizer starts fresh) and loads under any
layout. The model dims it was imported with are in ckpt_from_hf/index.json ("model"): pretrain.py takes
them from there (no model flags needed), and refuses model flags that contradict them, naming each. A MoE
model's routing (the [moe] section, as moe_* keys; docs/moe.md) and Qwen3's q/k norm (model.qk_norm) are
recorded there too, as are gpt-oss's, Gemma 3's and Qwen3.5's layer pattern and attention variants
(docs/attention.md, docs/linear-attention.md).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/import_hf.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.interop.hf import import_hf  # noqa: E402
from megalite.checkpoint.interop.hf_families import MAPPING  # noqa: E402
from megalite.errors import entry_point, one_line_arguments  # noqa: E402

__all__ = ["main", "import_hf"]


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--input", required=True, metavar="HF_DIR", help="directory with config.json + model.safetensors")
    p.add_argument("--output", required=True, metavar="CKPT", help="new checkpoint directory (must not exist)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    out = import_hf(args.input, args.output, show_progress=not args.quiet, mapping=MAPPING)
    print(f"wrote {out}: continue with --checkpoint.load {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
