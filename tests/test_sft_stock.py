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
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no_assistant 1" in err and "max_bad_records = 0" in err, err


@pytest.mark.parametrize("template", ["{{ 'x' * (16 * 1024 ** 3) }}",
                                      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                      "{% endfor %}"])
def test_a_template_past_its_bounds_stops_the_run_in_one_line(tmp_path: Path, demo_cache_dir: str, template: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _sft(tmp_path, demo_cache_dir, "bounds", template, CHATS) == 3
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--data.chat_template" in err, err
