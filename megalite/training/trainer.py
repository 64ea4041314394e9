"""The training driver behind `pretrain.py`: config -> ParallelState -> data/model/optimizer -> loop.

Order is deliberate (fail loudly and early): the config is parsed, resolved and validated before any
process group, dataset or model exists, so a bad flag costs seconds, not a GPU allocation.
`build_run` makes everything the loop needs; `run` is the loop, one step's story per iteration.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from megalite import config as config_mod
from megalite.checkpoint.claim import DirectoryClaim, claim_directory, claim_log_directory
from megalite.training.init_from import resolve_init_from
from megalite.context.options import ContextOptions
from megalite.data import DataBundle, build_data
from megalite.data.checks import check_data
from megalite.data.tokenizer import Tokenizer
from megalite.dp import OverlapSettings, mib_to_bytes
from megalite.errors import ConfigError, DataError, LaunchError, MegaliteError, from_os_error, report
from megalite.inference.samples import TrainingSamples, sample_prompt_ids
from megalite.fp8.enable import enable_fp8, fp8_settings, gemm_note
from megalite.model.compile import compile_blocks
from megalite.model.ops import resolve_kernels
from megalite.observability.metrics import MetricsLogger
from megalite.observability.phases import SlowPhase
from megalite.observability.tracking import Tracker
from megalite.observability.wire import WrittenBytes
from megalite.optim import SyncOptions, build_distributed_optimizer
from megalite.optim.loss_scale import LossScaler
from megalite.optim.protocol import DistributedOptimizer
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState, init_distributed, launcher_env
from megalite.pipeline import StagePlan, build_pipeline
from megalite.runtime.faults import FaultInjector
from megalite.runtime.malloc import tune_malloc
from megalite.runtime.threads import configure_threads, local_processes
from megalite.runtime.watchdog import Watchdog
from megalite.training.batches import StreamBatches, TrainBatches, build_batches
from megalite.training.checkpointing import RunCheckpoints
from megalite.training.memory_check import check_memory
from megalite.training.policy import StepHealth
from megalite.training.preflight import CheckRequest, check_config, tell_torchrun, with_checkpoint
from megalite.training.reporting import DTYPE_NAMES, StepReport
from megalite.training.step import StepContext, evaluate, train_step
from megalite.training.stop import StopFlag



def setup_config(argv: list[str] | None) -> tuple[config_mod.Config, int]:
    cfg = with_checkpoint(config_mod.parse_args(argv), argv)  # the resumed checkpoint's shape; mismatches refused
    _, world, _ = launcher_env()
    cfg = config_mod.resolve(cfg, world)
    config_mod.validate(cfg, world, config_mod.resolved_device(cfg))
    check_data(cfg)  # data flags that cannot apply, files that cannot be read whole: before any process group
    return cfg, world


def pin_resolved(cfg: config_mod.Config) -> config_mod.Config:
    """Replace the "auto" choices by what this run uses (device, dtype, kernels, backend), so the saved
    config.toml describes the run exactly and `tools/estimate.py --config` reads the same run."""
    device = config_mod.resolved_device(cfg)
    cfg.train.dtype = DTYPE_NAMES[config_mod.resolved_dtype(cfg, device)]
    cfg.train.device = device
    cfg.model.kernels = resolve_kernels(cfg.model.kernels, torch.device(device))
    if cfg.parallel.backend == "auto":  # the rule init_distributed applies
        cfg.parallel.backend = "nccl" if device == "cuda" else "gloo"
    return cfg


def _check_sample_prompt(cfg: config_mod.Config, tokenizer: Tokenizer) -> None:
    """The sample prompt must leave room for new tokens: found now, not at the first sample after step 1."""
    if cfg.logging.sample_interval <= 0:
        return
    n = len(sample_prompt_ids(tokenizer, cfg.logging.sample_prompt))
    if n >= cfg.model.seq_len:
        raise ConfigError(f"logging.sample_prompt is {n} tokens but model.seq_len is {cfg.model.seq_len}: shorten "
                          "the prompt (samples continue it within one sequence)")


@dataclass
class Run:
    """Everything the loop touches, built once by `build_run`."""

    cfg: config_mod.Config
    state: ParallelState
    data: DataBundle
    ctx: StepContext
    model: nn.Module                 # this rank's chunks (one unless pp > 1 with vpp > 1)
    optimizer: DistributedOptimizer
    batches: TrainBatches            # each step's micro-batches, and the data position checkpoints save
    checkpoints: RunCheckpoints
    # This run started the default process group, so it ends it; a program that had joined one before calling
    # `main` (tests/pool_pretrain.py's warm ranks) keeps it for its next run.
    owns_group: bool = False


def build_run(cfg: config_mod.Config) -> Run:
    """Process group, data, model, optimizer and sampler; the config is resolved (nothing is written)."""
    par, tr = cfg.parallel, cfg.train
    device = config_mod.resolved_device(cfg)
    dtype = config_mod.resolved_dtype(cfg, device)
    joined = dist.is_available() and dist.is_initialized()  # init_distributed keeps a group that exists
    layout = ParallelState(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep, sp=par.sp)
    state = init_distributed(layout, backend=par.backend, device=device, timeout_s=par.timeout_s)
    torch.manual_seed(tr.seed)
    talk = state.rank == 0  # the phases that outlast a few seconds say so (megalite/observability/phases.py)
    with SlowPhase("reading the data (tokenizer, index, validation split)", talk):
        data = build_data(cfg)
    tok_vocab = data.tokenizer.vocab_size
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tok_vocab
    elif cfg.model.vocab_size < tok_vocab:
        raise DataError(f"the tokenizer has {tok_vocab} tokens but model.vocab_size={cfg.model.vocab_size}: "
                        f"set model.vocab_size >= {tok_vocab} (or 0 to take the tokenizer's)")
    _check_sample_prompt(cfg, data.tokenizer)
    pin_resolved(cfg)  # config.toml is written by `run`, once every check that can refuse the run has passed
    rng = RNGStreams(tr.seed, state)
    model_args = config_mod.ModelArgs.from_config(cfg)
    with SlowPhase("building the model and initialising its weights", talk):
        engine = build_pipeline(model_args, state, tr.seed, tr.micro_batch_size, dtype,
                                StagePlan(par.vpp, par.pp_layers or None, par.schedule), rng=rng,
                                context=ContextOptions.of(par.cp_mode,
                                                          data.tokenizer.eod_id if cfg.data.document_mask else None,
                                                          par.cp_a2a if par.cp_mode == "hybrid" else 1))
        enable_fp8(engine.chunks, fp8_settings(cfg.fp8.recipe, cfg.fp8.min_dim), state)
        if cfg.model.compile:  # each block's forward, after FP8 swapped its linears (megalite/model/compile.py)
            compile_blocks(engine.chunks, cfg.model.compile_backend)
    model = nn.ModuleList(engine.chunks)  # this rank's chunks: one unless pp > 1 with vpp > 1
    overlap = OverlapSettings(mib_to_bytes(par.bucket_mb), mib_to_bytes(par.first_bucket_mb), par.overlap_param_gather,
                              par.zero3_prefetch)
    with SlowPhase("building the optimizer and its states", talk):
        optimizer = build_distributed_optimizer(engine.chunks, state, par.zero, dtype, cfg.optimizer, cfg.muon,
                                                SyncOptions(overlap, fold_weight_grads=not cfg.model.compile))
    scaler = LossScaler(enabled=dtype == torch.float16)
    with SlowPhase("starting the data loader", talk):
        batches = build_batches(cfg, data, state)
    checkpoints = RunCheckpoints(cfg.checkpoint, config_mod.config_to_dict(cfg), model, optimizer, batches, scaler,
                                 rng, state)
    # SFT (chat records): labels off the assistant tokens are ignored, so the loss is one mean over the step's
    # counted tokens (megalite/training/step.py), not a mean of micro-batch means.
    ctx = StepContext(engine, tr, scaler, par.schedule, global_token_mean=data.train is None and cfg.data.format == "chat")
    return Run(cfg, state, data, ctx, model, optimizer, batches, checkpoints,
               owns_group=state.world_size > 1 and not joined)


def validation_loss(run: Run, step: int) -> float | None:
    """The mean loss over `train.eval_steps` fixed validation batches, every `train.eval_interval`
    steps and at the end; None when not due or there is no validation split."""
    tr, state = run.cfg.train, run.state
    if tr.eval_interval <= 0 or not (step % tr.eval_interval == 0 or step == tr.steps):
        return None
    with SlowPhase(f"validation loss over {tr.eval_steps} batches (train.eval_steps)", state.rank == 0):
        batches = run.batches.validation()  # the same batches every time, so successive values compare
        if batches is None:
            return None
        run.optimizer.finish_param_sync()  # explicit, although the forward's hooks would wait too
        return evaluate(run.ctx.engine, batches, state, run.ctx.engine.dtype, run.ctx.global_token_mean)


def run(cfg: config_mod.Config) -> dict[str, float]:
    """Train per `cfg` (resolved and validated); returns the last step's loss and valid loss."""
    tr = cfg.train
    malloc_note = tune_malloc() if tr.tune_malloc else "malloc: glibc defaults (train.tune_malloc=false)"
    _, world_size, local_rank = launcher_env()
    # Intra-op threads = cores / processes on this machine unless OMP_NUM_THREADS says (runtime/threads.py).
    malloc_note += " | " + configure_threads(local_processes(world_size))
    with SlowPhase("checking the memory this run needs", launcher_rank() == 0):
        memory_note = check_memory(cfg, world_size, local_rank)
    if launcher_rank() == 0:
        print(f"megalite: {memory_note}", flush=True)
    # From here on Ctrl-C/SIGTERM/SIGUSR1 end the run cleanly, even before step 1; the caller's handlers
    # come back when the run ends.
    with StopFlag(saves=bool(cfg.checkpoint.dir), rank=launcher_rank()) as stop:
        return _train(cfg, stop, malloc_note)


def _train(cfg: config_mod.Config, stop: StopFlag, malloc_note: str) -> dict[str, float]:
    """Build the run, resume, and claim its directories; then the loop (`_loop`)."""
    tr = cfg.train
    r = build_run(cfg)
    try:
        return _resume_and_loop(cfg, r, stop, malloc_note)
    finally:
        r.batches.close()  # the loader thread and tokenizer workers, if any


def _resume_and_loop(cfg: config_mod.Config, r: Run, stop: StopFlag, malloc_note: str) -> dict[str, float]:
    state = r.state
    with SlowPhase("loading the checkpoint", state.rank == 0):
        resumed_from, start_step = r.checkpoints.resume()
        init = resolve_init_from(cfg.train.init_from, cfg.data.cache_dir) \
            if resumed_from is None and cfg.train.init_from else None
        if init is not None:  # weights only: optimizer, schedule, data position and RNG start fresh
            r.checkpoints.init_weights(init)
    if stop.agreed(state):
        print(f"megalite: stop requested by signal before step {start_step + 1}: exiting, nothing trained",
              file=sys.stderr)
        if r.owns_group:
            dist.destroy_process_group()
        return {}
    claim = claim_directory(cfg.checkpoint.dir, start_step,  # this run's until it ends
                            Path(resumed_from) if resumed_from else None, state)
    log_claim = DirectoryClaim(None)
    try:
        log_claim = claim_log_directory(cfg.logging.dir, cfg.checkpoint.dir, state)
        return _loop(cfg, r, resumed_from, start_step, stop, malloc_note)
    finally:
        log_claim.release()
        claim.release()


def _loop(cfg: config_mod.Config, r: Run, resumed_from: str | None,
          start_step: int, stop: StopFlag, malloc_note: str) -> dict[str, float]:
    """The loop, once the run is allowed to start: the first write into logging.dir happens here, after
    the checkpoint directory is locked, checked for a rewind and the resume has loaded (a refused or
    failing run leaves the previous run's config.toml and metrics.jsonl untouched)."""
    tr, state, optimizer = cfg.train, r.state, r.optimizer
    if state.rank == 0:
        config_mod.save_config(cfg, f"{cfg.logging.dir}/config.toml")
    tracker = Tracker(cfg.logging.wandb_project, cfg.logging.wandb_entity, cfg.logging.wandb_run_name,
                      config_mod.config_to_dict(cfg), cfg.logging.dir, enabled=state.rank == 0)
    logger = MetricsLogger(cfg.logging.dir, state.rank == 0, tracker, tr.steps, resumed_step=start_step)
    meter = StepReport(cfg, state, r.ctx, optimizer, r.batches.describe())
    samples = TrainingSamples(cfg.logging, r.data.tokenizer, r.ctx.engine.chunks, state, r.ctx.engine.dtype, logger,
                              tracker)
    logger.totals.tokens_seen = start_step * meter.tokens_per_step
    meter.startup(logger, resumed_from, start_step, malloc_note)
    if (fp8_note := gemm_note(cfg.fp8.recipe)) is not None:
        logger.note(fp8_note)
    if resumed_from is None and cfg.train.init_from:
        logger.note(r.checkpoints.init_note)
    faults = FaultInjector(state.rank)
    watchdog = Watchdog(state.rank, state.counter, tr.watchdog_factor, tr.watchdog_min_s)
    health = StepHealth(tr.max_skipped_steps, tr.spike_factor, logger.note)
    written = WrittenBytes(state.device.type)  # what this process wrote to its sockets during each step
    last: dict[str, float] = {}
    stop.started(start_step)
    try:  # the watchdog thread and the wandb run must end with this function, even on an error
        for step in range(start_step, tr.steps):
            done = step + 1
            watchdog.begin_step(done)  # first: a hang anywhere in the step, even before its first op, is seen
            faults.at_step_start(done)
            r.checkpoints.poll(logger.note)  # a background save that finished: reported, or its error raised
            state.counter.reset()
            written.start()
            t0 = time.perf_counter()
            # The first step also warms up (allocator, kernel choice): said when it takes a while.
            with SlowPhase(f"step {done} (the first: it includes the warm-up)", state.rank == 0 and step == start_step):
                batches = r.batches.next_step(stop)
                if batches is not None:
                    result = train_step(r.ctx, optimizer, batches, step, poison_grads=faults.poison_grads(done))
                    if state.device.type == "cuda":
                        torch.cuda.synchronize(state.device)
            if batches is None:  # a stop signal while the data loader waited: stop before this step
                if step > start_step and not r.checkpoints.due(step, tr.steps):
                    saved = r.checkpoints.save(step, logger.note)
                    if saved is not None:
                        logger.note(f"saved checkpoint {saved}")
                logger.note(f"stop requested by signal while waiting for data: exiting before step {done}")
                break
            seconds = time.perf_counter() - t0
            step_comm = state.counter.bytes()  # the training step's traffic, before any evaluation adds to it
            step_tallies = state.counter.tallies()  # and its counted work (the cp ring's blocks)
            step_written = written.stop()
            data_report = r.batches.after_step()  # streamed data: bad records summed over dp, checked against the limits
            spike = health.check(done, result)
            valid_loss = validation_loss(r, done)
            last = {"loss": result.loss, "valid_loss": valid_loss if valid_loss is not None else math.nan}
            logger.step_done(done, result.loss, result.skipped, seconds, meter.tokens_per_step)
            if meter.due(done, start_step) or valid_loss is not None:
                record = meter.record(done, result, seconds, step_comm, valid_loss, spike, step_written, step_tallies)
                logger.log({**record, "data": data_report} if data_report is not None else record)
                if isinstance(r.batches, StreamBatches):
                    logger.note(r.batches.progress())
            samples.maybe_sample(done, optimizer)  # logging.sample_interval: a short greedy text sample
            watchdog.end_step()
            stopping = stop.agreed(state, done)
            if r.checkpoints.due(done, tr.steps) or stopping:
                saved = r.checkpoints.save(done, logger.note)
                if saved is not None:
                    logger.note(f"saved checkpoint {saved}")
            if stopping:
                logger.note(f"stop requested by signal: exiting cleanly after step {done}")
                break
    finally:
        r.checkpoints.finish(logger.note, quiet=sys.exc_info()[0] is not None)  # the save in flight, if any
        watchdog.close()
        tracker.finish()
    optimizer.finish_param_sync()  # no parameter gather left in flight when the process group goes
    last_checkpoint = r.checkpoints.last_saved or (Path(resumed_from) if resumed_from else None)
    logger.note(logger.summary(last_checkpoint, cfg.logging.dir))
    if r.owns_group:
        dist.destroy_process_group()
    return last


def main(argv: list[str] | None = None) -> int:
    """Entry point: a user-fixable problem prints one line and exits with its code, no traceback.

    Under a launcher a config error, and any error before the process group starts (a checkpoint the flags
    contradict), is the same on every rank: rank 0 prints it, the others wait for the launcher to stop them
    (one line, not one per process; see `_leave_it_to_rank_0`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check, setup = None, True
    try:
        check = CheckRequest.take(argv)
        if check is not None:
            return check_config(argv, check)
        cfg, _ = setup_config(argv)
        setup = False  # up to here no process group exists and every rank read the same config and checkpoint
        run(cfg)
    except MegaliteError as e:
        if check is None and (isinstance(e, ConfigError) or setup) and launcher_rank() != 0:
            _leave_it_to_rank_0()
        tell_torchrun(e)  # under bare torchrun the line closes its report of the failed processes too
        return report(e, "megalite: error")
    except OSError as e:  # e.g. a full disk for the logs: one line too
        return report(from_os_error(e), "megalite: error")
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers exist (startup, --check-config)
        if launcher_rank() == 0:
            print("megalite: interrupted (Ctrl-C) before training started: nothing trained or saved",
                  file=sys.stderr)
        return 130
    return 0


RANK_0_GRACE_S = 30.0


def _leave_it_to_rank_0() -> None:
    """Wait while rank 0 reports the config error every rank hit. Exiting at once would be wrong: torchrun
    stops the whole job at the first failed process, which can kill rank 0 before it has printed. Rank 0's
    exit makes the launcher stop this process (SIGTERM, default action restored for that); if nothing has
    after the grace (a launcher that does not stop the others, or an error only this rank saw), the caller
    reports it here too, so it is never lost."""
    import signal

    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread (an embedding program): its handler stays
        pass
    time.sleep(RANK_0_GRACE_S)


def launcher_rank() -> int:
    """This process's rank as the launcher set it (`parallel.state.launcher_env`, the one reader of the
    launcher's variables); 0 when alone or when they are unreadable (that error is rank 0's to report)."""
    try:
        return launcher_env()[0]
    except LaunchError:
        return 0
