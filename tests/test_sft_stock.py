"""SFT runs on a stock template (no `{% generation %}` marks) exactly as on its hand-marked version, and never
trains on nothing: a conversation without an assistant token is a counted bad record (the limits stop the
run with exit 3 and the count by kind), and a template that runs past its bounds stops the run in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megalite.training.trainer import main as pretrain_main
from tests.conftest import SMALL_RUN
from tests.test_sft import CHATS, TEMPLATE

# The demo recipe's template without its marks (trim_blocks drops the newline after `{% endgeneration %}`).
STOCK = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}\n", "")


def _sft(tmp_path: Path, cache: str, name: str, template: str, chats: list[list[dict[str, str]]],
         *extra: str) -> int:
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    (tmp_path / f"{name}.jinja").write_text(template)
    return pretrain_main([*SMALL_RUN, "--data.cache_dir", cache, "--train.steps", "2", "--data.workers", "0",
                          "--data.path", str(tmp_path / f"{name}.jsonl"), "--data.format", "chat",
                          "--data.chat_template", str(tmp_path / f"{name}.jinja"), "--data.valid_fraction", "0",
                          "--logging.dir", str(tmp_path / name), *extra])


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The run's one error line (stderr may also hold the demo corpus's progress note before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("megalite: error:")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_sft_on_a_stock_template_equals_sft_on_the_marked_one(tmp_path: Path, demo_cache_dir: str) -> None:
    assert _sft(tmp_path, demo_cache_dir, "stock", STOCK, CHATS) == 0
    assert _sft(tmp_path, demo_cache_dir, "marked", TEMPLATE, CHATS) == 0
    stock, marked = _losses(tmp_path / "stock"), _losses(tmp_path / "marked")
    assert len(stock) == 2 and all(math.isfinite(x) and x > 0 for x in stock)
    assert stock == marked  # the same tokens and the same mask: the same run, bit for bit


def test_a_conversation_without_an_assistant_token_is_a_bad_record(tmp_path: Path, demo_cache_dir: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    chats = [*CHATS[:3], [{"role": "user", "content": "no answer"}], *CHATS[3:]]
    assert _sft(tmp_path, demo_cache_dir, "limit", STOCK, chats, "--data.max_bad_records", "0") == 3
    err = _error_line(capsys)
    assert "no_assistant 1" in err and "max_bad_records = 0" in err, err


def test_a_template_past_its_bounds_stops_the_run_in_one_line(tmp_path: Path, demo_cache_dir: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Refused on the probes, before any model is built (each bound itself: tests/test_chat_bounds.py).
    assert _sft(tmp_path, demo_cache_dir, "bounds", "{{ 'x' * (16 * 1024 ** 3) }}", CHATS) == 3
    assert "--data.chat_template" in _error_line(capsys)


def test_a_conversation_past_the_bounds_stops_the_run_from_a_worker(tmp_path: Path, demo_cache_dir: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # The probes pass; one long record makes the template build 16 GiB, in a tokenizer worker process: the
    # run stops with the template's one line and exit 3, not a worker's traceback.
    template = "{% for m in messages %}{% if m['content']|length > 100 %}{{ 'x' * 2 ** 34 }}{% endif %}{% endfor %}"
    chats = [*CHATS, [{"role": "user", "content": "y" * 200}, {"role": "assistant", "content": "z"}]]
    assert _sft(tmp_path, demo_cache_dir, "worker", STOCK + template, chats, "--data.workers", "1") == 3
    assert "over 67,108,864 characters" in _error_line(capsys)
