"""The training driver behind `pretrain.py`: config -> ParallelState -> data/model/optimizer -> loop.

Order is deliberate (fail loudly and early): the config is parsed, resolved and validated before any
process group, dataset or model exists, so a bad flag costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite import config as config_mod
from megalite.checkpoint import sharded
from megalite.data import DataSampler, build_data, make_batch
from megalite.errors import DataError, MegaliteError, report
from megalite.perfmodel.flops import mfu, model_flops_per_token, peak_flops
from megalite.observability.metrics import MetricsLogger, peak_memory_bytes
from megalite.perfmodel.estimate import count_params
from megalite.runtime.faults import FaultInjector
from megalite.pipeline import build_pipeline
from megalite.optim.adamw import LossScaler
from megalite.optim import build_distributed_optimizer
from megalite.parallel import comm
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState, init_distributed, launcher_env
from megalite.runtime.malloc import tune_malloc
from megalite.observability.tracking import Tracker
from megalite.training.step import evaluate, train_step
from megalite.runtime.watchdog import Watchdog


class StopFlag:
    """Set by SIGTERM/SIGUSR1 (what Slurm sends before a preemption): finish the step, save, exit 0."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, state: ParallelState) -> bool:
        """Stop only when every rank stops at the same step: all-reduce the flag (MAX)."""
        if state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=state.device)
        comm.all_reduce(flag, state, "mp", op=dist.ReduceOp.MAX, count_as="metrics")
        flag_all = torch.tensor([flag.item()], device=state.device)
        comm.all_reduce(flag_all, state, "dp", op=dist.ReduceOp.MAX, count_as="metrics")
        return bool(flag_all.item())


def setup_config(argv: list[str] | None) -> tuple[config_mod.Config, int]:
    cfg = config_mod.parse_args(argv)
    _, world, _ = launcher_env()
    cfg = config_mod.resolve(cfg, world)
    config_mod.validate(cfg, world, config_mod.resolved_device(cfg))
    return cfg, world


def run(cfg: config_mod.Config) -> dict[str, float]:
    """Train per `cfg` (resolved and validated); returns the last step's loss and valid loss."""
    par, tr = cfg.parallel, cfg.train
    malloc_note = tune_malloc() if tr.tune_malloc else "malloc: glibc defaults (train.tune_malloc=false)"
    device = config_mod.resolved_device(cfg)
    dtype = config_mod.resolved_dtype(cfg, device)
    state = init_distributed(par.tp, par.pp, par.dp, sp=par.sp, backend=par.backend, device=device,
                             timeout_s=par.timeout_s)
    torch.manual_seed(tr.seed)
    is_logger = state.rank == 0
    data = build_data(cfg)
    tok_vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tok_vocab
    elif cfg.model.vocab_size < tok_vocab:
        raise DataError(f"the tokenizer has {tok_vocab} tokens but model.vocab_size={cfg.model.vocab_size}: "
                        f"set model.vocab_size >= {tok_vocab} (or 0 to take the tokenizer's)")
    if is_logger:
        config_mod.save_config(cfg, f"{cfg.logging.dir}/config.toml")
    rng = RNGStreams(tr.seed, state)
    engine = build_pipeline(cfg.model, state, tr.seed, tr.micro_batch_size, dtype, vpp=par.vpp,
                            pp_layers=par.pp_layers or None, rng=rng, schedule=par.schedule)
    model = nn.ModuleList(engine.chunks)  # this rank's chunks: one unless pp > 1 with vpp > 1
    # ZeRO-3 hooks a GPT's blocks directly, so give it the chunk itself when there is only one.
    optimizer = build_distributed_optimizer(engine.chunks[0] if len(engine.chunks) == 1 else model, state, par.zero, tr.lr, tr.weight_decay, (tr.beta1, tr.beta2),
                                            tr.adam_eps, dtype)
    scaler = LossScaler(enabled=dtype == torch.float16)
    sampler = DataSampler(len(data.train), tr.global_batch_size, tr.micro_batch_size, state.dp_rank, state.dp,
                          tr.seed)
    start_step = 0
    resume_from = sharded.find(cfg.checkpoint.load, cfg.checkpoint.dir)
    if resume_from is not None:
        # Any layout: each rank reads the slices it needs (ZeRO-3: into temporarily gathered params).
        with optimizer.gathered():
            extra = sharded.load_sharded(resume_from, model, optimizer, state)
        if "sampler" in extra:  # an imported Hugging Face model has no data position
            sampler.load_state_dict(extra["sampler"])
        if "scaler" in extra:
            scaler.load_state_dict(extra["scaler"])
        if extra["rng"] is not None:  # same layout: restore every rank's streams; else keep the fresh seeds
            rng.load_state_dict(extra["rng"])
        start_step = int(extra["step"])

    def save_checkpoint(step: int) -> None:
        extra = {"config": config_mod.config_to_dict(cfg), "sampler": sampler.state_dict(),
                 "scaler": scaler.state_dict(), "rng": rng.state_dict()}
        path = sharded.save_sharded(cfg.checkpoint.dir, step, model, optimizer, extra, state, cfg.checkpoint.keep)
        logger.note(f"saved checkpoint {path}")

    m = cfg.model
    n_params = count_params(m.arch, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size,
                            m.vocab_size, m.seq_len, bool(m.tie_embeddings))
    flops_per_token = model_flops_per_token(n_params, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_len)
    device_name = torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else "cpu"
    peak = peak_flops(device_name, {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    tracker = Tracker(cfg.logging.wandb_project, cfg.logging.wandb_entity, cfg.logging.wandb_run_name,
                      config_mod.config_to_dict(cfg), cfg.logging.dir, enabled=is_logger)
    logger = MetricsLogger(cfg.logging.dir, is_logger, tracker, tr.steps)
    tokens_per_step = tr.global_batch_size * cfg.model.seq_len
    logger.note(f"megalite: {n_params / 1e6:.2f}M params | layout tp={par.tp} pp={par.pp} dp={par.dp} sp={par.sp} | "
                f"{device} {str(dtype).removeprefix('torch.')} | vocab {cfg.model.vocab_size} | "
                f"{tokens_per_step} tokens/step | {len(data.train)} train samples"
                + (f" | resumed from {resume_from} at step {start_step}" if resume_from else "")
                + f" | {malloc_note}")
    mem = optimizer.memory_bytes()
    logger.note("model-state bytes on rank 0 at start: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items())
                + f" (zero={par.zero}; exact, from the tensors; per step in metrics.jsonl mem_bytes)")
    if start_step >= tr.steps:
        logger.note(f"checkpoint {resume_from} is already at step {start_step} >= train.steps={tr.steps}: "
                    "nothing to do (raise train.steps to train further)")
    stop = StopFlag()
    faults = FaultInjector(state.rank)
    watchdog = Watchdog(state.rank, state.counter, tr.watchdog_factor, tr.watchdog_min_s)
    recent_losses: list[float] = []
    valid_sampler_seed = tr.seed + 1
    last: dict[str, float] = {}
    step_times: list[float] = []
    consecutive_skips = 0
    try:  # the watchdog thread and the wandb run must end with this function, even on an error
        for step in range(start_step, tr.steps):
            faults.at_step_start(step + 1)
            watchdog.begin_step(step + 1)
            state.counter.reset()
            t0 = time.perf_counter()
            batches = [make_batch(data.train, idx) for idx in sampler.next_step()]
            result = train_step(engine, optimizer, batches, state, tr, step, dtype, scaler, par.schedule, par.vpp,
                                poison_grads=faults.poison_grads(step + 1))
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            dt = time.perf_counter() - t0
            step_comm = state.counter.bytes()  # the training step's traffic, before any evaluation adds to it
            step_times.append(dt)
            consecutive_skips = consecutive_skips + 1 if result.skipped else 0
            if consecutive_skips > tr.max_skipped_steps:
                raise MegaliteError(f"{consecutive_skips} consecutive steps had a non-finite gradient norm (last at step "
                                    f"{step + 1}): the run is diverging; lower train.lr, use bf16 instead of fp16, or "
                                    f"resume from an earlier checkpoint")
            spike = False
            if tr.spike_factor > 0 and not result.skipped:
                if len(recent_losses) >= 10 and result.loss > tr.spike_factor * statistics.median(recent_losses):
                    spike = True
                    logger.note(f"loss spike at step {step + 1}: {result.loss:.4f} > {tr.spike_factor:g} x running "
                                f"median {statistics.median(recent_losses):.4f}")
                recent_losses = (recent_losses + [result.loss])[-100:]
            if result.skipped:
                logger.note(f"step {step + 1} skipped: non-finite gradient norm ({consecutive_skips} in a row, "
                            f"limit train.max_skipped_steps={tr.max_skipped_steps})")
            valid_loss = None
            done = step + 1
            if data.valid is not None and tr.eval_interval > 0 and (done % tr.eval_interval == 0 or done == tr.steps):
                vs = DataSampler(len(data.valid), tr.global_batch_size, tr.micro_batch_size, state.dp_rank, state.dp,
                                 valid_sampler_seed)
                vb = [make_batch(data.valid, idx) for _ in range(tr.eval_steps) for idx in vs.next_step()]
                valid_loss = evaluate(engine, vb, state, dtype)
            last = {"loss": result.loss, "valid_loss": valid_loss if valid_loss is not None else math.nan}
            if done % cfg.logging.interval == 0 or done == tr.steps or done == start_step + 1 or valid_loss is not None:
                tps = tokens_per_step / dt
                flops = flops_per_token * tps / state.world_size
                recent = sorted(step_times[-20:])[len(step_times[-20:]) // 2]
                logger.log({"step": done, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                            "tokens_per_s": tps, "tflops_per_device": flops / 1e12, "mfu": mfu(flops, peak),
                            "mem_peak_bytes": peak_memory_bytes(state.device), "comm_bytes": step_comm,
                            "skipped": result.skipped, "valid_loss": valid_loss, "step_time_s": dt,
                            "loss_scale": scaler.scale, "spike": spike, "mem_bytes": optimizer.memory_bytes()},
                           seconds_left=recent * (tr.steps - done))
            should_save = bool(cfg.checkpoint.dir) and (
                (cfg.checkpoint.interval > 0 and done % cfg.checkpoint.interval == 0) or done == tr.steps)
            watchdog.end_step()
            stopping = stop.agreed(state)
            if should_save or (stopping and cfg.checkpoint.dir):
                save_checkpoint(done)
            if stopping:
                logger.note(f"stop requested by signal: exiting cleanly after step {done}")
                break
    finally:
        watchdog.close()
        tracker.finish()
    if state.world_size > 1:
        dist.destroy_process_group()
    return last


def main(argv: list[str] | None = None) -> int:
    """Entry point: a user-fixable problem prints one line and exits with its code, no traceback."""
    try:
        cfg, _ = setup_config(argv)
        run(cfg)
    except MegaliteError as e:
        return report(e, "megalite: error")
    return 0
