"""At least 25 bad inputs, each answered by one clear line and its exit code — no traceback — and
nothing already saved is damaged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from megalite.data import IndexedDatasetWriter, prepare_demo_data
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN, free_port

CONFIG, DATA, CKPT, LAUNCH, STORAGE = 2, 3, 4, 5, 1


def snapshot(root: str | Path) -> dict[str, str]:
    """sha256 of every file under `root` (by relative path), to prove a failing command changed nothing;
    the lock file, which only names the directory's current owner, is left out."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".megalite.lock"}


def assert_one_line(err: str, got: int, code: int, needle: str) -> None:
    """Exit code `code`, exactly one line on stderr mentioning `needle`, and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("\r", "\x1b"))]
    assert got == code, f"exit {got} (wanted {code}), stderr: {err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err}"
    assert needle in lines[0], f"{needle!r} not in: {lines[0]}"


# Runs each `[script, *args]` as `python script args` runs it (sys.argv, sys.path[0] = the script's folder,
# `__name__ == "__main__"`), one after another in ONE interpreter: every script's own entry point and exit code
# are exercised while torch and megalite are imported once, not once per script. Each script's stderr is read at
# the file descriptor, so what C code or a warning writes there counts too.
_SCRIPTS_DRIVER = r"""
import json, os, runpy, sys, tempfile
runs, out = json.loads(sys.argv[1]), sys.argv[2]
results = []
for argv in runs:
    sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:  # what the interpreter does with sys.exit's argument
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        results.append([code, err.read().decode(errors="replace")])
with open(out, "w") as f:
    json.dump(results, f)
"""


def run_scripts(runs: list[list[str]], tmp_path: Path) -> list[tuple[int, str]]:
    """(exit code, stderr) of `python *argv` for each argv in `runs`, run from the repository root."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "script_results.json"
    proc = subprocess.run([sys.executable, "-c", _SCRIPTS_DRIVER, json.dumps(runs), str(out)], cwd=repo,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(repo)))
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]  # a script's traceback ends the driver
    results = [(int(code), str(err)) for code, err in json.loads(out.read_text())]
    out.unlink()
    return results


@pytest.fixture(scope="module")
def env(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files the cases point at: a good checkpoint, broken data pairs, a tokenizer."""
    root = tmp_path_factory.mktemp("bad")
    prefix, tok = prepare_demo_data(demo_cache_dir, 300000, 512)
    good = root / "good"
    assert main(["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(root / "log"),
                 "--train.steps", "1", "--checkpoint.dir", str(good)]) == 0
    (root / "trunc.idx").write_bytes(Path(prefix + ".idx").read_bytes())
    (root / "trunc.bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-6])
    (root / "magic.idx").write_bytes(b"NOTMEGA!" + Path(prefix + ".idx").read_bytes()[8:])
    (root / "magic.bin").write_bytes(Path(prefix + ".bin").read_bytes())
    (root / "onlyidx.idx").write_bytes(Path(prefix + ".idx").read_bytes())
    idx = bytearray(Path(prefix + ".idx").read_bytes())
    idx[12:16] = (2).to_bytes(4, "little")  # the header claims int32 for a uint16 .bin of the same token count
    (root / "dtype.idx").write_bytes(bytes(idx))
    (root / "dtype.bin").write_bytes(Path(prefix + ".bin").read_bytes())
    writer = IndexedDatasetWriter(str(root / "big"), 70000)  # ids beyond the 512-token tokenizer
    writer.add_document([60000, 1, 2] * 200)
    writer.finalize()
    corrupt = root / "corrupt"
    assert main(["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(root / "log2"),
                 "--train.steps", "1", "--checkpoint.dir", str(corrupt)]) == 0
    rank0 = next(corrupt.glob("step_*/rank_00000.safetensors"))
    rank0.write_bytes(rank0.read_bytes()[:-100] + b"x" * 100)
    (root / "a_file").write_text("not a directory")
    (root / "bad.toml").write_text("[train\nsteps = 3\n")
    (root / "nometa").mkdir()
    (root / "cfgdir.toml").mkdir()
    (root / "latin1.toml").write_bytes("[train]\n# caf\xe9\nsteps = 3\n".encode("latin-1"))
    lying = IndexedDatasetWriter(str(root / "lying"), 512)  # header says max id 500, the .bin holds 600
    lying.add_document([500, 1, 2] * 300)
    lying.finalize()
    raw = bytearray(Path(root / "lying.bin").read_bytes())
    raw[-2:] = (600).to_bytes(2, "little")
    (root / "lying.bin").write_bytes(bytes(raw))
    return {"root": str(root), "prefix": prefix, "tok": tok, "good": str(good), "corrupt": str(corrupt)}


CASES: dict[str, tuple[list[str], int, str]] = {
    # config typos and contradictions
    "unknown preset": (["--model.preset", "llama-3t"], CONFIG, "llama-7b"),
    "key typo": (["--model.hiden_size", "64"], CONFIG, "did you mean 'model.hidden_size'"),
    "unknown section": (["--modle.num_layers", "2"], CONFIG, "modle"),
    "wrong type": (["--train.steps", "many"], CONFIG, "train.steps"),
    "bad choice": (["--train.dtype", "fp12"], CONFIG, "train.dtype"),
    "hidden vs heads": (["--model.num_heads", "3"], CONFIG, "num_heads"),
    "heads vs kv heads": (["--model.num_kv_heads", "3"], CONFIG, "num_kv_heads"),
    "world vs tp*pp*dp": (["--parallel.tp", "2", "--parallel.dp", "1"], CONFIG, "world"),
    "layers vs pp": (["--parallel.pp", "3", "--parallel.dp", "1"], CONFIG, "num_layers"),
    "global batch vs micro x dp": (["--train.global_batch_size", "10"], CONFIG, "global_batch_size"),
    "micro-batches < pp": (["--parallel.pp", "2", "--train.global_batch_size", "4"], CONFIG, "micro-batches"),
    "sp without tp": (["--parallel.sp", "true"], CONFIG, "sp"),
    "vpp without interleaved": (["--parallel.vpp", "2"], CONFIG, "interleaved"),
    "config file missing": (["--config", "/nonexistent/run.toml"], CONFIG, "/nonexistent/run.toml"),
    "config file bad TOML": (["--config", "{root}/bad.toml"], CONFIG, "bad.toml"),
    "zero 3 with interleaved chunks": (["--parallel.zero", "3", "--parallel.pp", "2", "--parallel.vpp", "2",
                                        "--parallel.schedule", "interleaved"], CONFIG, "parallel.vpp"),
    "load latest without dir": (["--checkpoint.load", "latest"], CONFIG, "checkpoint.dir"),
    # data and tokenizer
    "missing data": (["--data.path", "/nonexistent/corpus", "--data.tokenizer", "{tok}"], DATA, "/nonexistent/corpus"),
    "truncated .bin": (["--data.path", "{root}/trunc", "--data.tokenizer", "{tok}"], DATA, "trunc"),
    "bad .idx magic": (["--data.path", "{root}/magic", "--data.tokenizer", "{tok}"], DATA, "magic"),
    ".idx dtype disagrees with the .bin size": (["--data.path", "{root}/dtype", "--data.tokenizer", "{tok}"], DATA,
                                                "mismatched"),
    ".idx without .bin": (["--data.path", "{root}/onlyidx", "--data.tokenizer", "{tok}"], DATA, ".bin"),
    "missing tokenizer": (["--data.tokenizer", "/nonexistent/tok.model"], DATA, "/nonexistent/tok.model"),
    "data ids beyond the tokenizer": (["--data.path", "{root}/big", "--data.tokenizer", "{tok}"], DATA, "tokenizer"),
    "model vocab < tokenizer vocab": (["--model.vocab_size", "100"], DATA, "model.vocab_size"),
    "data without tokenizer": (["--data.path", "{prefix}"], CONFIG, "data.tokenizer"),
    # checkpoints
    "checkpoint of another model": (["--model.hidden_size", "32", "--checkpoint.load", "{good}"], CKPT, "different model"),
    "not a checkpoint": (["--checkpoint.load", "{root}/nometa"], CKPT, "index.json"),
    "corrupted checkpoint file": (["--checkpoint.load", "{corrupt}"], CKPT, "sha256 mismatch"),
    "checkpoint dir not writable": (["--checkpoint.dir", "{root}/a_file/ckpt"], CKPT, "a_file"),
    # values that pass every comparison but cannot be meant: NaN/inf, negative seeds, absurd sizes
    "lr NaN": (["--train.lr", "nan"], CONFIG, "train.lr must be a finite number"),
    "min_lr inf": (["--train.min_lr", "inf"], CONFIG, "train.min_lr must be a finite number"),
    "weight_decay NaN": (["--optimizer.weight_decay", "nan"], CONFIG, "optimizer.weight_decay must be a finite"),
    "init_std inf": (["--model.init_std", "inf"], CONFIG, "model.init_std must be a finite"),
    "clip_grad NaN": (["--train.clip_grad", "nan"], CONFIG, "train.clip_grad must be a finite"),
    "blend weight NaN": (["--data.weights", "nan"], CONFIG, "data.weights must be a finite"),
    "infinite timeout": (["--parallel.timeout_s", "inf"], CONFIG, "parallel.timeout_s must be a finite"),
    "timeout beyond the stores": (["--parallel.timeout_s", "1e12"], CONFIG, "parallel.timeout_s"),
    "negative seed": (["--train.seed", "-1"], CONFIG, "train.seed must be >= 0"),
    "model larger than any device": (["--model.hidden_size", "1048576", "--model.num_heads", "8",
                                      "--model.num_kv_heads", "8"], CONFIG, "TiB per rank"),
    "odd RoPE head dim": (["--model.hidden_size", "60", "--model.num_heads", "4", "--model.num_kv_heads", "4"],
                          CONFIG, "head dim 15 is odd"),
    "micro-batch larger than the dataset": (["--train.micro_batch_size", "1000000", "--train.global_batch_size",
                                             "1000000", "--train.memory_check", "false"],  # (it does not fit either)
                                            DATA, "larger than the whole training set"),
    # files and directories of the wrong kind
    "config is a directory": (["--config", "{root}/cfgdir.toml"], CONFIG, "is a directory"),
    "config not UTF-8": (["--config", "{root}/latin1.toml"], CONFIG, "not UTF-8"),
    "logging.dir is a file": (["--logging.dir", "{root}/a_file"], CONFIG, "logging.dir"),
    "logging.dir under a file": (["--logging.dir", "{root}/a_file/log"], CONFIG, "a_file, which is a file"),
    "cache dir is a file": (["--data.cache_dir", "{root}/a_file"], CONFIG, "data.cache_dir"),
    ".bin ids beyond its own header": (["--data.path", "{root}/lying", "--data.tokenizer", "{tok}"], DATA,
                                       "holds token id 600"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case: str, env: dict[str, str], demo_cache_dir: str, tmp_path: Path, capsys) -> None:
    extra, code, needle = CASES[case]
    extra = [a.format(**env) for a in extra]
    saved = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(env["good"]).rglob("*") if p.is_file()}
    args = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(tmp_path), "--train.steps", "1"]
    got = main(args + extra)
    err = capsys.readouterr().err
    assert_one_line(err, got, code, needle)
    assert err.strip().startswith("megalite: error:")
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(env["good"]).rglob("*") if p.is_file()}
    assert after == saved, "an existing checkpoint was modified"


LAUNCHER_ENVS: dict[str, tuple[dict[str, str], str]] = {
    "RANK without WORLD_SIZE": ({"RANK": "0"}, "WORLD_SIZE"),
    "RANK not a number": ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
    "RANK >= WORLD_SIZE": ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside 0..1"),
    "negative RANK": ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
    "WORLD_SIZE zero": ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    "LOCAL_RANK garbage": ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    "MASTER_PORT out of range": ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    "srun tasks garbage": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "many"}, "SLURM_NTASKS='many'"),
}


def test_launcher_envs_that_do_not_add_up(monkeypatch, capsys) -> None:
    for case, (env, needle) in LAUNCHER_ENVS.items():
        with monkeypatch.context() as m:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
                m.delenv(k, raising=False)
            m.setenv("MASTER_ADDR", "127.0.0.1")
            m.setenv("MASTER_PORT", "29500")
            for k, v in env.items():
                m.setenv(k, v)
            got = main([])
        assert_one_line(capsys.readouterr().err, got, LAUNCH, needle)


def test_missing_peer_is_a_launch_error(monkeypatch, capsys, tmp_path: Path) -> None:
    """Rank 0 of 2 started alone: the rendezvous times out (parallel.timeout_s) into one line, exit 5."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    got = main(["--parallel.timeout_s", "2", "--logging.dir", str(tmp_path)])
    assert_one_line(capsys.readouterr().err, got, LAUNCH, "could not join the job")


def test_full_disk_for_the_logs(demo_cache_dir: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """metrics.jsonl on a full device (/dev/full answers every write with ENOSPC): one line, exit 1."""
    from megalite.observability import metrics

    # megalite never writes through a link (docs/reliability.md), so the device is opened in its place.
    monkeypatch.setattr(metrics, "open_no_link", lambda path, mode, error: open("/dev/full", mode))
    got = main(["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--logging.dir", str(tmp_path), "--train.steps", "1"])
    assert_one_line(capsys.readouterr().err, got, STORAGE, "No space left on device")


def test_triton_on_cpu_without_interpreter(monkeypatch, capsys) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["--model.kernels", "triton"]) == CONFIG
    assert "TRITON_INTERPRET" in capsys.readouterr().err
