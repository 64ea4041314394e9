"""End to end: pretrain.py trains, logs every metrics field, resumes exactly, runs at 2 ranks with TP, prints
a config error once under torchrun, and turns bad input into one clear line instead of a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.training.trainer import main
from tests.conftest import SMALL_RUN, free_port
from tests.pool_pretrain import run_pretrain_in_pool

REPO = Path(__file__).resolve().parents[1]
CONTRACT_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mfu_causal",
                   "mem_peak_bytes", "comm_bytes", "comm_convention", "comm_written_bytes", "skipped", "timestamp",
                   "tokens_seen"}


def _losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _args(demo_cache_dir: str, log_dir: Path, *extra: str) -> list[str]:
    return ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(log_dir), *extra]


def test_loss_falls_and_metrics_have_every_field(demo_cache_dir: str, tmp_path: Path) -> None:
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "40", "--train.lr", "1e-2",
                      "--train.eval_interval", "20")) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    for row in rows:
        assert CONTRACT_FIELDS <= row.keys(), f"missing {CONTRACT_FIELDS - row.keys()}"
    assert rows[0]["loss"] > np.log(512) - 0.5  # starts near uniform over the vocabulary
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.7, "loss did not fall"  # observed: 6.24 -> ~5.2
    assert rows[-1]["mfu"] is None  # no known peak on a CPU
    assert rows[-1]["valid_loss"] is not None
    assert "num_layers = 2" in (tmp_path / "config.toml").read_text()


def test_resume_continues_bit_for_bit(demo_cache_dir: str, tmp_path: Path) -> None:
    """6 steps straight (saving at 3) == load the step-3 checkpoint in a fresh run + 3 steps, fp32."""
    ckpt = tmp_path / "ckpt"
    common = ["--train.steps", "6", "--checkpoint.dir", str(ckpt), "--checkpoint.keep", "5"]
    assert main(_args(demo_cache_dir, tmp_path / "a", *common, "--checkpoint.interval", "3")) == 0
    straight = _losses(tmp_path / "a")
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert main(_args(demo_cache_dir, tmp_path / "b", *common, "--checkpoint.load", str(ckpt / "step_00000003"),
                      "--checkpoint.dir", str(tmp_path / "ckpt2"))) == 0
    resumed = _losses(tmp_path / "b")
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == straight[step], f"step {step}: resumed {loss!r} != straight {straight[step]!r}"


def test_resume_refuses_another_layout_or_model(demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(_args(demo_cache_dir, tmp_path / "a", "--train.steps", "1", "--checkpoint.dir", str(ckpt))) == 0
    code = main(_args(demo_cache_dir, tmp_path / "b", "--train.steps", "2", "--model.hidden_size", "32",
                      "--checkpoint.load", str(ckpt)))
    assert code == 4 and "different model" in capsys.readouterr().err


def _write_bad_bin_idx(tmp: Path, demo_cache_dir: str) -> list[str]:
    from megalite.data import prepare_demo_data

    prefix, tok = prepare_demo_data(demo_cache_dir, 300000, 512)
    bad = tmp / "bad"
    (tmp / "bad.idx").write_bytes(Path(prefix + ".idx").read_bytes())
    (tmp / "bad.bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-10])  # truncated: no longer matches
    return ["--data.path", str(bad), "--data.tokenizer", tok]


BAD_INPUTS = {
    "unknown preset": (["--model.preset", "llama-3t"], 2, "preset"),
    "typo in a key": (["--model.hiden_size", "64"], 2, "did you mean 'model.hidden_size'"),
    "wrong type": (["--train.steps", "many"], 2, "train.steps"),
    "heads do not divide hidden": (["--model.num_heads", "3"], 2, "num_heads"),
    "missing data file": (["--data.path", "/nonexistent/corpus", "--data.tokenizer", "/nonexistent/t.model"], 3,
                          "/nonexistent"),
    "missing tokenizer": (["--data.tokenizer", "/nonexistent/tok.model"], 3, "/nonexistent/tok.model"),
    "model vocab smaller than tokenizer": (["--model.vocab_size", "100"], 3, "model.vocab_size"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_clear_line(case: str, demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    extra, code, needle = BAD_INPUTS[case]
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "1", *extra)) == code
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_mismatched_bin_idx_and_config_file_typo(demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "1", *_write_bad_bin_idx(tmp_path, demo_cache_dir))) == 3
    assert "Traceback" not in capsys.readouterr().err
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nstpes = 3\n")
    assert main(["--config", str(cfg)]) == 2
    assert "train.steps" in capsys.readouterr().err


def _run_script(args: list[str], env_extra: dict[str, str] | None = None, nproc: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    # --standalone: torchrun binds a port of its own choosing (a port picked free here could be taken by
    # a concurrent run before torchrun binds it).
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)
                ] if nproc else [sys.executable]
    return subprocess.run([*launcher, str(REPO / "pretrain.py"), *args], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=900)


def test_script_bad_flag_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    """The real script (its exit code and stderr are what a shell sees); `--help` is the same `main`, in-process."""
    proc = _run_script(["--train.stepz", "3"])
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean 'train.steps'" in proc.stderr
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and "parallel.tp" in capsys.readouterr().out


def test_tensor_parallel_pretrain_matches_single_process(dist_world, demo_cache_dir: str, tmp_path: Path) -> None:
    """2 ranks, tp=2 (and SP): the same losses as one process, and TP bytes in metrics.jsonl. The 2 ranks are the
    warm ones (tests/pool_pretrain.py): this is about the layout's numbers; torchrun's own rendezvous is launched
    for real in tests/test_reliability.py, tests/test_stop_signals.py and tests/test_launch.py."""
    steps = ["--train.steps", "4"]
    assert main(_args(demo_cache_dir, tmp_path / "one", *steps)) == 0
    proc = run_pretrain_in_pool(dist_world, _args(demo_cache_dir, tmp_path / "tp2", *steps, "--parallel.tp", "2",
                                                  "--parallel.sp", "true"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, tp2 = _losses(tmp_path / "one"), _losses(tmp_path / "tp2")
    for step in one:
        # fp32, same math in another summation order (see tests/test_tensor_parallel.py): 1e-5 on O(1) losses.
        assert abs(one[step] - tp2[step]) < 1e-5, f"step {step}: tp=2 loss {tp2[step]} != {one[step]}"
    last = json.loads((tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["comm_bytes"]["tp"] > 0 and last["comm_convention"] == "ring"
    # Measured on CPU: gloo's reduce-scatters write twice their ring count (tests/test_wire_bytes.py), and
    # framing only adds, so with SP the bytes written exceed the bytes counted.
    assert last["comm_written_bytes"] > sum(last["comm_bytes"].values())


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_fresh_run_rotates_metrics_and_resume_appends_from_its_step(demo_cache_dir: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    common = ["--checkpoint.dir", str(ckpt), "--checkpoint.interval", "1", "--checkpoint.keep", "5"]
    assert main(_args(demo_cache_dir, log, "--train.steps", "3", *common)) == 0
    first = (log / "metrics.jsonl").read_text()
    # A fresh run (its own checkpoint directory: an old run's is never rewound) in the same logging.dir.
    fresh = ["--checkpoint.dir", str(tmp_path / "ckpt_fresh"), "--checkpoint.interval", "1"]
    assert main(_args(demo_cache_dir, log, "--train.steps", "3", "--checkpoint.load", "none", *fresh)) == 0
    assert (log / "metrics.1.jsonl").read_text() == first  # the first run's file, kept whole
    assert _steps(log / "metrics.jsonl") == [1, 2, 3]  # not 1, 2, 3, 1, 2, 3
    capsys.readouterr()
    # Resume from step 2 (as after a crash): the record of step 3 the old process wrote is replaced.
    assert main(_args(demo_cache_dir, log, "--train.steps", "5", *common,
                      "--checkpoint.load", str(ckpt / "step_00000002"))) == 0
    assert _steps(log / "metrics.jsonl") == [1, 2, 3, 4, 5] and not (log / "metrics.2.jsonl").exists()
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in rows] == [4 * 32 * s for s in range(1, 6)]  # micro-batch 4 x seq 32
    assert all(a["timestamp"] <= b["timestamp"] for a, b in zip(rows[2:], rows[3:]))
    out = capsys.readouterr().out
    # The progress line: a rate with an adaptive unit, the step time and the memory; then a summary.
    assert re.search(r"step +5/5 \| loss [0-9.]+ \| lr .* \| [0-9.]+k? tok/s \| [0-9.]+ m?s/step \| mem ", out), out
    summary = out[out.index("done: 3 steps (to step 5)"):]
    assert f"{4 * 32 * 5:,} tokens seen" in summary and f"final {rows[-1]['loss']:.4f}" in summary
    assert str(log / "metrics.jsonl") in summary and str(ckpt / "step_00000005") in summary


def test_saved_config_is_resolved_and_the_estimator_predicts_the_runs_bytes(demo_cache_dir: str,
                                                                             tmp_path: Path, capsys) -> None:
    """config.toml names the device, dtype and kernels the run used (not "auto"), so
    `tools/estimate.py --config <run>/config.toml` describes that run: its model-state bytes equal
    what the optimizer's tensors measured (metrics.jsonl mem_bytes), exactly."""
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "1")) == 0
    text = (tmp_path / "config.toml").read_text()
    assert 'dtype = "fp32"' in text and 'device = "cpu"' in text and 'kernels = "torch"' in text
    capsys.readouterr()
    sys.path.insert(0, str(REPO / "tools"))
    import estimate as estimate_tool  # tools/estimate.py

    assert estimate_tool.main(["--config", str(tmp_path / "config.toml"), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["memory"]
    measured = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["mem_bytes"]
    assert {k: predicted[k] for k in measured} == measured


def test_run_that_cannot_fit_is_refused_before_step_1(demo_cache_dir: str, tmp_path: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With 1 MiB "available" (injected, never the real machine's) the run stops with the numbers
    and flags that would fit; `train.memory_check false` runs it anyway."""
    from megalite.training import memory_check

    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 1 << 20)
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "1")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GiB" in err and "train.memory_check=false" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()
    assert main(_args(demo_cache_dir, tmp_path, "--train.steps", "1", "--train.memory_check", "false")) == 0


def test_config_error_under_torchrun_is_printed_once(tmp_path: Path) -> None:
    """Every rank sees the same bad config; rank 0 alone prints it, and torchrun's report of the failed
    processes ends on that line again (its "Root Cause", from the error file rank 0 writes)."""
    proc = _run_script(["--model.num_heads", "3", "--logging.dir", str(tmp_path)], nproc=2)
    lines = proc.stderr.splitlines()
    printed = [line for line in lines if line.startswith("megalite: error")]
    assert proc.returncode != 0 and len(printed) == 1, proc.stderr[-3000:]
    assert f"traceback : {printed[0]}" in proc.stderr.split("Root Cause")[-1], proc.stderr[-3000:]


def test_launch_script_checks_the_config_in_one_process_first(tmp_path: Path) -> None:
    """launch/torchrun.sh validates with the world size it is about to start: one clean line, no
    torchrun, no traceback."""
    env = dict(os.environ, NPROC="2", PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    for var in ("RANK", "WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(["bash", str(REPO / "launch/torchrun.sh"), "--parallel.tp", "3",
                           "--logging.dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("megalite: error:") and "world_size 2 != tp 3" in proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr


def test_readme_own_data_example_fits_a_24_gb_laptop() -> None:
    """The README's `pretrain.py --data.path ...` lines (the CPU-sized and the GPU-sized run; the vocabulary from
    its tokenizer command) are predicted, by the same peak-memory model as the check before step 1, to need under
    24 GB with room to spare: the test keeps each under half the machine (the README says under 8 GiB)."""
    from megalite.config import parse_args, resolve
    from megalite.training.memory_check import predicted_bytes

    text = (REPO / "README.md").read_text()
    commands = re.findall(r"python pretrain\.py (--data\.path .*?)\n```", text, re.S)
    assert len(commands) == 2, "the README's own-data examples are gone"
    vocab = re.search(r"train_tokenizer\.py .*--vocab-size (\d+)", text)
    assert vocab is not None
    for command in commands:
        argv = command.replace("\\\n", " ").split()
        cfg = resolve(parse_args([*argv, "--model.vocab_size", vocab.group(1)]), 1)
        assert predicted_bytes(cfg) < 12e9, predicted_bytes(cfg) / 1e9


def test_memory_check_names_the_changes_that_fit() -> None:
    """llama-160m with micro-batches of 8 on 2 CPU processes: the predicted peak's 2 x 21.6 GiB do not fit
    in an injected 20 GiB; smaller micro-batches and recompute do, and each suggestion is re-checked."""
    from megalite.config import parse_args, resolve
    from megalite.errors import ConfigError
    from megalite.training.memory_check import GiB, alternatives, check_memory_of, predicted_bytes

    cfg = resolve(parse_args(["--model.preset", "llama-160m", "--model.vocab_size", "32000",
                              "--train.global_batch_size", "16"]), 2)
    need = 2 * predicted_bytes(cfg)
    with pytest.raises(ConfigError) as err:
        check_memory_of(cfg, torch.device("cpu"), 2, available=20 * GiB)
    message = str(err.value)
    assert f"{need / GiB:.1f} GiB (2 processes x" in message and "is 20.0 GiB" in message
    assert "activations" in message and "logits and cross-entropy" in message  # the peak's largest terms, named
    fits = alternatives(cfg, 2, 20 * GiB)
    assert fits and all(a.needed <= 20 * GiB for a in fits) and fits[0].flags in message
    assert fits[0].flags == "--train.micro_batch_size 2"  # the first halving that fits: 4 still does not
    check_memory_of(cfg, torch.device("cpu"), 2, available=int(need) + 1)  # fits exactly: no error
    cfg.train.memory_check = False
    check_memory_of(cfg, torch.device("cpu"), 2, available=1)
    tiny = resolve(parse_args(["--model.preset", "llama-160m", "--model.vocab_size", "32000"]), 1)
    with pytest.raises(ConfigError, match="no single change fits"):
        check_memory_of(tiny, torch.device("cpu"), 1, available=1 << 20)
    # 2 GiB: the model states alone (16 bytes x 134M params) do not fit; a smaller preset does.
    with pytest.raises(ConfigError, match="these fit: --model.preset tiny"):
        check_memory_of(tiny, torch.device("cpu"), 1, available=2 * GiB)
