"""Does streamed data keep up with training? The raw-data loader's tokens/s against a training step's.

Corpus: the demo corpus's documents (Python standard library source) as JSON lines; tokenizer: a byte-level BPE
`tokenizer.json` (the `tokenizers` package, as most Hugging Face models ship) trained on it. Measured:

- loader: `StreamLoader` draining `--steps` steps of `--batch` x `--seq-len` tokens as fast as it can, with
  `data.workers` = 0 (in the loader thread), 1 and 2 tokenizer processes; tokens/s after the first step (which
  waits for the workers to start);
- step: `train_step` of the llama-160m dims (134M params, fp32, one process) on 1 x `--seq-len` tokens, tokens/s;
- and, from the same FLOPs count the training log uses (6N + 12 L h s per token), the step's tokens/s on one H200
  at 40% MFU (989 TFLOP/s dense bf16 peak): an estimate, marked as such, of what a GPU asks of the loader.

    python bench/data_loader.py            # a few minutes on 2 shared cores
    python bench/data_loader.py --smoke    # seconds
Writes <out>/data_loader.{json,md} (default runs/bench; --out bench/results updates the published figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402

from bench.results_io import write_results  # noqa: E402
from megalite.config import config_from_dict  # noqa: E402
from megalite.config.schema import Config, ModelArgs  # noqa: E402
from megalite.data.demo import stdlib_documents  # noqa: E402
from megalite.data.loader import RankSlice, StreamLoader  # noqa: E402
from megalite.data.tokenizer import load_tokenizer  # noqa: E402
from megalite.data.tokenizer_hf import train_hf_tokenizer  # noqa: E402
from megalite.perfmodel.flops import model_flops_per_token  # noqa: E402

H200_PEAK, MFU = 989e12, 0.4


def _corpus(root: Path, max_bytes: int, vocab: int) -> tuple[Path, str]:
    docs = stdlib_documents(max_bytes)
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_hf_tokenizer([str(path)], str(root / "tokenizer.json"), vocab, json_key="text",
                             max_bytes=min(max_bytes, 2_000_000))
    return path, tok


def loader_rate(corpus: Path, tok: str, workers: int, steps: int, batch: int, seq_len: int) -> float:
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer, cfg.data.workers, cfg.data.valid_fraction = [str(corpus)], tok, workers, 0.0
    cfg.model.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = seq_len, batch, batch
    cfg.data.prefetch = 1  # so the steps timed are produced while timed, not drained from a full queue
    ld = StreamLoader(cfg, RankSlice(1, 0), load_tokenizer(tok))
    try:
        ld.next_step()  # the workers start, the first batches are encoded
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            ld.next_step()
        return (steps - 1) * batch * seq_len / (time.perf_counter() - t0)
    finally:
        ld.close()


def step_rate(seq_len: int, steps: int, preset: str) -> tuple[float, float]:
    """Measured CPU tokens/s of the preset's training step, and the H200 estimate at 40% MFU."""
    from types import SimpleNamespace

    from megalite.model.gpt import GPT
    from megalite.optim.loss_scale import LossScaler
    from megalite.optim.reference import ReferenceOptimizer
    from megalite.parallel.state import ParallelState
    from megalite.training.step import StepContext, train_step

    cfg = config_from_dict({"model": {"preset": preset}})
    cfg.model.seq_len, cfg.model.vocab_size, cfg.model.kernels = seq_len, 32000, "torch"
    cfg.model.num_kv_heads = cfg.model.num_kv_heads or cfg.model.num_heads
    cfg.model.ffn_hidden_size = cfg.model.ffn_hidden_size or 2048
    cfg.model.tie_embeddings = False
    state = ParallelState()
    model = GPT(ModelArgs.of(cfg.model, cfg.moe), state, seed=1)
    n_params = sum(p.numel() for p in model.parameters())
    opt = ReferenceOptimizer(model, state, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    ctx = StepContext.build(model, state, torch.float32, SimpleNamespace(lr=1e-4, min_lr=1e-4, warmup_steps=0,
                                                                         steps=steps, clip_grad=1.0), LossScaler(False))
    x = torch.randint(0, 32000, (1, seq_len + 1))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        train_step(ctx, opt, [(x[:, :-1], x[:, 1:])], i)
        times.append(time.perf_counter() - t0)
    best = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    m = cfg.model
    gpu = MFU * H200_PEAK / model_flops_per_token(n_params, m.num_layers, m.hidden_size, seq_len)
    return seq_len / best, gpu


def _md(res: dict[str, Any]) -> str:
    lines = [f"# Streamed data loader vs the training step ({res['date']}, {res['machine']})", "",
             f"Corpus {res['corpus_mb']:.1f} MB of JSON lines (stdlib source), a {res['vocab']}-id byte-level BPE, "
             f"samples of {res['seq_len']} tokens; load average before {res['load_before']}, after {res['load_after']}.",
             "", "| what | tokens/s |", "|---|---:|"]
    for w, r in res["loader"].items():
        lines.append(f"| loader, data.workers = {w} | {r:,.0f} |")
    lines.append(f"| llama-160m training step, this CPU (fp32, 1 x {res['seq_len']}) | {res['step_cpu']:,.0f} |")
    lines.append(f"| llama-160m step on one H200 at 40% MFU (estimate, bf16 peak 989 TFLOP/s) | {res['step_h200_est']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
    mb, steps, seq, vocab = (0.3, 12, 256, 512) if args.smoke else (6.0, 40, 2048, 8192)
    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        corpus, tok = _corpus(Path(tmp), int(mb * 1e6), vocab)
        loader = {w: loader_rate(corpus, tok, w, steps, 8, seq) for w in ((0, 1) if args.smoke else (0, 1, 2))}
        cpu, h200 = step_rate(seq if not args.smoke else 64, 2 if args.smoke else 3, "tiny" if args.smoke else "llama-160m")
        res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} cores, torch {torch.__version__}", "corpus_mb": corpus.stat().st_size / 1e6,
               "vocab": vocab, "seq_len": seq, "loader": loader, "step_cpu": cpu, "step_h200_est": h200,
               "load_before": load_before, "load_after": " / ".join(f"{x:.1f}" for x in os.getloadavg())}
    write_results(Path(args.out), "data_loader", res, _md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
