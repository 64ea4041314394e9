"""megalite's training step vs Hugging Face transformers and a minimal nanoGPT-style loop, on CPU.

Same dims, batch, sequence, dtype (fp32), thread count and optimizer (torch's fused AdamW, betas (0.9, 0.95),
weight decay 0.1 on matrices, global-norm clip 1.0) for every implementation. One process runs
them all, interleaved: warm-up, then R repeats of K steps each, the implementation order rotated
every repeat so none always runs first (caches, turbo, a neighbour's load). Ratios are paired per
repeat (megalite / peer in the same repeat), so machine-wide drift cancels; min/median/max over
repeats. Peak RSS is measured per implementation in its own subprocess (see `measure_rss`).

    python bench/cpu_compare.py                 # ~2-3 minutes on 2 cores
    python bench/cpu_compare.py --smoke         # seconds: tiny dims, 1 repeat
Writes runs/bench/cpu_compare.{json,md}, or into --out DIR (--out bench/results updates the
published figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench.results_io import spread, write_results  # noqa: E402

from megalite.config import ModelArgs  # noqa: E402
from megalite.model.compile import compile_blocks  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.optim.config import OptimizerConfig  # noqa: E402
from megalite.optim.loss_scale import LossScaler  # noqa: E402
from megalite.optim import SyncOptions, build_distributed_optimizer  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.runtime.malloc import tune_malloc  # noqa: E402
from megalite.training.step import StepContext, train_step  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
StepFn = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Dims:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    seq: int = 128
    batch: int = 8
    vocab: int = 2048  # a multiple of 64: megalite pads nothing, so all models have the same head

    @property
    def ffn(self) -> int:  # llama's SwiGLU width round_up(int(8h/3), 64), as megalite resolves it
        return -(-int(8 * self.hidden / 3) // 64) * 64


# ----------------------------------------------------------------------------- the minimal loop


class MiniBlock(nn.Module):
    """nanoGPT-style llama block: the same math as megalite's (RMSNorm, rotate-half RoPE, GQA, SwiGLU)."""

    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = d.heads, d.kv_heads, d.hidden // d.heads
        self.n1, self.n2 = nn.Parameter(torch.ones(d.hidden)), nn.Parameter(torch.ones(d.hidden))
        self.qkv = nn.Linear(d.hidden, (d.heads + 2 * d.kv_heads) * self.hd, bias=False)
        self.proj = nn.Linear(d.hidden, d.hidden, bias=False)
        self.up = nn.Linear(d.hidden, 2 * d.ffn, bias=False)
        self.down = nn.Linear(d.ffn, d.hidden, bias=False)

    @staticmethod
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x, self.n1)).split([self.nh * self.hd, self.nkv * self.hd,
                                                          self.nkv * self.hd], dim=-1)
        q = self.rope(q.view(b, s, self.nh, self.hd).transpose(1, 2), cos, sin)
        k = self.rope(k.view(b, s, self.nkv, self.hd).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.nkv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nkv != self.nh)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.up(self.norm(x, self.n2)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class MiniLlama(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.emb = nn.Embedding(d.vocab, d.hidden)
        self.blocks = nn.ModuleList(MiniBlock(d) for _ in range(d.layers))
        self.nf = nn.Parameter(torch.ones(d.hidden))
        self.head = nn.Linear(d.hidden, d.vocab, bias=False)
        hd = d.hidden // d.heads
        ang = torch.outer(torch.arange(d.seq).float(), 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(MiniBlock.norm(x, self.nf))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# ----------------------------------------------------------------------------- the contenders


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    """The same groups as megalite's optimizer (decay on matrices only) and the same kernel: torch's fused
    AdamW, which is also Hugging Face Trainer's default optimizer (`adamw_torch_fused`, torch >= 2.8)."""
    ps = list({id(p): p for p in model.parameters()}.values())
    groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)


def _plain_step(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> StepFn:
    opt = _adamw(model)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return loss.item()

    return step


def build_megalite(d: Dims, arch: str, compile_backend: str | None = None) -> StepFn:
    """megalite's real step (`train_step`: schedule, grad sync, global norm, clip, AdamW) at tp=pp=dp=1;
    `compile_backend` compiles each block as `model.compile` does (bench/limit.py)."""
    state = ParallelState()
    cfg = ModelArgs(arch=arch, num_layers=d.layers, hidden_size=d.hidden, num_heads=d.heads,
                      num_kv_heads=d.kv_heads if arch == "llama" else d.heads,
                      ffn_hidden_size=d.ffn if arch == "llama" else 4 * d.hidden, seq_len=d.seq,
                      vocab_size=d.vocab, tie_embeddings=arch == "gpt2", kernels="torch")
    model = GPT(cfg, state, seed=1234)
    opt = build_distributed_optimizer(model, state, 0, torch.float32,  # what pretrain.py uses
                                      OptimizerConfig(weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], adam_eps=EPS),
                                      sync=SyncOptions(fold_weight_grads=compile_backend is None))
    if compile_backend is not None:
        compile_blocks([model], compile_backend)
    tcfg = SimpleNamespace(lr=LR, min_lr=LR, warmup_steps=0, steps=10**9, clip_grad=CLIP)
    scaler = LossScaler(enabled=False)
    counter = iter(range(10**9))
    return lambda ids, labels: train_step(StepContext.build(model, state, torch.float32, tcfg, scaler),
                                          opt, [(ids, labels)], next(counter)).loss


def build_hf(d: Dims, arch: str) -> StepFn:
    """transformers' model with SDPA attention; loss on its logits like the others (no label shift)."""
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.ffn,
                          num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads,
                          max_position_embeddings=d.seq, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=False, attention_dropout=0.0)
        model: nn.Module = LlamaForCausalLM(cfg)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=d.vocab, n_positions=d.seq, n_embd=d.hidden, n_layer=d.layers, n_head=d.heads,
                         n_inner=4 * d.hidden, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None)
        model = GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "sdpa"
    model.train()

    def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))

    return _plain_step(model, loss_fn)


def build_minimal(d: Dims, arch: str) -> StepFn:
    model = MiniLlama(d)
    return _plain_step(model, model.forward)


IMPLS: dict[str, tuple[Callable[[Dims, str], StepFn], str]] = {
    "megalite-llama": (build_megalite, "llama"), "transformers-llama": (build_hf, "llama"),
    "minimal-llama": (build_minimal, "llama"),
    "megalite-gpt2": (build_megalite, "gpt2"), "transformers-gpt2": (build_hf, "gpt2"),
}
RATIOS = [("megalite-llama", "transformers-llama"), ("megalite-llama", "minimal-llama"),
          ("megalite-gpt2", "transformers-gpt2")]


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def make_batches(d: Dims, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(k):
        t = torch.randint(0, d.vocab, (d.batch, d.seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def time_steps(step: StepFn, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for ids, labels in batches:
        step(ids, labels)  # .item() in every step: the loop is synchronous, as in training
    return time.perf_counter() - t0


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_probe(name: str, d: Dims, steps: int, threads: int, malloc: bool = True) -> dict[str, float]:
    """Run in a fresh process (see `measure_rss`): import everything every implementation needs,
    touch the lazily loaded CPU kernels once, reset the kernel's peak-RSS mark (writing 5 to
    /proc/self/clear_refs, Linux >= 4.0), then build, train and read VmHWM."""
    torch.set_num_threads(threads)
    if malloc:  # the same allocator settings as the timed run
        tune_malloc()
    if have_transformers():  # imported by every probe, so peak_mib compares like with like
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    w = torch.randn(1, 2, 8, 8, requires_grad=True)
    att = F.scaled_dot_product_attention(w, w, w, is_causal=True).view(-1, 8)
    F.cross_entropy(att, torch.zeros(16, dtype=torch.long)).backward()
    torch.optim.AdamW([w], fused=True).step()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    step = IMPLS[name][0](d, IMPLS[name][1])
    time_steps(step, make_batches(d, steps))
    peak = _status_kib("VmHWM")
    return {"peak_mib": peak / 1024, "delta_mib": (peak - base) / 1024}


def measure_rss(name: str, d: Dims, steps: int, threads: int, malloc: bool = True) -> dict[str, float]:
    """Peak RSS of one implementation, in its own process so the others' allocations don't count.
    `peak_mib`: the process's peak while building and training (python + torch + its imports + model);
    `delta_mib`: peak minus the resident size right after the imports, i.e. what the model, its grads,
    AdamW state and activations cost (the allocator's caching included)."""
    code = (f"import sys, json; sys.path.insert(0, {str(REPO)!r}); import bench.cpu_compare as c; "
            f"print(json.dumps(c.rss_probe({name!r}, c.Dims(**{asdict(d)!r}), {steps}, {threads}, {malloc})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=600)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["failed"]
        return {"error": lines[-1]}  # type: ignore[dict-item]
    return json.loads(proc.stdout.strip().splitlines()[-1])



def run(d: Dims, threads: int, warmup: int, repeats: int, steps: int, rss: bool, malloc: bool = True) -> dict:
    torch.set_num_threads(threads)
    # What pretrain.py does at start-up (train.tune_malloc). It is process-wide: every implementation
    # in this process runs with the same allocator settings.
    malloc_note = tune_malloc() if malloc else "malloc: glibc defaults (--no-tune-malloc)"
    torch.manual_seed(0)
    names = [n for n in IMPLS if have_transformers() or not n.startswith("transformers")]
    notes = [] if have_transformers() else ["transformers not installed: its rows are skipped "
                                            "(pip install transformers, after checking it keeps torch)"]
    step_fns = {n: IMPLS[n][0](d, IMPLS[n][1]) for n in names}
    batches = make_batches(d, steps)
    for n in names:
        time_steps(step_fns[n], batches[:1] * warmup)
    tps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            tps[n].append(steps * d.batch * d.seq / time_steps(step_fns[n], batches))
    # Paired: the two slots of one repeat ran seconds apart, under the same background load.
    # Best-of: the fastest slot of each is the least disturbed by other processes (contention only
    # ever slows a step down), the usual estimator on a shared machine.
    ratios = {f"{a}/{b}": {**spread([x / y for x, y in zip(tps[a], tps[b])]), "best_of": max(tps[a]) / max(tps[b])}
              for a, b in RATIOS if a in tps and b in tps}
    mem = {n: measure_rss(n, d, max(2, warmup), threads, malloc) for n in names} if rss else {}
    machine = f"{platform.machine()} {platform.processor()}".strip()
    return {"date": datetime.date.today().isoformat(), "machine": machine,
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__ if have_transformers() else None,
            "threads": threads, "dtype": "fp32", "dims": asdict(d), "warmup": warmup, "repeats": repeats,
            "steps_per_repeat": steps, "malloc": malloc_note, "tokens_per_s": {n: spread(v) for n, v in tps.items()},
            "tokens_per_s_all": tps, "ratios": ratios, "rss_mib": mem, "notes": notes}


def to_markdown(res: dict) -> str:
    d = res["dims"]
    lines = [f"CPU training step (fwd+bwd+clip+AdamW), fp32, {res['threads']} thread(s), "
             f"{d['layers']} layers, hidden {d['hidden']}, heads {d['heads']} (kv {d['kv_heads']}), seq {d['seq']}, "
             f"batch {d['batch']}, vocab {d['vocab']}; {res['repeats']} interleaved repeats x "
             f"{res['steps_per_repeat']} steps after {res['warmup']} warm-up steps; torch {res['torch']}, "
             f"transformers {res['transformers']}; {res['malloc']}; {res['date']}.", "",
             "| implementation | tokens/s median (min-max) | best | peak RSS MiB | RSS over imports MiB |",
             "|---|---|---|---|---|"]
    for n, s in res["tokens_per_s"].items():
        m = res["rss_mib"].get(n, {})
        peak = f"{m['peak_mib']:.0f}" if "peak_mib" in m else "-"
        delta = f"{m['delta_mib']:.0f}" if "delta_mib" in m else "-"
        lines.append(f"| {n} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | {s['max']:.0f} | {peak} | {delta} |")
    lines += ["", "| ratio of tokens/s | paired min | paired median | paired max | best / best |",
              "|---|---|---|---|---|"]
    for k, s in res["ratios"].items():
        lines.append(f"| {k} | {s['min']:.3f} | {s['median']:.3f} | {s['max']:.3f} | {s['best_of']:.3f} |")
    lines += [f"\nNote: {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=2, help="steps per implementation per repeat")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--no-rss", action="store_true", help="skip the per-implementation RSS subprocesses")
    p.add_argument("--no-tune-malloc", action="store_true",
                   help="leave glibc malloc at its defaults (pretrain.py's train.tune_malloc=false)")
    p.add_argument("--smoke", action="store_true", help="tiny dims, 1 repeat, no RSS: seconds")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench",
                  help="output directory (default runs/bench, untracked; bench/results: the published figures)")
    a = p.parse_args(argv)
    if a.smoke:
        d, a.warmup, a.repeats, a.steps, a.no_rss = Dims(2, 32, 4, 2, 16, 2, 128), 1, 1, 1, True
    else:
        d = Dims(a.layers, a.hidden, a.heads, a.kv_heads, a.seq, a.batch)
    res = run(d, a.threads, a.warmup, a.repeats, a.steps, rss=not a.no_rss, malloc=not a.no_tune_malloc)
    write_results(a.out, "cpu_compare_smoke" if a.smoke else "cpu_compare", res, to_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
