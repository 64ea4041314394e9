"""Generate text from a megalite checkpoint (any saved layout), streaming it to stdout as it is written.

    python tools/generate.py --checkpoint ckpt --prompt "def main("                       # greedy
    python tools/generate.py --checkpoint ckpt --prompt "import" --temperature 0.8 --top-p 0.95 --seed 1
    python tools/generate.py --checkpoint ckpt_from_hf --tokenizer tokenizer.json --prompt "Once upon"

The model is loaded into one process (CPU, or the GPU with --device cuda) from any tp/pp/dp/ZeRO layout;
its dims come from the checkpoint. The tokenizer is --tokenizer, else the one the run trained with (read
from the checkpoint's saved config). Decoding uses a KV cache; it stops at the tokenizer's end-of-document
token, after --max-tokens, or at the model's seq_len.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as `python tools/generate.py`: make `megalite` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import math  # noqa: E402

import torch  # noqa: E402

from megalite.errors import ConfigError, entry_point, one_line_arguments  # noqa: E402
from megalite.inference.generate import SamplingConfig, TextStream, generate_ids  # noqa: E402
from megalite.inference.load import check_vocab, load_model, tokenizer_for  # noqa: E402

__all__ = ["main"]

# A temperature below this divides logits past float32's range (inf - inf = NaN in the softmax); above the
# upper one every token is equally likely to within float32: neither is a meaningful setting.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MAX_NEW_TOKENS = 1 << 20
SIGPIPE_EXIT = 141  # what a shell reports for a writer whose reader went away (128 + SIGPIPE), e.g. `| head`


def build_parser() -> argparse.ArgumentParser:
    p = one_line_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint step directory or root")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--tokenizer", default="", metavar="FILE", help="tokenizer file; default: the run's")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 = greedy (default); {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} samples")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, 0 < P <= 1 (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, 0 <= SEED < 2**64")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="compute dtype (weights load as fp32)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every token (slow; a check)")
    p.add_argument("--ignore-eod", action="store_true", help="keep going past the end-of-document token")
    return p


def sampling_from(args: argparse.Namespace) -> SamplingConfig:
    """The sampling settings, each flag checked by name (SamplingConfig's own check knows no flags)."""
    t, top_p = args.temperature, args.top_p
    problems = []
    if not 0 <= args.max_tokens <= MAX_NEW_TOKENS:
        problems.append(f"--max-tokens {args.max_tokens}: need 0 <= N <= {MAX_NEW_TOKENS}")
    if not (t == 0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
        problems.append(f"--temperature {t}: need 0 (greedy) or a number from {MIN_TEMPERATURE:g} to "
                        f"{MAX_TEMPERATURE:g}")
    if args.top_k < 0:
        problems.append(f"--top-k {args.top_k}: need K >= 0 (0 = no cut)")
    if not 0 < top_p <= 1:  # also refuses NaN
        problems.append(f"--top-p {top_p}: need 0 < P <= 1 (1 = no cut)")
    if not 0 <= args.seed < 2**64:
        problems.append(f"--seed {args.seed}: need 0 <= SEED < 2**64")
    if problems:
        raise ConfigError("; ".join(problems))
    return SamplingConfig(args.max_tokens, t, args.top_k, top_p, args.seed)


def _utf8_prompt(prompt: str) -> str:
    try:
        prompt.encode("utf-8")  # a command line in another encoding arrives as surrogate escapes
    except UnicodeEncodeError as e:
        raise ConfigError(f"--prompt is not UTF-8 text (byte {e.start}): pass it in UTF-8") from None
    return prompt


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device: use --device cpu")
    sampling = sampling_from(args)
    text = _utf8_prompt(args.prompt)
    model, index = load_model(args.checkpoint, device)
    tok = tokenizer_for(index, args.tokenizer)
    check_vocab(model, tok)
    prompt = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text)
    if not prompt:
        raise ConfigError("--prompt is empty and the tokenizer adds no BOS: give at least one character")
    if len(prompt) >= model.cfg.seq_len:
        raise ConfigError(f"the prompt is {len(prompt)} tokens but the model's seq_len is {model.cfg.seq_len}: "
                          "shorten it")
    sampling = SamplingConfig(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
                              sampling.seed, () if args.ignore_eod else (tok.eod_id,))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stream = TextStream(tok.decode)
    try:
        print(text, end="", flush=True)
        for token in generate_ids(model, prompt, sampling, use_cache=not args.no_cache, dtype=dtype):
            print(stream.push(token), end="", flush=True)
        print(stream.flush(), flush=True)
    except BrokenPipeError:  # the reader stopped (`| head`): not an error of ours, and nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush must not raise again
        return SIGPIPE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
