"""What the loop tells the user: the startup lines and each logged step's metrics record."""

from __future__ import annotations

import torch

from megalite.config import Config, ModelArgs
from megalite.observability.metrics import MetricsLogger, peak_memory_bytes
from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel import comm
from megalite.parallel.counter import COMM_CONVENTION
from megalite.parallel.state import ParallelState
from megalite.mla import costs as mla_costs
from megalite.mla.costs import MLADims
from megalite.perfmodel.moe import moe_param_counts, mtp_costs
from megalite.perfmodel.flops import mfu, model_flops_per_token, peak_flops
from megalite.training.step import StepContext, StepResult

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class StepReport:
    """Constants of the run (tokens per step, FLOPs per token, the device's peak) and the record."""

    def __init__(self, cfg: Config, state: ParallelState, ctx: StepContext,
                 optimizer: DistributedOptimizer, data_note: str) -> None:
        self.cfg, self.state, self.ctx, self.optimizer, self.data_note = cfg, state, ctx, optimizer, data_note
        m = cfg.model
        mla = MLADims.of(cfg.mla)
        counts = moe_param_counts(ModelArgs.of(m, cfg.moe), mla)  # the dense count for a dense model
        mtp = mtp_costs(ModelArgs.of(m, cfg.moe), cfg.mtp.num_layers)  # the MTP modules (zero when off)
        self.n_params, self.n_active = counts.total + mtp.params, counts.active + mtp.active
        # MFU counts the FLOPs a token needs: a MoE token goes through its k experts only (active parameters);
        # MLA's attention core is at its own widths (megalite/mla/costs.py).
        width = m.hidden_size if mla is None else mla_costs.attention_width(m.num_heads, mla)
        self.flops_per_token = model_flops_per_token(counts.active, m.num_layers, width, m.seq_len) \
            + mtp.flops_per_token
        self.flops_per_token_causal = model_flops_per_token(counts.active, m.num_layers, width, m.seq_len,
                                                            causal=True) + mtp.flops_per_token_causal
        device_name = torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else "cpu"
        self.peak = peak_flops(device_name, DTYPE_NAMES[ctx.engine.dtype])
        self.tokens_per_step = cfg.train.global_batch_size * m.seq_len

    def startup(self, logger: MetricsLogger, resumed_from: str | None, start_step: int, malloc_note: str) -> None:
        par, st, dtype = self.cfg.parallel, self.state, self.ctx.engine.dtype
        active = f" ({self.n_active / 1e6:.2f}M active)" if self.n_active != self.n_params else ""
        logger.note(f"megalite: {self.n_params / 1e6:.2f}M params{active} | layout tp={par.tp} "
                    + (f"cp={par.cp} " if par.cp > 1 else "") + (f"ep={par.ep} " if par.ep > 1 else "") + f"pp={par.pp} dp={par.dp} "
                    f"sp={par.sp} | {st.device.type} {str(dtype).removeprefix('torch.')} | vocab "
                    f"{self.cfg.model.vocab_size} | {self.tokens_per_step} tokens/step | {self.data_note}"
                    + (f" | resumed from {resumed_from} at step {start_step}" if resumed_from else ""))
        if self.cfg.logging.verbose:  # the details most runs never need (docs/tracking.md#the-console)
            logger.note(f"megalite: {malloc_note}")
            mem = self.optimizer.memory_bytes()
            logger.note("model-state bytes on rank 0 at start: "
                        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items())
                        + f" (zero={par.zero}; exact, from the tensors; per step in metrics.jsonl mem_bytes)")
        if start_step >= self.cfg.train.steps:
            logger.note(f"checkpoint {resumed_from} is already at step {start_step} >= train.steps="
                        f"{self.cfg.train.steps}: nothing to do (raise train.steps to train further)")

    def due(self, step: int, start_step: int) -> bool:
        """Log every `logging.interval` steps, the first step of this process and the last."""
        return step % self.cfg.logging.interval == 0 or step == self.cfg.train.steps or step == start_step + 1

    def record(self, step: int, result: StepResult, seconds: float, comm_bytes: dict[str, float],
               valid_loss: float | None, spike: bool, written_bytes: int | None = None,
               tallies: dict[str, int] | None = None) -> dict:
        """One metrics.jsonl line (docs/tracking.md lists the fields and which are per device).
        `comm_bytes` is counted by the ring convention; `written_bytes` measured (None where it cannot be);
        `tallies` this rank's counter tallies of the step (`cp_blocks`). Collective over 'cp' when cp > 1: every
        rank calls it for the same steps."""
        blocks = cp_blocks(self.state, self.cfg.parallel.cp_mode, tallies or {})
        tps = self.tokens_per_step / seconds
        flops = self.flops_per_token * tps / self.state.world_size
        return {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                "tokens_per_s": tps, "tflops_per_device": flops / 1e12, "mfu": mfu(flops, self.peak),
                "mfu_causal": mfu(self.flops_per_token_causal * tps / self.state.world_size, self.peak),
                "mem_peak_bytes": peak_memory_bytes(self.state.device), "comm_bytes": comm_bytes,
                "comm_convention": COMM_CONVENTION, "comm_written_bytes": written_bytes,
                "skipped": result.skipped, "valid_loss": valid_loss, "step_time_s": seconds,
                "loss_scale": self.ctx.scaler.scale, "spike": spike, "mem_bytes": self.optimizer.memory_bytes(),
                "tokens_seen": step * self.tokens_per_step, **({"moe": result.moe} if result.moe else {}),
                **({"mtp_loss": result.mtp} if result.mtp else {}), **({"cp_blocks": blocks} if blocks else {})}


# The ring's counter tallies (megalite/context/ring.py) and the names `cp_blocks` reports them under.
CP_BLOCK_TALLIES = {"computed": "cp_blocks_computed", "skipped": "cp_blocks_skipped"}


def cp_blocks(state: ParallelState, cp_mode: str, tallies: dict[str, int]) -> dict[str, int] | None:
    """The step's ring chunk pairs, computed and skipped (a sliding window's pairs wholly outside it), summed over
    the cp group: {"computed": N, "skipped": M}; None when cp = 1 or no ring ran (cp_mode allgather / a2a, or a
    stage without attention layers). Counted per ring forward (attention/costs.py `ring_blocks` per rank and call:
    every layer's call on every micro-batch, a full-recompute re-run counted again; the backward visits the same
    pairs uncounted). One all-reduce of two integers over 'cp' when cp > 1 and the mode runs a ring (the same
    decision on every rank of the group), filed under 'metrics'."""
    if state.size("cp") == 1 or cp_mode not in ("ring", "hybrid"):
        return None
    counts = torch.tensor([tallies.get(name, 0) for name in CP_BLOCK_TALLIES.values()], dtype=torch.int64,
                          device=state.device)
    comm.all_reduce(counts, state, "cp", count_as="metrics")
    computed, skipped = (int(n) for n in counts.tolist())
    return {"computed": computed, "skipped": skipped} if computed else None  # a ring call always computes a pair
