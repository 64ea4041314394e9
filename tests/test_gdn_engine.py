"""The gated delta-rule engine: its recurrent reference against transformers' Qwen3.5 torch fallbacks, and the
chunked torch form and the Triton chunk kernel against the reference (forward, final state, and the gradients of
q, k, v, g, beta and the initial state: torch autograd through the reference is the oracle), for each gate, with
packed documents.

Tolerances: the chunked form against the reference runs in fp64 (1e-10: any wrong mask, decay or sign is O(0.1));
transformers and the Triton kernel compute in fp32 (1e-5 on O(1) values: the same sums in another order).
"""

from __future__ import annotations

import pytest
import torch

from megalite.kernels.testing import use_interpreter
from megalite.recurrent.engine import gated_delta
from megalite.recurrent.recurrence import GATED_DELTANET, KIMI_DELTA, MAMBA2_SSD, Gate, RuleInputs

Tensor = torch.Tensor
B, T, HK, H, K, V = 2, 37, 2, 4, 8, 6
# Row 0: documents of 5, 20 and 12 tokens; row 1: 30 then 7 (chunks of 16: boundaries inside and across chunks).
DOCS = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12, [0] * 30 + [1] * 7])


def _inputs(gate: Gate, dtype: torch.dtype, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = (torch.nn.functional.normalize(rand(B, T, HK, K), dim=-1) for _ in range(2))
    g_shape = (B, T, H, K) if gate.per_channel_decay else (B, T, H)
    g = -torch.rand(*g_shape, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return [q, k, rand(B, T, H, V), g, beta, rand(B, H, K, V)]


def _forms(inputs: list[Tensor], gate: Gate, backend: str, docs: Tensor | None, chunk: int = 16,
           state_grad: bool = True) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o, final state, gradients of q, k, v, g, beta, initial state) under a random upstream gradient (of the
    output only unless `state_grad`)."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    o, state = gated_delta(RuleInputs(*xs[:5]), doc_ids=docs, scale=K ** -0.5, initial_state=xs[5],
                           erase=gate.erase, backend=backend, chunk_size=chunk)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(9)
    d_o, d_state = (torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in (o, state))
    torch.autograd.backward((o, state) if state_grad else (o,), (d_o, d_state) if state_grad else (d_o,))
    return o.detach(), state.detach(), [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def _close(a: Tensor, b: Tensor, what: str, atol: float) -> None:
    err = (a - b).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.0e}"


def _agree(mine: tuple[Tensor, Tensor, list[Tensor]], ref: tuple[Tensor, Tensor, list[Tensor]], atol: float,
           label: str) -> None:
    _close(mine[0], ref[0], f"{label} output", atol)
    _close(mine[1], ref[1], f"{label} final state", atol)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), mine[2], ref[2]):
        _close(a, b, f"{label} gradient of {name}", atol)


def test_reference_matches_transformers() -> None:
    """transformers' torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule (l2-normalising q and k
    inside, as Qwen3.5 calls them; q scaled by 1/sqrt(K)): output and final state, key heads grouped."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    from megalite.recurrent.conv import l2_normalize

    q, k, v, g, beta, s0 = _inputs(GATED_DELTANET, torch.float32)
    q, k = q * 3, k * 0.5  # not unit length: the l2 normalisation must be the same one
    o, state = gated_delta(RuleInputs(l2_normalize(q), l2_normalize(k), v, g, beta), doc_ids=None, scale=K ** -0.5,
                           initial_state=s0, backend="recurrent")
    for label, fn in (("recurrent", torch_recurrent_gated_delta_rule), ("chunked", torch_chunk_gated_delta_rule)):
        o_hf, state_hf = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        _close(o, o_hf, f"transformers' {label} output", 1e-5)
        _close(state, state_hf, f"transformers' {label} final state", 1e-5)


@pytest.mark.parametrize("gate", [GATED_DELTANET, KIMI_DELTA, MAMBA2_SSD], ids=lambda g: g.name)
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_form_equals_the_reference(gate: Gate, packed: bool) -> None:
    inputs = _inputs(gate, torch.float64)
    docs = DOCS if packed else None
    _agree(_forms(inputs, gate, "chunked", docs), _forms(inputs, gate, "recurrent", docs), 1e-10, gate.name)


def test_packed_documents_equal_each_document_alone() -> None:
    """The engine alone: each document of a packed row from a zero state (the initial state reaches only the
    first document) equals that document run on its own, output and gradients (of the output)."""
    inputs = _inputs(GATED_DELTANET, torch.float64)
    o, _, grads = _forms(inputs, GATED_DELTANET, "chunked", DOCS, state_grad=False)
    row, start = 0, 0
    for n in (5, 20, 12):
        piece = [x[row:row + 1, start:start + n] for x in inputs[:5]]
        init = inputs[5][row:row + 1] if start == 0 else torch.zeros_like(inputs[5][:1])
        xs = [x.clone().requires_grad_(True) for x in (*piece, init)]
        o_d, _ = gated_delta(RuleInputs(*xs[:5]), doc_ids=None, scale=K ** -0.5, initial_state=xs[5],
                             backend="recurrent")
        gen = torch.Generator().manual_seed(9)
        d_o = torch.randn(o.shape, generator=gen, dtype=o.dtype)[row:row + 1, start:start + n]
        (o_d * d_o).sum().backward()
        _close(o[row:row + 1, start:start + n], o_d.detach(), f"document at {start}", 1e-10)
        for name, full, x in zip(("q", "k", "v", "g", "beta"), grads, xs):
            # q and k are per key head: the gradient of the packed row holds every token's, this document's slice
            assert x.grad is not None
            _close(full[row:row + 1, start:start + n], x.grad, f"gradient of {name}, document at {start}", 1e-10)
        start += n


@pytest.mark.parametrize("gate", [GATED_DELTANET, KIMI_DELTA, MAMBA2_SSD], ids=lambda g: g.name)
def test_triton_kernel_equals_the_reference(gate: Gate) -> None:
    """The chunk kernels (Triton interpreter on CPU) for each gate, with packed documents, key heads grouped:
    output, final state and every gradient (the backward kernel's). Kimi's per-channel decay with one key channel
    decaying by up to e^-30 a token (e^-480 over a chunk of 16): a kernel that exponentiated -cum would overflow
    to inf there; the reference and the kernel both stay finite and agree."""
    use_interpreter()
    inputs = _inputs(gate, torch.float32)
    if gate.per_channel_decay:
        inputs[3] = torch.cat([inputs[3][..., :1] * 60, inputs[3][..., 1:]], dim=-1)
    _agree(_forms(inputs, gate, "triton", DOCS), _forms(inputs, gate, "recurrent", DOCS), 1e-5, f"triton {gate.name}")


def test_triton_kernel_chunk_64() -> None:
    """Qwen3.5's chunk of 64 (six doubling products for the inverse), a sequence longer than one chunk."""
    use_interpreter()
    inputs = _inputs(GATED_DELTANET, torch.float32, seed=1)
    inputs = [torch.cat([x, x.flip(1)], dim=1)[:, :70] for x in inputs[:5]] + inputs[5:]
    docs = torch.cat([DOCS, DOCS + 3], dim=1)[:, :70]
    mine = _forms(inputs, GATED_DELTANET, "triton", docs, chunk=64)
    _agree(mine, _forms(inputs, GATED_DELTANET, "recurrent", docs), 1e-5, "triton, chunk 64")
