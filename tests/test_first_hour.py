"""What a new user hits in the first hour (issue 27): the memory check sizes every tokenizer kind with the
data's own loader and never skips silently; data made by another tokenizer is refused; the checkpoint
directory message names both ways out."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalite.config import parse_args, resolve
from megalite.errors import ConfigError, DataError
from megalite.training.memory_check import check_memory, tokenizer_vocab_size
from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.tokenizer_utils import train_hf_bpe, write_tiktoken
from tools.preprocess_data import main as preprocess_main

pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fh-toks")
    return {"hf300": train_hf_bpe(d / "a" / "tokenizer.json", vocab_size=300),
            "hf320": train_hf_bpe(d / "b" / "tokenizer.json", vocab_size=320),
            "tiktoken": write_tiktoken(d / "mini.tiktoken")}


@pytest.mark.parametrize("kind,vocab", [("hf300", 300), ("tiktoken", 256 + 11 + 1)])
def test_check_config_sizes_hf_and_tiktoken_tokenizers(toks: dict[str, Path], kind: str, vocab: int,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--check-config` (what launch/torchrun.sh and slurm.sbatch run first) reads a tokenizer.json and a
    .tiktoken file, where it used to read every file as SentencePiece and exit 3."""
    cfg = resolve(parse_args(["--data.tokenizer", str(toks[kind])]), 1)
    assert tokenizer_vocab_size(cfg) == vocab
    assert main(["--check-config", "--data.tokenizer", str(toks[kind]), "--model.preset", "tiny"]) == 0
    assert "config ok" in capsys.readouterr().err


def test_memory_check_refuses_instead_of_skipping(toks: dict[str, Path], tmp_path: Path) -> None:
    """A vocabulary of 0 left to a tokenizer.json: the check sizes it and refuses what does not fit (it
    used to skip the check); an unreadable tokenizer is its DataError, not a skipped check."""
    cfg = resolve(parse_args(["--model.preset", "llama-160m", "--model.vocab_size", "0",
                              "--data.tokenizer", str(toks["hf300"])]), 1)
    with pytest.raises(ConfigError, match="this run needs about"):
        check_memory(cfg, 1, available=1 << 20)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    cfg.data.tokenizer = str(bad)
    with pytest.raises(DataError, match="cannot read tokenizer"):
        check_memory(cfg, 1, available=1 << 40)


def test_data_from_another_tokenizer_is_refused(toks: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Preprocessed with a 300-id tokenizer, trained with a 320-id one: the ids would mean other tokens (all
    of them are < 320, so the range check alone passes): one line, exit 3, before any step."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, " * 400)
    prefix = tmp_path / "data"
    assert preprocess_main(["--input", str(corpus), "--tokenizer", str(toks["hf300"]),
                            "--output-prefix", str(prefix), "--quiet", "--workers", "1"]) == 0
    capsys.readouterr()
    code = main(["--data.path", str(prefix), "--data.tokenizer", str(toks["hf320"]), "--model.preset", "tiny",
                 "--model.seq_len", "16", "--train.steps", "1", "--logging.dir", str(tmp_path / "logs"),
                 "--checkpoint.dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1, err
    assert "300 ids" in err and "has 320" in err and "preprocess it again" in err


def test_different_model_in_the_directory_names_both_fixes(demo_cache_dir: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Following two README sections into one --checkpoint.dir: the message says "another directory" (the
    fix there) as well as "drop these flags" (the fix when resuming was meant)."""
    ckpt = tmp_path / "ckpt"
    base = ["--data.cache_dir", demo_cache_dir, *SMALL_RUN, "--checkpoint.dir", str(ckpt)]
    assert main([*base, "--train.steps", "1", "--logging.dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main([*base, "--train.steps", "2", "--model.hidden_size", "32", "--logging.dir", str(tmp_path / "b")]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its own --checkpoint.dir" in err and "drop these flags" in err, err


def test_preprocess_workers_default_to_the_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tools.preprocess_data as tool
    from megalite.runtime.threads import available_cores

    seen: dict[str, int] = {}
    monkeypatch.setattr(tool, "preprocess", lambda *a, **k: seen.update(workers=k["workers"]) or "p")
    assert tool.main(["--input", "x", "--tokenizer", "t", "--output-prefix", str(tmp_path / "o")]) == 0
    assert seen["workers"] == available_cores()
    assert tool.main(["--input", "x", "--tokenizer", "t", "--output-prefix", "o", "--workers", "1"]) == 0
    assert seen["workers"] == 1


def test_progress_rate_counts_from_the_first_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that takes 60 s to start and then does 10 docs/s shows "starting", then 10 docs/s, never the
    0.0 docs/s (or the ETA) that counting from the start would give."""
    import io

    from megalite.observability import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = progress.Progress(total=1000, desc="tokenizing", unit="docs", stream=out, min_interval=0.0)
    assert out.getvalue().splitlines() == ["tokenizing: 0/1000 docs  starting  elapsed 0:00:00"]
    clock[0] = 60.0
    bar.update()
    assert "first after 60.0 s" in bar.line()
    clock[0] = 70.0
    bar.update(100)
    assert "10.0 docs/s (first after 60.0 s)" in bar.line() and "ETA 0:01:29" in bar.line()


# ----------------------------------------------------------------------------- issue 51: the first hour, round 4


def test_slow_phase_speaks_only_when_slow() -> None:
    """A phase quicker than its threshold prints nothing; one past it says what runs, then how long it took."""
    import io

    from megalite.observability.phases import SlowPhase

    quiet, loud = io.StringIO(), io.StringIO()
    with SlowPhase("building the model", after_s=3600, stream=quiet):
        pass
    with SlowPhase("building the model", after_s=0, stream=loud):
        assert loud.getvalue() == "megalite: building the model (still running after 0 s)\n"
    assert quiet.getvalue() == ""
    assert loud.getvalue().splitlines()[1].startswith("megalite: building the model: done in ")


def test_check_config_prints_the_memory_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    """A run that fits says what was predicted and compared (it printed only "config ok")."""
    assert main(["--check-config", "--model.preset", "tiny"]) == 0
    err = capsys.readouterr().err
    assert "megalite: memory check: predicted peak per process" in err and "GiB" in err and "config ok" in err


def test_summary_best_step_is_a_logged_step_and_eta_skips_the_warm_up(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from megalite.observability.metrics import MetricsLogger
    from megalite.observability.tracking import Tracker

    log = MetricsLogger(str(tmp_path), True, Tracker("", "", "", {}, str(tmp_path), enabled=False), 100)
    for step, loss, seconds in ((1, 5.0, 40.0), (2, 1.0, 1.0), (3, 3.0, 1.0)):  # step 2 best, not logged
        log.step_done(step, loss, False, seconds, 10)
        if step != 2:
            log.log({"step": step, "loss": loss, "lr": 0.1, "grad_norm": 1.0})
    lines = capsys.readouterr().out.splitlines()
    assert "ETA" not in lines[0]  # after the first step alone: no rate to trust yet
    assert "ETA 1m37s" in lines[1]  # 97 steps x 1 s: the 40 s warm-up is left out
    assert "best 3.0000 at step 3" in log.summary(None, str(tmp_path))


def test_help_names_the_launcher_flags_and_fits_the_terminal(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from megalite.config import parse_args

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--check-config" in out and "--world-size N" in out and "--local-processes N" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_missing_tokenizer_hint_trains_the_kind_asked() -> None:
    from megalite.data.tokenizer import load_tokenizer

    with pytest.raises(DataError, match=r"--model-prefix data/tokenizer --vocab-size 32000 --kind hf` writes "
                                        r"data/tokenizer\.json"):
        load_tokenizer("data/tokenizer.json")
    with pytest.raises(DataError, match=r"--model-prefix tok --vocab-size 32000` writes tok\.model"):
        load_tokenizer("tok.model")


def test_plot_labels_the_communication_of_one_process() -> None:
    from tools.plot_metrics import comm_note

    assert comm_note({"a": [{"step": 1, "comm_bytes": {}}]}) is not None
    assert comm_note({"a": [{"step": 1, "comm_bytes": {"dp": 0.0}}]}) is not None
    assert comm_note({"a": [{"step": 1, "comm_bytes": {"dp": 5.0}}]}) is None


def test_plan_hfu_is_never_below_mfu(capsys: pytest.CaptureFixture[str]) -> None:
    """An untied model's PaLM 6N counts the input embedding, a gather: HFU read below MFU (101.7% vs 100%)."""
    import json

    from tools.plan import main as plan_main

    assert plan_main(["--preset", "llama-7b", "--nodes", "4", "--global-batch-size", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out.get("ranked") or out.get("layouts") or []
    assert rows and all(r["hfu"] >= r["mfu"] for r in rows)


def test_bare_torchrun_report_ends_on_megalites_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun reads a failed worker's TORCHELASTIC_ERROR_FILE into its "Root Cause" (the last lines it prints):
    rank 0 writes megalite's line there, in the format torchrun parses (its own ProcessFailure reads it back)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("RANK", raising=False)  # one process: rank 0, the reporting one
    assert main(["--model.num_layers", "-3"]) == 2
    line = capsys.readouterr().err.strip()
    report = ChildFailedError("pretrain.py", {0: ProcessFailure(0, 1, 2, str(error_file))}).format_msg()
    assert line.startswith("megalite: error: ") and f"traceback : {line}\n" in report
