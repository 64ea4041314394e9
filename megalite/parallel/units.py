"""What a model is made of: the units (a GPT stage's transformer blocks) the machinery around it treats
one at a time.

A model names them once, through `MadeOfUnits.units()` (a Protocol it satisfies structurally, as it
declares its parameters' `ParamSpec`s); each user asks under its own meaning: ZeRO-3 gathers a unit's
parameters just before it runs and frees them after (`megalite.dp.zero3.stage3_units`), Muon takes the
hidden matrices inside the units (`megalite.optim.muon_plan.block_params`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch.nn as nn


@runtime_checkable
class MadeOfUnits(Protocol):
    """A model (one pipeline chunk) built of repeated units, in forward order; whatever else it holds
    (embedding, final norm, head) lies outside them."""

    def units(self) -> list[nn.Module]: ...
