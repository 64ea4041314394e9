"""The block math context parallelism computes with: a block of queries against a block of keys, its (O, LSE),
the merge and the backward from the merged statistics. It lives in megalite/attention/blocks.py (one layer down:
the one-rank variant paths use it too); these are its names as context/ and the model's ops know them."""

from megalite.attention.blocks import (CAUSAL, Backend, Mask, PositionMask, Scores, add_sinks, block_backward,
                                       block_forward, from_grouped, merge_into, sink_grad, to_grouped)

__all__ = ["CAUSAL", "Backend", "Mask", "PositionMask", "Scores", "add_sinks", "block_backward", "block_forward",
           "from_grouped", "merge_into", "sink_grad", "to_grouped"]
