"""RoPE tables for layers whose RoPE differs from the model's (megalite/model/pattern.py): another base (Gemma 3's
local layers) or fewer rotated dims (partial RoPE). One pair of tables per distinct (base, dims), shared by the
layers that use it; the model's own tables (`GPT.cos` / `GPT.sin`) stay the default's."""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.model.rope import RopeScaling, rope_tables

RopeKey = tuple[float, int]  # (base, rotated dims of each head)


class LayerRope(nn.Module):
    """Tables [seq_len, dims/2] per key, indexed at this rank's `positions` (context parallelism) and kept whole
    (`full`) for document masking, which takes each token's position within its document."""

    def __init__(self, keys: list[RopeKey], seq_len: int, scaling: RopeScaling, positions: torch.Tensor | None,
                 full: bool) -> None:
        super().__init__()
        self.keys, self.full = list(keys), full
        for j, (theta, dim) in enumerate(self.keys):
            cos, sin = rope_tables(seq_len, dim, theta, scaling)
            if full:
                self.register_buffer(f"cos_full_{j}", cos, persistent=False)
                self.register_buffer(f"sin_full_{j}", sin, persistent=False)
            if positions is not None:
                cos, sin = cos[positions], sin[positions]
            self.register_buffer(f"cos_{j}", cos, persistent=False)
            self.register_buffer(f"sin_{j}", sin, persistent=False)

    def tables(self, doc_positions: torch.Tensor | None) -> dict[RopeKey, tuple[torch.Tensor, torch.Tensor]]:
        """Each key's (cos, sin) for this forward: per sequence at `doc_positions` [B, S] under document masking."""
        out = {}
        for j, key in enumerate(self.keys):
            if doc_positions is None:
                out[key] = (self.get_buffer(f"cos_{j}"), self.get_buffer(f"sin_{j}"))
            else:
                out[key] = (self.get_buffer(f"cos_full_{j}")[doc_positions],
                            self.get_buffer(f"sin_full_{j}")[doc_positions])
        return out

    def whole(self, key: RopeKey) -> tuple[torch.Tensor, torch.Tensor]:
        """Key's tables at every position 0..seq_len-1 (the KV-cached decoder, cp = 1)."""
        j = self.keys.index(key)
        return self.get_buffer(f"cos_{j}"), self.get_buffer(f"sin_{j}")
