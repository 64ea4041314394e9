"""`pretrain.py --check-config`: validate a run in one process before a launcher starts its workers.

Under torchrun every worker would report a bad config (rank 0 prints it, the others exit quietly) and
torchrun would then add its own traceback of the failed children. `launch/torchrun.sh` and
`launch/slurm.sbatch` run this check first, with the world size they are about to start, so a bad flag
costs one clean line and no process group:

    python pretrain.py --check-config --world-size 8 --local-processes 4 --parallel.tp 2 ...

It resolves and validates the config exactly as the workers will, and compares the predicted peak
memory with this machine's (megalite.training.memory_check), taking the vocabulary size from the
tokenizer when the config leaves it to the tokenizer. It prints that prediction, then "config ok".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from megalite import config as config_mod
from megalite.checkpoint import sharded
from megalite.checkpoint.model_shape import apply_checkpoint_shape
from megalite.config.values import check_text_fields
from megalite.data.checks import check_data
from megalite.errors import ConfigError, one_line
from megalite.training.checkpointing import check_same_optimizer
from megalite.training.init_from import resolve_init_from
from megalite.training.memory_check import check_memory_of, tokenizer_vocab_size


@dataclass(frozen=True)
class CheckRequest:
    world_size: int
    local_processes: int

    @classmethod
    def take(cls, argv: list[str]) -> CheckRequest | None:
        """Remove `--check-config [--world-size N] [--local-processes N]` from argv (in place)."""
        if "--check-config" not in argv:
            return None
        argv.remove("--check-config")
        world = _take_int(argv, "--world-size", 1)
        return cls(world, _take_int(argv, "--local-processes", world))


def _take_int(argv: list[str], flag: str, default: int) -> int:
    if flag not in argv:
        return default
    i = argv.index(flag)
    if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
        raise ConfigError(f"{flag} needs a positive whole number (the processes the launcher will start)")
    value = int(argv[i + 1])
    del argv[i:i + 2]
    return value


def with_checkpoint(cfg: config_mod.Config, argv: list[str] | None) -> config_mod.Config:
    """`cfg` with the model shape of the checkpoint it resumes; a flag contradicting that shape, or another
    `optimizer.name` than the checkpoint's, is one line here: before any process group starts, and the same
    in `--check-config` as in the workers."""
    check_text_fields(cfg)  # before the checkpoint lookup reads checkpoint.dir/load as paths
    path = sharded.find(cfg.checkpoint.load, cfg.checkpoint.dir)
    init = resolve_init_from(cfg.train.init_from, cfg.data.cache_dir) if path is None and cfg.train.init_from \
        else None  # a fresh run from another checkpoint's weights takes its shape too
    cfg = apply_checkpoint_shape(cfg, argv, init)  # model dims from the checkpoint it loads; contradicting flags refused
    if path is not None:
        check_same_optimizer(sharded.read_index(path), cfg.optimizer.name, path)
    return cfg


def check_config(argv: list[str], request: CheckRequest) -> int:
    """Resolve and validate as the workers will; print one line; 0 when the run may start."""
    cfg = config_mod.resolve(with_checkpoint(config_mod.parse_args(argv), argv), request.world_size)
    device = config_mod.resolved_device(cfg)
    config_mod.validate(cfg, request.world_size, device)
    check_data(cfg)
    cfg.model.vocab_size = tokenizer_vocab_size(cfg)
    processes = request.local_processes if device == "cpu" else 1
    memory = check_memory_of(cfg, torch.device(device), processes)
    par = cfg.parallel
    print(f"megalite: {memory}", file=sys.stderr)
    print(f"megalite: config ok for {request.world_size} processes (tp={par.tp} pp={par.pp} dp={par.dp} "
          f"zero={par.zero}, {device})", file=sys.stderr)
    return 0


def tell_torchrun(error: Exception) -> None:
    """Under torchrun (which sets TORCHELASTIC_ERROR_FILE for each worker), write megalite's one line where
    torchrun's report of the failed processes reads a worker's error: its "Root Cause" then ends on that line
    ("traceback : megalite: error: ...") instead of "To enable traceback see ...". Only the reporting rank
    writes (the others wait for the launcher to stop them); a file that cannot be written changes nothing."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    line = f"megalite: error: {one_line(str(error))}"
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass
