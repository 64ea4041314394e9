"""Document masking (`data.document_mask`): packed samples attend only within their own documents, and
positions restart at each document (Llama 3, Dubey et al. 2024 section 3.2; Megatron-LM's
--reset-attention-mask --reset-position-ids).

The boundaries are the EOD tokens already in the data (every document ends with one, megalite/data): an EOD
belongs to the document it closes, the token after it starts the next. Token j's document is the number of
EODs before it; its position is j minus the index of its document's first token. The loss is unchanged in
meaning: every token still predicts the next one (the EOD predicts the next document's first token from its
own document alone, as in Megatron without --eod-mask-loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Documents:
    """Per token of a [B, S] batch of packed samples: its document index and its position in the document."""

    ids: Tensor        # [B, S] int64, non-decreasing along S
    positions: Tensor  # [B, S] int64, 0 at each document's first token


def documents(tokens: Tensor, eod: int) -> Documents:
    """The documents of `tokens` [B, S] (whole sequences, in position order) split at the `eod` tokens."""
    is_eod = (tokens == eod).long()
    ids = is_eod.cumsum(dim=1) - is_eod                                   # EODs strictly before each token
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens)
    starts[:, 1:] = torch.where(is_eod[:, :-1].bool(), index[:, 1:], 0)   # a token after an EOD starts a document
    return Documents(ids, index - starts.cummax(dim=1).values)


def document_mask(query_docs: Tensor, key_docs: Tensor, causal: bool) -> Tensor:
    """[B, sq, sk] bool, True where query i may see key j: the same document, and j <= i when `causal` (for
    queries and keys of the same positions in order; the cp forms whose blocks are not add their own
    causal part). The one rule every attention path masks documents by."""
    keep = query_docs[:, :, None] == key_docs[:, None, :]
    if causal:
        keep &= torch.ones(keep.shape[-2:], dtype=torch.bool, device=keep.device).tril_()
    return keep


def document_causal_mask(query_docs: Tensor, key_docs: Tensor, causal: bool = True) -> Tensor:
    """`document_mask` as masked SDPA takes it: [B, 1, Sq, Sk], one mask for every head."""
    return document_mask(query_docs, key_docs, causal)[:, None]


@dataclass(frozen=True)
class DocumentIds:
    """What attention needs of the documents: `local` [B, s] for this rank's tokens (its zigzag split under
    context parallelism, else every token), `full` [B, S] for the whole sequence in position order."""

    local: Tensor
    full: Tensor
