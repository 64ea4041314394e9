"""The torch-native peers of bench/dist_compare.py: a torchtitan-style Llama and the ways torch distributes it.

The model is written the way torchtitan writes its Llama (separate wq/wk/wv/wo and w1/w2/w3 linears, nn.RMSNorm,
rotate-half RoPE, SDPA with grouped kv heads), with the same math as megalite's, and takes megalite's initial
weights (`load_megalite_weights`), so every pair starts from the same parameters. The peers:

    DDP                       torch.nn.parallel.DistributedDataParallel (constant RoPE tables not broadcast)
    ZeroRedundancyOptimizer   DDP + torch.distributed.optim.ZeroRedundancyOptimizer over AdamW
    FSDP2                     fully_shard per block, then the root; reshard_after_forward False (ZeRO-2) or
                              True (ZeRO-3)
    DTensor TP / TP+SP        parallelize_module with a plan in torchtitan's style: colwise q/k/v and w1/w3,
                              rowwise wo/w2, vocab-rowwise embedding, colwise output with loss_parallel; with SP
                              the norms run SequenceParallel and each block's entry gathers the sequence
    pipelining                torch.distributed.pipelining PipelineStage + Schedule1F1B / ScheduleInterleaved1F1B
    DeepSpeed ZeRO 1-3        deepspeed.initialize on its CPU accelerator over gloo, torch's AdamW as the client
                              optimizer (DeepSpeed's own CPU Adam needs a C++ build)

Every optimizer is torch's AdamW with megalite's groups (decay on matrices only) and a global-norm clip.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench.cpu_compare import Dims  # the same Llama dims as the single-process comparison (batch: the job's)

LR, WD, BETAS, EPS, CLIP = 1e-3, 0.1, (0.9, 0.95), 1e-8, 1.0
Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[list[Batch]], float]  # this rank's micro-batches -> the job's mean loss


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [b, s, heads, head_dim] (cos/sin: [s, head_dim/2])."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.hd = d.hidden // d.heads
        self.wq = nn.Linear(d.hidden, d.heads * self.hd, bias=False)
        self.wk = nn.Linear(d.hidden, d.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d.hidden, d.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(d.heads * self.hd, d.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # heads inferred (-1): under TP each rank holds a slice of them
        q = rope(self.wq(x).view(b, s, -1, self.hd), cos, sin).transpose(1, 2)
        k = rope(self.wk(x).view(b, s, -1, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.w1 = nn.Linear(d.hidden, d.ffn, bias=False)
        self.w3 = nn.Linear(d.hidden, d.ffn, bias=False)
        self.w2 = nn.Linear(d.ffn, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d.hidden, eps=1e-5), nn.RMSNorm(d.hidden, eps=1e-5)
        self.attention, self.feed_forward = Attention(d), FeedForward(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The whole model, or one pipeline stage of it (`layers` a subset; embedding / head only where they live)."""

    def __init__(self, d: Dims, layers: range | None = None, first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(d.vocab, d.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): Block(d) for i in (layers if layers is not None else range(d.layers))})
        self.norm = nn.RMSNorm(d.hidden, eps=1e-5) if last else None
        self.output = nn.Linear(d.hidden, d.vocab, bias=False) if last else None
        hd = d.hidden // d.heads
        ang = torch.outer(torch.arange(d.seq).float(), 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for blk in self.layers.values():
            h = blk(h, self.cos, self.sin)
        return self.output(self.norm(h)) if self.output is not None else h


def load_megalite_weights(peer: Llama, full: dict[str, torch.Tensor], d: Dims) -> None:
    """Copy megalite's unsharded initial weights (a tp=1 GPT's state dict) into the peer's names."""
    q, kv = d.hidden, d.kv_heads * (d.hidden // d.heads)
    own = dict(peer.named_parameters())

    def put(name: str, value: torch.Tensor) -> None:
        if name in own:
            with torch.no_grad():
                own[name].copy_(value)

    put("tok_embeddings.weight", full["embedding.weight"])
    put("norm.weight", full["final_norm.weight"])
    put("output.weight", full["head.weight"])
    for i in range(d.layers):
        m, p = f"layers.{i}.", f"layers.{i}."
        wq, wk, wv = full[m + "attn.qkv.weight"].split([q, kv, kv])
        w1, w3 = full[m + "mlp.up.weight"].chunk(2)  # megalite fuses [gate; up]
        for name, value in [("attention_norm.weight", full[m + "norm1.weight"]), ("attention.wq.weight", wq),
                            ("attention.wk.weight", wk), ("attention.wv.weight", wv),
                            ("attention.wo.weight", full[m + "attn.out.weight"]),
                            ("ffn_norm.weight", full[m + "norm2.weight"]), ("feed_forward.w1.weight", w1),
                            ("feed_forward.w3.weight", w3), ("feed_forward.w2.weight", full[m + "mlp.down.weight"])]:
            put(p + name, value)


def adamw_groups(model: nn.Module) -> list[dict]:
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def adamw(model: nn.Module, fused: bool = True) -> torch.optim.AdamW:
    return torch.optim.AdamW(adamw_groups(model), lr=LR, betas=BETAS, eps=EPS, fused=fused)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def mean_over(loss: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> float:
    """The job's mean loss from each rank's mean over its own equal share (one small all-reduce, as megalite's)."""
    t = loss.detach().clone()
    dist.all_reduce(t, group=group)
    return t.item() / size


def data_parallel_step(model: nn.Module, opt: torch.optim.Optimizer, dp: int) -> StepFn:
    """One micro-batch per rank: forward, backward (the wrapper reduces), clip, AdamW."""

    def step(batches: list[Batch]) -> float:
        (ids, labels), = batches
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return mean_over(loss, None, dp)

    return step


def build_ddp(model: Llama, zero_redundancy: bool) -> StepFn:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, broadcast_buffers=False)  # the RoPE tables are constants: nothing to broadcast
    if zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(adamw_groups(model), torch.optim.AdamW, lr=LR,
                                                             betas=BETAS, eps=EPS, fused=True)
    else:
        opt = adamw(model)
    return data_parallel_step(ddp, opt, dist.get_world_size())


def build_fsdp2(model: Llama, reshard_after_forward: bool) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return data_parallel_step(model, adamw(model), dist.get_world_size())


def clip_mixed(params: list[nn.Parameter]) -> None:
    """Global-norm clip over DTensor parameters and plain ones (TP without SP leaves the norms' weights plain and
    replicated, and torch's clip refuses the mix): the squared norms of both kinds, summed."""
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in params if p.grad is not None]
    kinds = [[p for p in with_grad if isinstance(p.grad, DTensor)],
             [p for p in with_grad if not isinstance(p.grad, DTensor)]]
    sq = torch.zeros(())
    for kind in kinds:
        if kind:
            n = torch.nn.utils.get_total_norm([p.grad for p in kind])
            sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    for kind in kinds:
        if kind:
            torch.nn.utils.clip_grads_with_norm_(kind, CLIP, sq.sqrt())


def build_tensor_parallel(model: Llama, sp: bool) -> StepFn:
    """DTensor TP over all ranks with a torchtitan-style plan; the loss is computed on vocab-sharded logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seq = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if sp else {}),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    })
    for blk in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(blk, mesh, plan)
    opt = adamw(model)

    def step(batches: list[Batch]) -> float:
        (ids, labels), = batches
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = cross_entropy(model(ids), labels)
            loss.backward()
        clip_mixed(list(model.parameters()))
        opt.step()
        return float(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())

    return step


def build_pipelining(d: Dims, full: dict[str, torch.Tensor], interleaved: bool, micro_batches: int) -> StepFn:
    """torch.distributed.pipelining over all ranks, one stage per rank (1F1B) or two in a loop (interleaved:
    rank r holds stages r and r + P), the same layer split as megalite's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    pp, rank = dist.get_world_size(), dist.get_rank()
    per_rank = 2 if interleaved else 1
    n_stages = pp * per_rank
    per_stage = d.layers // n_stages
    stage_ids = [rank + k * pp for k in range(per_rank)]
    modules = []
    for s in stage_ids:
        m = Llama(d, range(s * per_stage, (s + 1) * per_stage), first=s == 0, last=s == n_stages - 1)
        load_megalite_weights(m, full, d)
        modules.append(m)
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(modules, stage_ids)]
    schedule = (ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=cross_entropy) if interleaved else
                Schedule1F1B(stages[0], micro_batches, loss_fn=cross_entropy))  # scale_grads: mean over micro-batches
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW([g for m in modules for g in adamw_groups(m)], lr=LR, betas=BETAS, eps=EPS, fused=True)
    last = (n_stages - 1) % pp

    def step(batches: list[Batch]) -> float:
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids, target=labels, losses=losses)
        else:
            schedule.step(target=labels, losses=losses)
        # Global-norm clip: each rank holds different parameters, so the squared norms are summed over ranks.
        sq = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
        dist.all_reduce(sq)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, sq.sqrt())
        opt.step()
        mean = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(mean, src=last)
        return mean.item()

    return step


def deepspeed_available() -> str | None:
    """None when DeepSpeed imports on its CPU accelerator; else why not (shown in the results)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or its accelerator probing failing on this machine
        return f"deepspeed unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def build_deepspeed(model: Llama, stage: int, micro_batch: int) -> StepFn:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model), config=config,
                                           dist_init_required=False)

    def step(batches: list[Batch]) -> float:
        (ids, labels), = batches
        loss = cross_entropy(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        return mean_over(loss, None, dist.get_world_size())

    return step
