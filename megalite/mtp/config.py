"""The `[mtp]` config section (multi-token prediction, docs/mtp.md) and its checks, which config validation calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MTPConfig:
    num_layers: int = field(default=0, metadata={"doc": "multi-token prediction depth D: extra modules, module k "
                                                        "predicting the token k+1 ahead (DeepSeek-V3); 0 = off"})
    loss_weight: float = field(default=0.3, metadata={"doc": "lambda: the mean of the D depths' losses times this "
                                                             "is added to the training loss"})


def mtp_problems(mtp: MTPConfig, model: Any, parallel: Any) -> list[str]:
    """One line per bad `[mtp]` value or unsupported combination (empty when MTP is off); `model` and `parallel`
    are the config's sections."""
    out: list[str] = []
    if mtp.num_layers < 0:
        out.append(f"mtp.num_layers must be >= 0 (0 = off), got {mtp.num_layers}")
    if not mtp.loss_weight >= 0:
        out.append(f"mtp.loss_weight must be >= 0, got {mtp.loss_weight}")
    if mtp.num_layers <= 0:
        return out
    if mtp.num_layers >= model.seq_len:
        out.append(f"mtp.num_layers {mtp.num_layers} must be below model.seq_len {model.seq_len}: depth k predicts "
                   "the token k+1 ahead")
    if model.arch != "llama":
        out.append(f"mtp.num_layers > 0 needs model.arch=llama (RoPE): the MTP modules embed the shifted tokens "
                   f"without learned positions; got arch={model.arch}")
    if parallel.zero == 3 and parallel.pp > 1 and not model.tie_embeddings:  # tied: zero3_problems says it
        out.append("mtp.num_layers > 0 with parallel.zero=3 and pp > 1 is not supported yet: the last stage holds a "
                   "copy of the embedding, which ZeRO-3 cannot gather apart from the first stage's; use "
                   "parallel.zero<=2 or pp=1")
    if parallel.schedule == "zbv" and parallel.pp > 1:  # as for tied embeddings (config.validate)
        out.append("mtp.num_layers > 0 with parallel.schedule=zbv is not supported yet: zbv puts the first and the "
                   "last stage on one rank, whose two copies of the embedding the 'embedding' group cannot sum; use "
                   "zb-h1 or 1f1b")
    return out
