"""Samples during training (`logging.sample_interval`): every N steps, a short greedy continuation of
`logging.sample_prompt`, so a user sees the model learn to write.

Each sample goes to stdout, to metrics.jsonl as its own row `{"step", "sample_prompt", "sample"}` (rows
without a "loss": readers that want losses skip them, as tools/plot_metrics.py does) and to wandb as a
table (step, prompt, text) that grows with the run. Generation is greedy and runs in eval mode, then the
model returns to training mode: no random stream is drawn from, so the losses of a run are the same
with and without samples (tested). An empty prompt starts a new document (after the EOD token, or at
BOS for tokenizers that begin documents with one).

Samples are taken on runs with pp=1 and no sequence parallelism: any tp (the ranks of the first dp
replica's tp group decode together, see megalite/inference/generate.py), any dp, any ZeRO stage (ZeRO-3
gathers the parameters for the sample on every rank, since the gather is collective). Pipeline-parallel
and SP runs log one note and no samples.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from megalite.data.tokenizer import Tokenizer
from megalite.inference.generate import SamplingConfig, generate_ids
from megalite.model.gpt import GPT
from megalite.observability.metrics import append_record
from megalite.parallel.state import ParallelState


class _Logger(Protocol):
    enabled: bool
    path: Any

    def note(self, message: str) -> None: ...


class _Tracker(Protocol):
    @property
    def enabled(self) -> bool: ...

    def log(self, metrics: dict, step: int) -> None: ...


def sample_prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a sample continues: the prompt (with BOS where the tokenizer adds one), or an EOD."""
    ids = tok.encode(prompt)
    if tok.add_bos and tok.bos_id is not None:
        return [tok.bos_id] + ids
    return ids or [tok.eod_id]  # nothing to continue: start a new document, as after an EOD in the data


class TrainingSamples:
    def __init__(self, logging_cfg: Any, tokenizer: Tokenizer, chunks: list[torch.nn.Module], state: ParallelState,
                 dtype: torch.dtype, logger: _Logger, tracker: _Tracker) -> None:
        self.interval = int(logging_cfg.sample_interval)
        self.prompt = str(logging_cfg.sample_prompt)
        self.max_tokens = int(logging_cfg.sample_tokens)
        self.tokenizer, self.state, self.dtype, self.logger, self.tracker = tokenizer, state, dtype, logger, tracker
        self.model = cast(GPT, chunks[0]) if len(chunks) == 1 else None
        self.rows: list[list[Any]] = []
        if self.interval > 0 and (state.pp > 1 or state.sp or state.cp > 1 or self.model is None):
            logger.note(f"logging.sample_interval={self.interval}: samples need pp=1, cp=1 and no sequence "
                        f"parallelism (this run has pp={state.pp} cp={state.cp} sp={state.sp}): no samples will be "
                        "logged")
            self.interval = 0

    def prompt_ids(self) -> list[int]:
        return sample_prompt_ids(self.tokenizer, self.prompt)

    def maybe_sample(self, step: int, optimizer: Any) -> str | None:
        """Every rank calls this after each step; on sample steps rank 0 generates and logs. Returns the text."""
        if self.interval <= 0 or step % self.interval or self.model is None:
            return None
        text = None
        with optimizer.gathered():  # ZeRO-3: collective on every dp rank; a no-op otherwise
            if self.state.dp_rank == 0:  # rank 0's tp group decodes (tp collectives); rank 0 logs
                sampling = SamplingConfig(self.max_tokens, stop_ids=(self.tokenizer.eod_id,))
                ids = list(generate_ids(self.model, self.prompt_ids(), sampling, dtype=self.dtype))
                text = self.tokenizer.decode(ids)
        if text is not None and self.logger.enabled:
            self._log(step, text)
        return text

    def _log(self, step: int, text: str) -> None:
        self.logger.note(f"sample at step {step}: {self.prompt!r} -> {text!r}")
        append_record(self.logger.path, {"step": step, "sample_prompt": self.prompt, "sample": text})
        self.rows.append([step, self.prompt, text])
        if self.tracker.enabled:
            try:
                import wandb

                # A wandb table is immutable once logged: log the grown table each time (the latest has all rows).
                self.tracker.log({"samples": wandb.Table(columns=["step", "prompt", "text"], data=self.rows)}, step)
            except Exception as exc:  # wandb trouble never stops training; metrics.jsonl has the sample
                self.logger.note(f"megalite: warning: could not log the sample to wandb ({exc})")
