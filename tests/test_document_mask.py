"""Document masking (`data.document_mask`, megalite/context/documents.py): packed samples attend only within
their documents and positions restart at each one. A masked packed run equals running each document alone
(per-token losses and every gradient), and the masked model trains like one process at tp + sp, pp and dp
(tests/test_cp_training.py's parity check: losses, gradient norms, every parameter after 3 AdamW steps).

Tolerances: the packed and the separate runs compute the same dot products in another batching order (fp32):
1e-5 absolute on O(1) losses and on gradients of order 1e-2..1, observed ~1e-7; a document seeing its
neighbour or a position not restarted moves the losses by O(0.01-0.1) (checked by turning the mask off).
"""

from __future__ import annotations

import pytest
import torch

from megalite.context import ContextOptions
from megalite.context.documents import documents
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg
from tests.test_cp_training import _check_cp_training

EOD = 0
TOL = 1e-5


def test_documents_split_at_eod_tokens() -> None:
    d = documents(torch.tensor([[5, 1, EOD, 7, 8, EOD, EOD, 3], [EOD, 2, 3, 4, 5, 6, 7, 8]]), EOD)
    assert d.ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert d.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def _losses_and_grads(model: GPT, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(ids, labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("gpt2", "selective"), ("llama", "full")])
def test_masked_packed_run_equals_each_document_alone(arch: str, recompute: str) -> None:
    """Three documents (lengths 5, 7, 4, each closed by its EOD) packed into one 16-token sample: the masked
    model's per-token losses are each document's own run, and the gradient of the summed loss is the sum of
    the documents' gradients. RoPE (llama) and learned positions (gpt2) both restart."""
    cfg = tiny_model_cfg(arch, seq_len=16, recompute=recompute)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(1, cfg.vocab_size, (n - 1,), generator=gen), torch.tensor([EOD])])
            for n in (5, 7, 4)]
    packed = torch.cat(docs + [torch.randint(1, cfg.vocab_size, (1,), generator=gen)])  # + the next sample's first
    masked = GPT(cfg, ParallelState(), seed=5, context=ContextOptions(document_eod=EOD))
    got, got_grads = _losses_and_grads(masked, packed[None, :-1], packed[None, 1:])
    plain = GPT(cfg, ParallelState(), seed=5)
    want, want_grads, start = [], {}, 0
    for doc in docs:  # each document alone, its last label the token after its EOD (the next document's first)
        n = len(doc)
        loss, grads = _losses_and_grads(plain, packed[None, start:start + n], packed[None, start + 1:start + n + 1])
        want.append(loss[0])
        for name, g in grads.items():
            want_grads[name] = want_grads.get(name, 0) + g
        start += n
    torch.testing.assert_close(got[0], torch.cat(want), atol=TOL, rtol=0)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")
    unmasked, _ = _losses_and_grads(plain, packed[None, :-1], packed[None, 1:])
    assert (unmasked[0] - got[0]).abs().max() > 1e-3  # the mask matters: the test can fail


CASES = [  # world, tp, pp, sp, zero, arch
    (2, 2, 1, True, 0, "llama"),   # tp + sp
    (2, 1, 2, False, 0, "gpt2"),   # pp: every stage reads the ids for the mask; learned positions restart
    (2, 1, 1, False, 1, "llama"),  # dp with ZeRO-1
]


@pytest.mark.parametrize("world,tp,pp,sp,zero,arch", CASES)
def test_document_mask_trains_like_single_process(dist_world, world: int, tp: int, pp: int, sp: bool, zero: int,
                                                  arch: str) -> None:
    dist_world(world).run(_check_cp_training, tp, 1, pp, sp, zero, arch, "none", "1f1b", "ring", EOD)


def test_validation_refuses_document_mask_with_cp() -> None:
    from tests.test_cp_training import problems

    msg = problems(2, "--parallel.cp", "2", "--model.seq_len", "32", "--data.document_mask", "true")
    assert "data.document_mask is not supported with parallel.cp > 1 yet" in msg and msg.count("\n") == 0
    assert problems(2, "--data.document_mask", "true") == ""
