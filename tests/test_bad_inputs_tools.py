"""The data and plotting tools under hostile and careless input: one line, the documented exit code, no
traceback, and an output that existed before a failing command is byte-identical afterwards.

Tools are called in-process through `main(argv)` (the same function `python tools/x.py` runs, already
behind `megalite.errors.entry_point`); one test starts the scripts themselves to cover that path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from megalite.data import IndexedDataset, prepare_demo_data
from megalite.errors import entry_point
from tests.test_bad_inputs import CONFIG, DATA, STORAGE, assert_one_line, run_scripts, snapshot
from tools import pipeline_timeline, plot_metrics, preprocess_data, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SURROGATES = "lone \ud800 high, lone \udfff low, a real pair \U0001F600 "


@pytest.fixture(scope="module")
def files(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toolbad")
    _, tok = prepare_demo_data(demo_cache_dir, 300000, 512)
    text = "\n".join(Path(p).read_text() for p in sorted((REPO / "megalite" / "data").glob("*.py")))
    (root / "good.txt").write_text(text)
    lines = [json.dumps({"text": SURROGATES + text[i:i + 2000]}) for i in range(0, len(text), 2000)]
    (root / "surrogates.jsonl").write_text("\n".join(lines) + "\n")  # json.dumps escapes them: valid UTF-8
    (root / "broken.jsonl").write_text(lines[0] + "\n{not json\n")
    (root / "a_file").write_text("x")
    return {"root": root, "tok": Path(tok), "good": root / "good.txt", "surrogates": root / "surrogates.jsonl",
            "broken": root / "broken.jsonl", "a_file": root / "a_file"}


def _run(tool: Callable[[list[str] | None], int], argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    got = tool(argv)
    return got, capsys.readouterr().err


def test_preprocess_bad_arguments_and_outputs(files: dict[str, Any], tmp_path: Path, capsys) -> None:
    base = ["--tokenizer", str(files["tok"]), "--quiet"]
    out = tmp_path / "kept"
    assert preprocess_data.main(["--input", str(files["good"]), "--output-prefix", str(out), *base]) == 0
    before = snapshot(tmp_path)
    cases = [
        (["--input", str(files["good"]), "--output-prefix", str(out), "--workers", "0"], CONFIG, "--workers 0"),
        (["--input", str(files["good"]), "--output-prefix", str(out), "--workers", "two"], CONFIG, "invalid int"),
        (["--input", str(files["surrogates"]), str(files["broken"]), "--output-prefix", str(out), "--json-key",
          "text"], DATA, "broken.jsonl:2"),
        (["--input", str(files["surrogates"]), "--output-prefix", str(out), "--json-key", "body"], DATA, "'body'"),
        (["--input", str(files["good"]), "--output-prefix", str(files["a_file"] / "x")], STORAGE, "a_file"),
        (["--input", str(files["root"]), "--output-prefix", str(out)], DATA, "pass --json-key"),
        (["--input", str(files["root"] / "none.txt"), "--output-prefix", str(out)], DATA, "input file not found"),
        (["--output-prefix", str(out)], CONFIG, "--input"),
    ]
    for argv, code, needle in cases:
        got, err = _run(preprocess_data.main, argv + base, capsys)
        assert_one_line(err, got, code, needle)
    assert snapshot(tmp_path) == before, "a failing preprocess changed or left files"


def test_preprocess_and_tokenizer_accept_lone_surrogates(files: dict[str, Any], tmp_path: Path, capsys) -> None:
    """Valid JSON may escape unpaired surrogates; they become U+FFFD instead of crashing the tokenizer."""
    prefix = tmp_path / "s"
    got, err = _run(preprocess_data.main, ["--input", str(files["surrogates"]), "--json-key", "text",
                                           "--tokenizer", str(files["tok"]), "--output-prefix", str(prefix),
                                           "--quiet"], capsys)
    assert got == 0, err
    assert len(IndexedDataset(str(prefix))) == len(files["surrogates"].read_text().splitlines())
    got, err = _run(train_tokenizer.main, ["--input", str(files["surrogates"]), "--json-key", "text",
                                           "--model-prefix", str(tmp_path / "t"), "--vocab-size", "600"], capsys)
    assert got == 0 and (tmp_path / "t.model").is_file(), err
    n_docs = len(files["surrogates"].read_text().splitlines())  # two unpaired surrogates in each document
    assert f"replaced {2 * n_docs} unpaired surrogate escape(s)" in err and f"in {n_docs} document(s)" in err


def test_train_tokenizer_bad_arguments_keep_the_old_model(files: dict[str, Any], tmp_path: Path, capsys) -> None:
    model = tmp_path / "tok.model"
    model.write_bytes(files["tok"].read_bytes())  # a model from an earlier run
    before = snapshot(tmp_path)
    prefix = str(tmp_path / "tok")
    cases = [
        (["--input", str(files["good"]), "--vocab-size", "10"], CONFIG, "--vocab-size 10"),
        (["--input", str(files["good"]), "--vocab-size", "-300"], CONFIG, "--vocab-size -300"),
        (["--input", str(files["good"]), "--vocab-size", "300", "--max-bytes", "0"], CONFIG, "--max-bytes 0"),
        (["--input", str(files["good"]), "--vocab-size", "300", "--max-bytes", "-5"], CONFIG, "--max-bytes -5"),
        (["--input", str(tmp_path / "missing.txt"), "--vocab-size", "300"], DATA, "missing.txt"),
        (["--input", str(files["broken"]), "--json-key", "text", "--vocab-size", "300"], DATA, "not valid JSON"),
        (["--input", str(files["good"]), "--vocab-size", "1000000"], DATA, "tokenizer training failed"),
        (["--input", str(files["good"]), "--vocab-size", "300"], DATA, "required_chars"),
    ]
    for argv, code, needle in cases:
        got, err = _run(train_tokenizer.main, argv + ["--model-prefix", prefix], capsys)
        assert_one_line(err, got, code, needle)
        assert "--character_coverage" not in err, "names a flag this tool does not have"
    got, err = _run(train_tokenizer.main, ["--input", str(files["good"]), "--vocab-size", "600",
                                           "--model-prefix", str(files["a_file"] / "t")], capsys)
    assert_one_line(err, got, STORAGE, "a_file")
    assert snapshot(tmp_path) == before, "a failing tokenizer run changed or left files"


def test_pipeline_timeline_arguments(tmp_path: Path, capsys) -> None:
    png = tmp_path / "t.png"
    png.write_bytes(b"an earlier picture")
    cases = [
        (["--pp", "0"], CONFIG, "--pp 0 must be >= 1"), (["--micro-batches", "0"], CONFIG, "--micro-batches 0"),
        (["--micro-batches", "-3"], CONFIG, "--micro-batches -3"), (["--vpp", "0"], CONFIG, "--vpp 0"),
        (["--t-forward", "nan"], CONFIG, "--t-forward nan"), (["--t-backward", "-1"], CONFIG, "--t-backward -1.0"),
        (["--t-forward", "inf"], CONFIG, "--t-forward inf"), (["--schedule", "zb"], CONFIG, "invalid choice"),
        (["--schedule", "interleaved", "--vpp", "1"], CONFIG, "--vpp >= 2"),
        (["--schedule", "interleaved", "--vpp", "2", "--pp", "4", "--micro-batches", "6"], CONFIG, "multiple of --pp"),
        (["--pp", "x"], CONFIG, "invalid int value"),
    ]
    for argv, code, needle in cases:
        got, err = _run(pipeline_timeline.main, argv + ["--png", str(png)], capsys)
        assert_one_line(err, got, code, needle)
    assert png.read_bytes() == b"an earlier picture"
    got, err = _run(pipeline_timeline.main, ["--png", str(tmp_path / "t.png" / "under.png")], capsys)
    assert_one_line(err, got, STORAGE, "under.png")
    assert pipeline_timeline.main(["--pp", "2", "--micro-batches", "4", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_plot_metrics_keeps_an_existing_plot(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    png.write_bytes(b"an earlier plot")
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    cases = [([str(bad)], DATA, "is not JSON"), ([str(tmp_path / "none.jsonl")], DATA, "does not exist"),
             ([str(bad), "--labels", "a", "b"], CONFIG, "2 labels for 1 runs")]
    for argv, code, needle in cases:
        got, err = _run(plot_metrics.main, argv + ["-o", str(png)], capsys)
        assert_one_line(err, got, code, needle)
    assert png.read_bytes() == b"an earlier plot"
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"step": 1, "loss": 2.0, "note": "caf\xe9"}\n'.encode("latin-1"))
    got, err = _run(entry_point(plot_metrics.main), [str(latin1), "-o", str(png)], capsys)  # as `__main__` runs it
    assert_one_line(err, got, DATA, "not UTF-8")
    assert png.read_bytes() == b"an earlier plot"


def test_tool_scripts_print_one_line(files: dict[str, Any], tmp_path: Path) -> None:
    """`python tools/x.py` with bad arguments, as a user runs them (each script's `__main__`, in one interpreter:
    tests/test_bad_inputs.py's `run_scripts`)."""
    runs = [(["tools/pipeline_timeline.py", "--pp", "-1"], CONFIG, "--pp -1"),
            (["tools/preprocess_data.py", "--input", str(files["good"]), "--tokenizer", str(files["tok"]),
              "--output-prefix", str(tmp_path / "o"), "--workers", "-2"], CONFIG, "--workers -2"),
            (["tools/train_tokenizer.py", "--input", str(files["good"]), "--model-prefix", str(tmp_path / "t")],
             CONFIG, "--vocab-size")]
    results = run_scripts([argv for argv, _, _ in runs], tmp_path)
    for (_, code, needle), (got, err) in zip(runs, results, strict=True):
        assert_one_line(err, got, code, needle)
    assert not list(tmp_path.iterdir())
