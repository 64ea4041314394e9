"""The Gated DeltaNet layer against transformers' Qwen3_5GatedDeltaNet (its torch fallback, the real peer) with the
same weights, packed documents against each document alone, generation against the full forward, and tp2 (with
and without SP) against one process on gloo ranks.

Tolerances (fp32): the same sums in another order (the chunked form's triangular solve against transformers'
chunked form, TP's per-shard partial sums then an all-reduce), so ~1e-7 relative on O(1) values; 1e-5 absolute
leaves two orders of margin, while a wrong shard, a missed reset or a wrong gate moves values by O(0.1).
"""

from __future__ import annotations

from functools import partial

from typing import Any, Callable

import pytest
import torch

from megalite.context.documents import DocumentIds
from megalite.parallel import comm
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.sharding import full_state_dict
from megalite.parallel.state import ParallelState
from megalite.errors import ConfigError
from megalite.kernels.testing import use_interpreter
from megalite.recurrent.costs import RecurrentDims, cp_conv_halo_bytes, cp_exchange_bytes
from megalite.recurrent.engine import Backend
from megalite.recurrent.delta_layer import DeltaLayerConfig, ShortConvDeltaRule
from megalite.recurrent.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from megalite.recurrent.kimi_delta import KimiDeltaAttention

ATOL = 1e-5
# Key heads 2, value heads 4 (two value heads per key head), key width != value width.
CFG = GatedDeltaNetConfig(hidden_size=24, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
                          chunk_size=16)
# Kimi Delta Attention's shape: one head count and width for q, k and v (Kimi Linear's linear_num_heads,
# linear_head_dim), the low-rank gates of that width.
KDA_CFG = DeltaLayerConfig(hidden_size=24, num_key_heads=4, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                           chunk_size=16)
KINDS: dict[str, tuple[type[ShortConvDeltaRule], DeltaLayerConfig]] = {
    "gdn": (GatedDeltaNet, CFG), "kda": (KimiDeltaAttention, KDA_CFG)}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.0e}"


def _hf_layer(layer: GatedDeltaNet) -> Any:
    """transformers' Qwen3_5GatedDeltaNet with `layer`'s (tp1) weights."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    c = layer.cfg
    hf_cfg = Qwen3_5TextConfig(hidden_size=c.hidden_size, linear_num_key_heads=c.num_key_heads,
                               linear_num_value_heads=c.num_value_heads, linear_key_head_dim=c.key_head_dim,
                               linear_value_head_dim=c.value_head_dim, linear_conv_kernel_dim=c.conv_kernel,
                               rms_norm_eps=c.norm_eps, num_hidden_layers=1, layer_types=["linear_attention"])
    hf = Qwen3_5GatedDeltaNet(hf_cfg, 0)  # type: ignore[arg-type]  # the text config is what it reads
    qkv, z, b, a = layer.in_proj.weight.detach().split([2 * c.key_dim + c.value_dim, c.value_dim,
                                                        c.num_value_heads, c.num_value_heads])
    with torch.no_grad():
        for dst, src in ((hf.in_proj_qkv.weight, qkv), (hf.in_proj_z.weight, z), (hf.in_proj_b.weight, b),
                         (hf.in_proj_a.weight, a), (hf.conv1d.weight, layer.conv_weight[:, None]),
                         (hf.A_log, layer.A_log), (hf.dt_bias, layer.dt_bias), (hf.norm.weight, layer.norm_weight),
                         (hf.out_proj.weight, layer.out_proj.weight)):
            dst.copy_(src)
    return hf


def _hf_grads(hf: Any, c: GatedDeltaNetConfig) -> dict[str, torch.Tensor]:
    """transformers' weight gradients under megalite's names."""
    return {"in_proj.weight": torch.cat([hf.in_proj_qkv.weight.grad, hf.in_proj_z.weight.grad,
                                         hf.in_proj_b.weight.grad, hf.in_proj_a.weight.grad]),
            "conv_weight": hf.conv1d.weight.grad[:, 0], "A_log": hf.A_log.grad, "dt_bias": hf.dt_bias.grad,
            "norm_weight": hf.norm.weight.grad, "out_proj.weight": hf.out_proj.weight.grad}


def _run(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = layer(x, **kw)
    (y * gy).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


@pytest.mark.parametrize("backend,seq", [("chunked", 37), ("recurrent", 21), ("triton", 37)])
def test_layer_matches_transformers(backend: Backend, seq: int) -> None:
    """Forward, input gradient and every weight gradient equal transformers' Qwen3.5 layer; the sequence is longer
    than a chunk and not a multiple of it (transformers pads to its own chunk of 64). The Triton kernels run in
    the interpreter."""
    from dataclasses import replace

    if backend == "triton":
        use_interpreter()
    torch.manual_seed(0)
    layer = GatedDeltaNet(replace(CFG, backend=backend), ParallelState(), name="layers.0.mixer", seed=3)
    hf = _hf_layer(layer)
    match_peer(layer, hf, lambda: _hf_grads(hf, CFG), seq)


def match_peer(layer: ShortConvDeltaRule, hf: torch.nn.Module, peer_grads: Callable[[], dict[str, torch.Tensor]],
               seq: int, grad_rtol: float = 0.0) -> None:
    """`layer` and transformers' `hf` (same weights) on the same input: forward, input gradient and every weight
    gradient (`peer_grads()`: hf's under megalite's names), each weight gradient to ATOL + grad_rtol x its size."""
    hidden = layer.cfg.hidden_size
    x, gy = torch.randn(2, seq, hidden), torch.randn(2, seq, hidden)
    y, gx = _run(layer, x, gy)
    y_hf, gx_hf = _run(hf, x, gy)
    _close(y, y_hf, "forward")
    _close(gx, gx_hf, "input gradient")
    grads = peer_grads()
    assert set(grads) == {n for n, _ in layer.named_parameters()}
    for name, g in grads.items():
        mine = dict(layer.named_parameters())[name].grad
        assert mine is not None, name
        _close(mine, g, f"{name} gradient", atol=ATOL + grad_rtol * g.abs().max().item())


def _packed(seq_lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(seq_lens)])[None]


def check_packed(build: Callable[[], torch.nn.Module], hidden: int) -> None:
    """Packed documents of 5, 19, 3 and 12 tokens against each run alone in a layer `build` makes (the same
    weights each call): output, input gradient and every weight gradient; without the ids they must differ."""
    torch.manual_seed(1)
    lens = [5, 19, 3, 12]
    ids = _packed(lens)
    x, gy = torch.randn(1, sum(lens), hidden), torch.randn(1, sum(lens), hidden)
    packed = build()
    y, gx = _run(packed, x, gy, docs=DocumentIds(ids, ids))
    alone = build()
    start = 0
    for n in lens:
        y_d, gx_d = _run(alone, x[:, start:start + n], gy[:, start:start + n])
        _close(y[:, start:start + n], y_d, f"forward of the document at {start}")
        _close(gx[:, start:start + n], gx_d, f"input gradient of the document at {start}")
        start += n
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        assert p.grad is not None and q.grad is not None
        _close(p.grad, q.grad, f"{name} gradient (packed vs the sum over documents alone)")
    leaky, _ = _run(build(), x, gy)
    assert (leaky - y).abs().max() > 1e-3  # without the ids the documents do mix: the test can fail


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_packed_documents_equal_each_document_alone(kind: str) -> None:
    """A packed row with document ids: output, input gradient and every weight gradient equal each document run
    alone (the conv window and the state restart at every EOD). Documents of 5, 19 and 12 tokens: one ends inside
    a chunk, one spans a chunk boundary, one is shorter than the conv window would be from a chunk start."""
    cls, cfg = KINDS[kind]
    check_packed(lambda: cls(cfg, ParallelState(), name="m", seed=3), cfg.hidden_size)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_generation_steps_equal_the_full_forward(kind: str) -> None:
    """Prefill a prompt, then one token at a time from the cache (constant size): the outputs of the full forward."""
    cls, cfg = KINDS[kind]
    torch.manual_seed(2)
    layer = cls(cfg, ParallelState(), name="m", seed=3)
    x = torch.randn(2, 23, cfg.hidden_size)
    with torch.no_grad():
        full = layer(x)
        y, cache = layer.prefill(x[:, :17])
        outs = [y]
        for t in range(17, 23):
            y, cache = layer.step(x[:, t:t + 1], cache)
            assert cache.conv.shape == (2, cfg.conv_kernel - 1, 2 * cfg.key_dim + cfg.value_dim)
            assert cache.state.shape == (2, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)
            outs.append(y)
    _close(torch.cat(outs, dim=1), full, "prefill + steps vs the full forward")


def test_bad_shapes_are_refused() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="multiple of num_key_heads"):
        GatedDeltaNet(replace(CFG, num_value_heads=3), ParallelState(), name="m", seed=0)
    with pytest.raises(ValueError, match="divisible by tp=4"):
        CFG.check(4)


def _build_delta(kind: str, st: ParallelState, name: str, seed: int) -> torch.nn.Module:
    """The delta-rule layer `kind` ("gdn" or "kda"); partial(_build_delta, kind) is `check_tp`'s builder (a
    top-level function: it travels to the pool's ranks by pickle)."""
    cls, cfg = KINDS[kind]
    return cls(cfg, st, name=name, seed=seed)


def check_tp(rank: int, sp: bool, build: Callable[[ParallelState, str, int], torch.nn.Module], hidden: int) -> None:
    """The layer `build` makes at tp2 (with or without SP) against one process: this rank's output and input
    gradient, every weight gradient gathered whole (the sp_partial ones summed over tp first)."""
    from tests.parallel_utils import layout

    st = layout(2, sp=sp)
    torch.manual_seed(5)  # the same x, ids and upstream gradient on every rank
    lens = [9, 14, 9]
    ids = _packed(lens).expand(2, -1)
    x, gy = torch.randn(2, sum(lens), hidden), torch.randn(2, sum(lens), hidden)
    ref = build(ParallelState(), "layers.1.mixer", 7)
    y_ref, gx_ref = _run(ref, x, gy, docs=DocumentIds(ids, ids))
    layer = build(st, "layers.1.mixer", 7)

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's tokens under SP
        return comm.split(t, st, "tp", dim=1) if sp else t

    y, gx = _run(layer, mine(x), mine(gy), docs=DocumentIds(ids, ids))
    _close(y, mine(y_ref), "tp2 forward")
    _close(gx, mine(gx_ref), "tp2 input gradient")
    specs = named_param_specs(layer, ConfigError)
    for name, p in layer.named_parameters():
        if specs[name].sp_partial:
            assert p.grad is not None
            comm.all_reduce(p.grad, st, "tp")
    grads = full_state_dict(layer, st, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        _close(g, ref_grads[name], f"tp2 {name} gradient")  # type: ignore[arg-type]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_tp2_matches_one_process(dist_world, sp: bool, kind: str) -> None:
    dist_world(2).run(check_tp, sp, partial(_build_delta, kind), KINDS[kind][1].hidden_size)


def _check_cp(rank: int, tp: int, cp: int, sp: bool) -> None:
    """The layer under context parallelism (zigzag slices; the conv's halo and the state passed between ranks),
    with tp and SP beside it: this rank's outputs and input gradient, and every weight gradient once summed over
    cp (as the gradient sync does over dp x cp) and over tp for the replicated norm weight."""
    from megalite.context.zigzag import zigzag_split
    from tests.parallel_utils import layout

    st = layout(tp, cp=cp, sp=sp)
    torch.manual_seed(6)
    lens = [8, 15, 9]  # a document starting exactly at a slice boundary (8), others across boundaries
    ids = _packed(lens).expand(2, -1)
    x, gy = torch.randn(2, sum(lens), CFG.hidden_size), torch.randn(2, sum(lens), CFG.hidden_size)
    ref = GatedDeltaNet(CFG, ParallelState(), name="layers.2.mixer", seed=11)
    y_ref, gx_ref = _run(ref, x, gy, docs=DocumentIds(ids, ids))
    layer = GatedDeltaNet(CFG, st, name="layers.2.mixer", seed=11)

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's zigzag slices, then its SP share of them
        t = zigzag_split(t, cp, st.cp_rank)
        return comm.split(t, st, "tp", dim=1) if sp else t

    st.counter.reset()
    y, gx = _run(layer, mine(x), mine(gy), docs=DocumentIds(zigzag_split(ids, cp, st.cp_rank), ids))
    local = RecurrentDims(heads=CFG.num_value_heads // tp, key_dim=CFG.key_head_dim, value_dim=CFG.value_head_dim,
                          conv_channels=(2 * CFG.key_dim + CFG.value_dim) // tp)
    expected = cp_exchange_bytes(local, 2, cp, 2) + cp_conv_halo_bytes(local, 2, cp, act_bytes=4, slices_per_rank=2)
    assert st.counter.exact_bytes("cp") == 2 * expected  # forward all-gathers and their reduce-scatters back
    _close(y, mine(y_ref), "cp forward")
    _close(gx, mine(gx_ref), "cp input gradient")
    specs = named_param_specs(layer, ConfigError)
    for name, p in layer.named_parameters():
        assert p.grad is not None
        comm.all_reduce(p.grad, st, "cp")
        if specs[name].sp_partial:
            comm.all_reduce(p.grad, st, "tp")
    grads = full_state_dict(layer, st, grads=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        _close(grads[name], p.grad, f"cp {name} gradient")


@pytest.mark.parametrize("world,tp,sp", [(2, 1, False), (4, 2, True)])
def test_cp_matches_one_process(dist_world, world: int, tp: int, sp: bool) -> None:
    dist_world(world).run(_check_cp, tp, world // tp, sp)
