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

from megalite.context.options import ContextOptions
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


CASES = [  # world, tp, cp, pp, sp, zero, arch, cp_mode
    (2, 2, 1, 1, True, 0, "llama", "ring"),   # tp + sp
    (2, 1, 1, 2, False, 0, "gpt2", "ring"),   # pp: every stage reads the ids for the mask; learned positions restart
    (2, 1, 1, 1, False, 1, "llama", "ring"),  # dp with ZeRO-1
    (4, 1, 4, 1, False, 0, "llama", "ring"),  # the ring skips the block pairs no query of which sees a key
    (4, 2, 2, 1, True, 0, "llama", "allgather"),
    (4, 1, 2, 2, False, 0, "gpt2", "a2a"),
]


@pytest.mark.parametrize("world,tp,cp,pp,sp,zero,arch,mode", CASES)
def test_document_mask_trains_like_single_process(dist_world, world: int, tp: int, cp: int, pp: int, sp: bool,
                                                  zero: int, arch: str, mode: str) -> None:
    dist_world(world).run(_check_cp_training, tp, cp, pp, sp, zero, arch, "none", "1f1b", mode, EOD)


def _ring_skip_rank_fn(rank: int) -> tuple[int, int, int]:
    """cp = 4, documents of exactly one zigzag chunk each (an EOD ends every chunk): the ring computes only
    each rank's own diagonal blocks and skips every other pair, forward and backward (block calls counted by
    spies: 1 of 4 pairs each way, so 1/4 of the ring's attention FLOPs), its output and gradients equal masked
    attention over the unsplit sequence, and the bytes are the ring's as ever: the K/V (and the dK/dV
    accumulators) still travel the whole ring, the next rank may need them, so no transfer is saved."""
    from megalite.context import ring
    from megalite.context.costs import ring_attention_bytes
    from megalite.context.ring import ring_attention
    from megalite.context.zigzag import zigzag_split
    from megalite.context.documents import DocumentIds, document_causal_mask
    from megalite.model.ops import masked_attention
    from tests.parallel_utils import layout
    from tests.test_context_parallel import TOL as ATTN_TOL, _problem

    st = layout(1, cp=4)
    seq, cp = 16, 4
    tokens = torch.arange(1, seq + 1).repeat(2, 1)
    tokens[:, seq // (2 * cp) - 1::seq // (2 * cp)] = EOD          # chunk c = document c
    full = documents(tokens, EOD)
    docs = DocumentIds(zigzag_split(full.ids, cp, st.cp_rank), full.ids)
    q, k, v, d_out = _problem(9, 2, seq, 4, 2, 8)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = masked_attention(*ref, document_causal_mask(full.ids, full.ids))
    ref_out.backward(d_out)
    local = [zigzag_split(t, cp, st.cp_rank).float().requires_grad_() for t in (q, k, v)]
    calls, compute, compute_bwd = [0, 0], ring.block_forward, ring.block_backward

    def spy(*args, **kwargs):
        calls[0] += 1
        return compute(*args, **kwargs)

    def spy_bwd(*args, **kwargs):
        calls[1] += 1
        return compute_bwd(*args, **kwargs)

    ring.block_forward, ring.block_backward = spy, spy_bwd
    try:
        out = ring_attention(*local, st, docs=docs)
        out.backward(zigzag_split(d_out, cp, st.cp_rank).float())
    finally:
        ring.block_forward, ring.block_backward = compute, compute_bwd
    for got, want in zip([out.detach()] + [t.grad for t in local], [ref_out.detach()] + [t.grad for t in ref]):
        torch.testing.assert_close(got, zigzag_split(want, cp, st.cp_rank).float(), **ATTN_TOL)
    assert st.counter.exact_bytes("cp") == ring_attention_bytes(2, seq, 2, 8, cp, 4).total  # same bytes
    return calls[0], calls[1], cp


def test_ring_skips_fully_masked_block_pairs(dist_world) -> None:
    # Chunk c = document c: of each rank's 9 causal chunk pairs only its 2 diagonal ones hold a visible pair, each
    # computed as its own block (megalite/context/ring.py `plan_step`), once each way; the 3 other steps compute nothing.
    assert dist_world(4).run(_ring_skip_rank_fn) == [(2, 2, 4)] * 4


def test_pretrain_masks_the_documents_of_its_data(demo_cache_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """pretrain.py hands data.document_mask the EOD id of its own tokenizer: on a corpus of short documents
    (several per 64-token sample, tokenized by tools/preprocess_data.py) the masked run's first loss is not the
    unmasked one's. The demo corpus's documents are whole stdlib modules, thousands of tokens, so a few steps
    of it hold no EOD and a mask there is inert (masked = unmasked bit for bit): a check of the mask through
    pretrain.py needs data like this."""
    import json

    from megalite.data.demo import prepare_demo_data
    from pretrain import main
    from tests.test_pretrain import _args, _losses
    from tools.preprocess_data import main as preprocess

    _, tokenizer = prepare_demo_data(demo_cache_dir, 300000, 512)
    text = (tmp_path / "corpus.jsonl")
    source = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(400))
    text.write_text("".join(json.dumps({"text": source[i:i + 60]}) + "\n" for i in range(0, len(source), 60)))
    assert preprocess(["--input", str(text), "--json-key", "text", "--tokenizer", tokenizer, "--output-prefix",
                       str(tmp_path / "short"), "--workers", "1", "--quiet"]) == 0
    data = ("--data.path", str(tmp_path / "short"), "--data.tokenizer", tokenizer, "--model.seq_len", "64",
            "--train.steps", "1")
    losses = {}
    for mask in ("true", "false"):
        assert main(_args(demo_cache_dir, tmp_path / mask, *data, "--data.document_mask", mask)) == 0
        losses[mask] = _losses(tmp_path / mask)[1]
    assert abs(losses["true"] - losses["false"]) > 1e-3, losses
