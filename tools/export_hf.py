"""Export a megalite checkpoint (any layout) to a Hugging Face model directory.

    python tools/export_hf.py --input ckpt/step_00001000 --output hf_model --tokenizer tokenizer.json
    python tools/export_hf.py --input ckpt --output hf_model_bf16 --tokenizer cl100k_base.tiktoken --dtype bf16

Writes config.json + model.safetensors (fp32, or bf16 with --dtype bf16) for LlamaForCausalLM
(model.arch=llama) or GPT2LMHeadModel (model.arch=gpt2); a MoE model as MixtralForCausalLM (mixtral router)
or Qwen3MoeForCausalLM (qwen3 router with model.qk_norm), a dense one with model.qk_norm as Qwen3ForCausalLM,
one with multi-head latent attention ([mla]) as DeepseekV3ForCausalLM (its MTP layers as the hub stores them),
one with attention sinks as GptOssForCausalLM, one with Gemma's post-norms and embedding scale as
Gemma3ForCausalLM, one with linear_attention layers (or a gated shared expert, or the element output gate with q/k
norm) as Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM; a layer pattern or attention variant no such family computes is refused by name.
What the target format has no place for (the MTP modules of a model without MLA) is named on the last line.
With --tokenizer (a Hugging Face tokenizer.json, a tiktoken file, or a SentencePiece .model from
tools/train_tokenizer.py) it also writes tokenizer.json + tokenizer_config.json, so that
`AutoTokenizer.from_pretrained("hf_model")` and `AutoModelForCausalLM.from_pretrained("hf_model")` give
megalite's token ids and logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as `python tools/export_hf.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.interop.hf import export_hf, not_exported  # noqa: E402
from megalite.checkpoint.interop.hf_families import MAPPING  # noqa: E402
from megalite.errors import entry_point, one_line_arguments  # noqa: E402

__all__ = ["main", "export_hf"]


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--input", required=True, metavar="CKPT", help="checkpoint step directory or root")
    p.add_argument("--output", required=True, metavar="HF_DIR", help="directory for config.json + model.safetensors")
    p.add_argument("--tokenizer", default="", metavar="FILE",
                   help="also write this tokenizer (tokenizer.json, tiktoken or SentencePiece file) for AutoTokenizer")
    p.add_argument("--chat-template", default="", metavar="FILE",
                   help="Jinja chat template for tokenizer_config.json (default: an SFT run's data.chat_template)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weight dtype (default fp32: exact)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    out = export_hf(args.input, args.output, show_progress=not args.quiet, tokenizer=args.tokenizer,
                    dtype=args.dtype, mapping=MAPPING,
                    chat_template=args.chat_template)
    extra = " and the tokenizer" if args.tokenizer else ""
    left = not_exported(args.input, MAPPING)
    arch = json.loads((out / "config.json").read_text()).get("architectures", ["its format"])[0]
    dropped = f"; not exported ({arch} has no place for them): {', '.join(left)}" if left else ""
    print(f"wrote {out}/config.json and {out}/model.safetensors{extra}{dropped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
