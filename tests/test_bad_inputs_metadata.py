"""Untrusted input, round 2: hand-edited or foreign metadata (index.json field types and ranges, safetensors
headers that contradict the index, HF config.json values), nesting deep enough to end a parser in a
RecursionError, generation flags, config text a file system cannot hold, fields read late in a run, plot
records, planner corner cases, bounds on what a machine can bear, Ctrl-C in the tools, and replaced text.

Each case asserts the exit code, exactly one line on stderr, no traceback, and that nothing existing changed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint import files
from megalite.checkpoint.interop import hf as hf_mod
from megalite.errors import INTERRUPTED_EXIT
from megalite.untrusted import MAX_DEPTH
from tests.test_bad_inputs import CKPT, CONFIG, DATA, assert_one_line, snapshot
from tests.test_bad_inputs_checkpoint import _copy, _edit_index, _hf_copy, _train, ck  # noqa: F401  (the fixture)
from tests.test_bad_inputs_tools import SURROGATES
from tests.test_bad_inputs_writes import demo_tokenizer
from tools import pipeline_timeline, plan, plot_metrics, preprocess_data, train_tokenizer
from tools.export_hf import main as export_main
from tools.generate import main as generate_main
from tools.import_hf import main as import_main

REPO = Path(__file__).resolve().parents[1]
DEEP = 5000  # levels: far past MAX_DEPTH and past Python's recursion limit


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- index.json and its files


def _set(path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(index: dict[str, Any]) -> None:
        node = index
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


INDEX_EDITS = {
    "seq_len as a string": (_set(["model", "seq_len"], "32"), "seq_len='32'"),
    "divisible_by as a string": (_set(["model", "make_vocab_divisible_by"], "64"), "make_vocab_divisible_by='64'"),
    "vocab_size 1e10": (_set(["model", "vocab_size"], 1e10), "vocab_size=10000000000.0"),
    "vocab_size 10^10": (_set(["model", "vocab_size"], 10**10), "vocab_size=10000000000"),
    "consumed_samples 1e30": (_set(["extra", "sampler", "consumed_samples"], 1e30), "consumed_samples"),
    "consumed_samples 10^30": (_set(["extra", "sampler", "consumed_samples"], 10**30), "consumed_samples"),
    "rng file not a name": (_set(["rng_files", "0"], 5), "rng_files"),
    "rng key not a name": (_set(["rng_keys"], [3]), "rng_keys"),
    "deeply nested": (_set(["extra", "deep"], None), f"more than {MAX_DEPTH} levels"),
}


def test_edited_index_fields_are_refused(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    for i, (case, (change, needle)) in enumerate(INDEX_EDITS.items()):
        ckpt = _copy(ck["good"], tmp_path / f"c{i}")
        _edit_index(ckpt / "step_00000001", change)
        if case == "deeply nested":
            text = (ckpt / "step_00000001" / "index.json").read_text()
            (ckpt / "step_00000001" / "index.json").write_text(text.replace('"deep": null', '"deep": '
                                                                            + "[" * DEEP + "]" * DEEP))
        before = snapshot(ckpt)
        got = export_main(["--input", str(ckpt), "--output", str(tmp_path / f"hf{i}"), "--quiet"])
        assert_one_line(_err(capsys), got, CKPT, needle)
        assert snapshot(ckpt) == before and not (tmp_path / f"hf{i}").exists(), case


def test_rng_keys_naming_a_missing_tensor(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    """Read only when a resume restores the RNG streams (same layout): one line, not a SafetensorError."""
    ckpt = _copy(ck["good"], tmp_path / "ck")
    _edit_index(ckpt / "step_00000001", lambda ix: ix["rng_keys"].append("nowhere"))
    before = snapshot(ckpt)
    got, err = _train(ck, tmp_path, capsys, "--checkpoint.dir", str(ckpt), "--train.steps", "2")
    assert_one_line(err, got, CKPT, "rng_keys")
    assert snapshot(ckpt) == before and not (tmp_path / "log").exists()


def _rewrite_rank_file(step: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change a tensor of rank 0's file and record the new sha256, as a careful forger would."""
    path = step / "rank_00000.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    _edit_index(step, lambda ix: ix["files"].update({path.name: files.sha256(path)}))


def test_safetensors_header_contradicting_the_index(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    def reshape(t: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(t) if k.startswith("param/final_norm.weight"))
        t[key] = t[key].reshape(8, -1).contiguous()

    def to_int(t: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(t) if k.startswith("param/final_norm.weight"))
        t[key] = t[key].to(torch.int32)

    for i, (change, needle) in enumerate(((reshape, "index.json says F32 [64]"), (to_int, "is I32"))):
        ckpt = _copy(ck["good"], tmp_path / f"c{i}")
        _rewrite_rank_file(ckpt / "step_00000001", change)
        got = export_main(["--input", str(ckpt), "--output", str(tmp_path / f"hf{i}"), "--quiet"])
        assert_one_line(_err(capsys), got, CKPT, needle)
        assert not (tmp_path / f"hf{i}").exists()


# ----------------------------------------------------------------------------- Hugging Face inputs


HF_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "negative max positions": (lambda c: c.update(max_position_embeddings=-5), "seq_len=-5"),
    "max positions as a string": (lambda c: c.update(max_position_embeddings="32"), "seq_len='32'"),
    "legacy linear rope scaling": (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}),
                                   "rope scaling 'linear' (rope_scaling) is not supported"),
    "rope scaling not an object": (lambda c: c.update(rope_scaling="yarn"), "rope_scaling='yarn'"),
    "llama3 rope without its lengths": (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                                        "rope_original_max_positions = 0 must be >= 1"),
    "yarn rope with factor below 1": (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 0.5,
                                                                       "original_max_position_embeddings": 8}),
                                      "model.rope_factor = 0.5 must be >= 1"),
    "norm eps a string": (lambda c: c.update(rms_norm_eps="1e-5"), "norm_eps='1e-5'"),
}


def test_import_refuses_bad_hf_values(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    for i, (case, (change, needle)) in enumerate(HF_EDITS.items()):
        hf = _hf_copy(ck, tmp_path / f"hf{i}", change)
        got = import_main(["--input", str(hf), "--output", str(tmp_path / f"ck{i}"), "--quiet"])
        assert_one_line(_err(capsys), got, CKPT, needle)
        assert not (tmp_path / f"ck{i}").exists(), case
    hf = _hf_copy(ck, tmp_path / "deep", lambda c: None)
    (hf / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * DEEP + "]" * DEEP + "}")
    got = import_main(["--input", str(hf), "--output", str(tmp_path / "ck_deep"), "--quiet"])
    assert_one_line(_err(capsys), got, CKPT, f"more than {MAX_DEPTH} levels")


def test_import_refuses_integer_weights(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    hf = _copy(ck["hf"], tmp_path / "hf")
    tensors = load_file(str(hf / "model.safetensors"))
    key = next(k for k in sorted(tensors) if tensors[k].dim() == 1)
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(hf / "model.safetensors"))
    got = import_main(["--input", str(hf), "--output", str(tmp_path / "out"), "--quiet"])
    assert_one_line(_err(capsys), got, CKPT, "is I32")
    assert not (tmp_path / "out").exists()
    assert hf_mod.HF_WEIGHT_DTYPES == ("F32", "BF16", "F16")


# ----------------------------------------------------------------------------- generate.py


GENERATE_FLAGS = [(["--top-p", "0"], "--top-p 0.0"), (["--temperature", "-1"], "--temperature -1.0"),
                  (["--temperature", "nan"], "--temperature nan"), (["--temperature", "1e-45"], "--temperature 1e-45"),
                  (["--temperature", "inf"], "--temperature inf"), (["--seed", str(2**64)], f"--seed {2**64}"),
                  (["--max-tokens", "-1"], "--max-tokens -1"), (["--top-k", "x"], "invalid int")]


def test_generate_flags_are_named(ck: dict[str, Any], capsys) -> None:
    base = ["--checkpoint", str(ck["good"]), "--prompt", "def", "--device", "cpu"]
    for flags, needle in GENERATE_FLAGS:
        got = generate_main(base + flags)
        err = _err(capsys)
        assert_one_line(err, got, CONFIG, needle)
        assert "SamplingConfig" not in err
    got = generate_main(["--checkpoint", str(ck["good"]), "--prompt", "de\udcff", "--device", "cpu"])
    assert_one_line(_err(capsys), got, CONFIG, "--prompt is not UTF-8")


def test_generate_into_a_closed_pipe(ck: dict[str, Any]) -> None:
    """`generate.py ... | head -c 1`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "tools/generate.py", "--checkpoint", str(ck["good"]), "--prompt", "def",
                             "--max-tokens", "25", "--ignore-eod", "--device", "cpu"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err


# ----------------------------------------------------------------------------- the run's own config


def test_config_text_and_late_fields_fail_before_anything_is_written(ck: dict[str, Any], tmp_path: Path,
                                                                     capsys) -> None:
    nul = tmp_path / "nul.toml"
    nul.write_text('[logging]\nsample_prompt = "a\\u0000b"\n')
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * DEEP + "]" * DEEP + "\n")
    cases = [(("--logging.sample_interval", "1", "--logging.sample_tokens", "-1"), "logging.sample_tokens"),
             (("--logging.dir", str(tmp_path / "log\udcffx")), "logging.dir is not UTF-8"),
             (("--checkpoint.dir", str(tmp_path / "ck\udcffx")), "checkpoint.dir is not UTF-8"),
             (("--logging.sample_prompt", "caf\udce9"), "logging.sample_prompt is not UTF-8"),
             (("--config", str(nul)), "NUL byte"),
             (("--config", str(deep)), f"more than {MAX_DEPTH} levels"),
             (("--train.seed", str(2**64)), "train.seed must be < 2^64"),
             (("--logging.sample_interval", "1", "--logging.sample_prompt", "def f(x): return x " * 20),
              "logging.sample_prompt is")]
    before = snapshot(tmp_path)
    for extra, needle in cases:
        got, err = _train(ck, tmp_path, capsys, *extra)
        assert_one_line(err, got, CONFIG, needle)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["deep.toml", "nul.toml"]


# ----------------------------------------------------------------------------- the other tools


def test_plot_metrics_checks_record_types_and_format(tmp_path: Path, capsys) -> None:
    good = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "comm_bytes": {"dp": 5}}
    records = [("step as a string", dict(good, step="3"), "step is '3'"),
               ("null step", dict(good, step=None), "step is None"),
               ("comm_bytes a list", dict(good, comm_bytes=[1, 2]), "comm_bytes is list"),
               ("loss a string", dict(good, loss="low"), "loss is str"),
               ("deep", None, f"more than {MAX_DEPTH} levels")]
    for i, (case, record, needle) in enumerate(records):
        path = tmp_path / f"m{i}.jsonl"
        line = json.dumps(record) if record is not None else '{"step": 1, "x": ' + "[" * DEEP + "]" * DEEP + "}"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        got = plot_metrics.main([str(path), "-o", str(tmp_path / "p.png")])
        assert_one_line(_err(capsys), got, DATA, needle)
    got = plot_metrics.main([str(tmp_path / "m0.jsonl"), "-o", str(tmp_path / "out.xyz")])
    assert_one_line(_err(capsys), got, CONFIG, ".png")
    assert not list(tmp_path.glob("p.png")) and not list(tmp_path.glob("out.xyz"))


def test_plan_with_a_batch_smaller_than_the_pipeline(capsys) -> None:
    got = plan.main(["--preset", "llama-7b", "--global-batch-size", "2", "--nodes", "4"])
    assert_one_line(_err(capsys), got, CONFIG, "global batch 2 is too small for 32 GPUs")


def test_bounds_name_the_bound(tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("x")
    got = preprocess_data.main(["--input", str(text), "--tokenizer", "t", "--output-prefix", str(tmp_path / "o"),
                                "--workers", "1000"])
    assert_one_line(_err(capsys), got, CONFIG, f"between 1 and {preprocess_data.max_workers()}")
    got = train_tokenizer.main(["--input", str(text), "--kind", "hf", "--model-prefix", str(tmp_path / "t"),
                                "--vocab-size", str(10**9)])
    assert_one_line(_err(capsys), got, CONFIG, f"above {train_tokenizer.MAX_VOCAB}")
    got = pipeline_timeline.main(["--pp", "1000", "--micro-batches", "1000"])
    assert_one_line(_err(capsys), got, CONFIG, "--pp 1000 must be at most 32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_ctrl_c_in_the_tools_is_one_line_and_130(ck: dict[str, Any], tmp_path: Path, capsys, monkeypatch) -> None:
    """KeyboardInterrupt mid-output: exit 130, one line; the tool's own cleanup ran (nothing partial left)."""
    out = tmp_path / "hf"
    assert export_main(["--input", str(ck["good"]), "--output", str(out), "--quiet"]) == 0
    _err(capsys)
    before = snapshot(tmp_path)

    def interrupt(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_mod.StreamingWriter, "write", interrupt)
    got = export_main(["--input", str(ck["good"]), "--output", str(out), "--quiet"])
    assert_one_line(_err(capsys), got, INTERRUPTED_EXIT, "interrupted (Ctrl-C)")
    from megalite.data import indexed

    monkeypatch.setattr(indexed.IndexedDatasetWriter, "add_document", interrupt)
    text = tmp_path / "t.txt"
    text.write_text("def f():\n    return 1\n")
    got = preprocess_data.main(["--input", str(text), "--tokenizer", demo_tokenizer(ck), "--output-prefix",
                                str(tmp_path / "p"), "--quiet"])
    assert_one_line(_err(capsys), got, INTERRUPTED_EXIT, "interrupted (Ctrl-C)")
    text.unlink()
    assert snapshot(tmp_path) == before


def test_replaced_surrogates_are_counted(ck: dict[str, Any], tmp_path: Path, capsys) -> None:
    lines = [json.dumps({"text": SURROGATES + f"document {i}"}) for i in range(3)] + [json.dumps({"text": "clean"})]
    src = tmp_path / "s.jsonl"
    src.write_text("\n".join(lines) + "\n")
    got = preprocess_data.main(["--input", str(src), "--json-key", "text", "--tokenizer", demo_tokenizer(ck),
                                "--output-prefix", str(tmp_path / "s"), "--quiet"])
    err = _err(capsys)
    assert got == 0, err
    assert "replaced 6 unpaired surrogate escape(s)" in err and "in 3 document(s)" in err


def test_ctrl_c_during_parallel_preprocessing(ck: dict[str, Any], tmp_path: Path) -> None:
    """A real SIGINT to `preprocess_data.py --workers 2` while it writes: one line, exit 130, no temporary
    file; the workers leave the interrupt to the parent (no traceback from each of them)."""
    big = tmp_path / "big.txt"
    big.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(60000)))
    proc = subprocess.Popen([sys.executable, "tools/preprocess_data.py", "--input", str(big), "--split-paragraphs",
                             "--tokenizer", demo_tokenizer(ck), "--output-prefix", str(tmp_path / "out"),
                             "--workers", "2", "--quiet"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not list(tmp_path.glob("out.bin.tmp-*")):
        time.sleep(0.05)  # until the output is being written (the work itself takes far longer)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert_one_line(err, proc.wait(), INTERRUPTED_EXIT, "interrupted (Ctrl-C)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]


def test_sigint_to_another_thread_is_held_until_the_pool_is_up() -> None:
    """The race behind the test above, made certain: with SIGINT blocked in the main thread the kernel gives
    it to another thread, and Python still runs the handler in the main thread. The guarded block must finish
    and the interrupt come after it (the mask alone let it through mid-spawn)."""
    import os
    import threading

    from megalite.data.preprocess import _sigint_deferred

    go, sent = threading.Event(), threading.Event()

    def send() -> None:  # started before the mask, so this thread does not block SIGINT
        go.wait()
        os.kill(os.getpid(), signal.SIGINT)
        sent.set()

    sender = threading.Thread(target=send)
    sender.start()
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with _sigint_deferred():
            go.set()
            sent.wait()
            time.sleep(0.05)  # bytecode boundaries where the old code raised KeyboardInterrupt
            finished = True
    sender.join()
    assert finished
