"""Converted checkpoints run on live ranks, for tests/test_interop_megatron.py: a top-level function that a
`DistWorld` of 4 gloo ranks runs (kept out of the test module so the workers do not import megatron-core).

Each rank builds only its own pipeline stage at tp 2 x pp 2 (its half of the layers, its TP shards), loads the
converted checkpoint with `load_sharded` (each rank reads only its slices), and the first stage sends its
hidden states to the last, which gathers its vocab shards: the logits of the live layout, which the test
compares with megatron-core's forward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.checkpoint.sharded import load_sharded, read_index
from megalite.inference.load import model_config_from_info
from megalite.model.gpt import GPT
from megalite.parallel import comm
from tests.parallel_utils import layout


def live_logits_tp2_pp2(rank: int, checkpoints: list[str], ids: torch.Tensor) -> list[torch.Tensor | None]:
    """The logits [b, s, padded vocab] of each checkpoint at tp 2 x pp 2 (on the last stage's tp rank 0)."""
    st = layout(2, 2)
    out: list[torch.Tensor | None] = []
    for path in checkpoints:
        cfg = model_config_from_info(read_index(path)["model"])
        half = cfg.num_layers // 2
        first = st.is_first_stage
        model = GPT(cfg, st, seed=0, layers=range(st.pp_rank * half, (st.pp_rank + 1) * half),
                    pre_process=first, post_process=not first).eval()
        load_sharded(path, model, None, st)
        with torch.no_grad():
            if first:
                assert st.next_rank is not None
                dist.send(model(ids).contiguous(), st.next_rank)
                out.append(None)
                continue
            hidden = torch.empty(*ids.shape, cfg.hidden_size)
            assert st.prev_rank is not None
            dist.recv(hidden, st.prev_rank)
            logits = comm.all_gather(model(None, hidden=hidden), st, "tp", dim=2)
        out.append(logits if st.tp_rank == 0 else None)
    return out
