"""FP8 column- and row-parallel linears at tp2, tp2+sp and cp2 against the single-process FP8 linear:
forward output, input gradient, weight and bias gradients, for both recipes; and the amax traffic each
layout counts, exactly as `megalite.fp8.costs.amax_reductions` predicts.

Why these agree to fp32 round-off: with every amax reduced over the ranks holding its tensor's pieces
(the module doc of megalite/fp8/linear.py), each rank quantizes its piece to exactly the fp8 values
(and power-of-two scales) the single process does, so the products are the same; only the fp32 order in
which partial sums meet differs (tp's partial sums of a row-parallel output or a column-parallel input
gradient, cp's partial weight gradients). Hence rtol 1e-5 on O(1)-scaled values (observed ~1e-7).

With power-of-two scales a local (unreduced) scale changes a GEMM's result only through which values are
e4m3 subnormals, often invisibly at this tolerance; it does change the fp8 values themselves (by 2^k).
So the reduction rule is checked bitwise on the quantized pieces (`_check_quantize`: equal to the slice
of the single-process quantization with the reduction, different without it), and each layer's amax
all-reduces are counted over exactly the groups `amax_reductions` names.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megalite.fp8.costs import Splits, amax_reductions
from megalite.fp8.enable import Fp8Settings, enable_fp8
from megalite.fp8.linear import Fp8Gemm
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.parallel import comm
from megalite.parallel.counter import RING_FACTORS
from megalite.parallel.state import ParallelState
from tests.parallel_utils import layout

B, S, IN, PARTS, OUT = 2, 8, 64, [32, 16, 16], 48  # column: IN -> PARTS (fused); row: IN -> OUT
SMALL = (B, S, IN, PARTS, OUT)
# The block recipes: every tp2 shard and every cp2 sequence chunk in whole 128-blocks (megalite/fp8/checks.py).
# Sums over 768 `out` or 512 tokens of these wide-ranged values: the fp32 round-off of splitting such a sum in two
# reaches 4.8e-5 of this metric without FP8 (plain fp32, the same data), hence 2e-4 there.
BLOCKS, BLOCKS_RTOL = (2, 256, 256, [256, 256, 256], 256), 2e-4


def wide(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values whose magnitude spans 2^-12..2^12 over tokens (dim 1) and features (dim -1)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen)
    tok = torch.exp2(torch.linspace(-6, 6, shape[1])).view(1, -1, 1)
    feat = torch.exp2(torch.linspace(6, -6, shape[-1]))
    return t * tok * feat


def _seq(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    return t.chunk(n, dim=1)[i].contiguous()


def _run(layer: nn.Module, x: torch.Tensor, dys: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    ys = layer(x)
    ys = list(ys) if isinstance(ys, tuple) else [ys]
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys], x.grad  # type: ignore[return-value]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    err = ((got - want).abs() / (want.abs() + 1e-3 * want.abs().max())).max().item()
    assert err <= rtol, f"{what}: relative error {err:.2e}"


def _fp8(layer: nn.Module, name: str, recipe: str, st: ParallelState) -> None:
    assert enable_fp8([nn.ModuleDict({name: layer})], Fp8Settings(recipe, 16), st) == [name]  # type: ignore[arg-type]


def _check_column(st: ParallelState, recipe: str, dims: tuple = SMALL, rtol: float = 1e-5) -> None:
    B, S, IN, PARTS, OUT = dims  # noqa: N806
    tp, cp, sp = st.tp, st.cp, st.sp
    ref = ColumnParallelLinear(IN, PARTS, ParallelState(), name="c", seed=3, std=0.5, bias=True)
    lay = ColumnParallelLinear(IN, PARTS, st, name="c", seed=3, std=0.5, bias=True)
    _fp8(ref, "c", recipe, ParallelState())
    _fp8(lay, "c", recipe, st)
    x, dys = wide((B, S, IN), 1), [wide((B, S, p), 10 + i) for i, p in enumerate(PARTS)]
    ys_ref, dx_ref = _run(ref, x, dys)
    x_loc = _seq(_seq(x, cp, st.cp_rank), tp if sp else 1, st.tp_rank if sp else 0)
    dys_loc = [_seq(d, cp, st.cp_rank).chunk(tp, dim=-1)[st.tp_rank].contiguous() for d in dys]
    ys, dx = _run(lay, x_loc, dys_loc)
    for i, (y, yr) in enumerate(zip(ys, ys_ref)):
        _close(y, _seq(yr, cp, st.cp_rank).chunk(tp, dim=-1)[st.tp_rank], f"column output part {i}", rtol)
    _close(dx, _seq(_seq(dx_ref, cp, st.cp_rank), tp if sp else 1, st.tp_rank if sp else 0), "column dx", rtol)
    dw, db = comm.all_reduce(lay.weight.grad.clone(), st, "cp"), comm.all_reduce(lay.bias.grad.clone(), st, "cp")
    ref_w, ref_b = ref.weight.grad.split(PARTS), ref.bias.grad.split(PARTS)
    _close(dw, torch.cat([w.chunk(tp)[st.tp_rank] for w in ref_w]), "column weight grad", rtol)
    _close(db, torch.cat([b.chunk(tp)[st.tp_rank] for b in ref_b]), "column bias grad", rtol)


def _check_row(st: ParallelState, recipe: str, dims: tuple = SMALL, rtol: float = 1e-5) -> None:
    B, S, IN, PARTS, OUT = dims  # noqa: N806
    tp, cp, sp = st.tp, st.cp, st.sp
    ref = RowParallelLinear(IN, OUT, ParallelState(), name="r", seed=4, std=0.5, bias=True)
    lay = RowParallelLinear(IN, OUT, st, name="r", seed=4, std=0.5, bias=True)
    _fp8(ref, "r", recipe, ParallelState())
    _fp8(lay, "r", recipe, st)
    x, dy = wide((B, S, IN), 2), wide((B, S, OUT), 20)
    (y_ref,), dx_ref = _run(ref, x, [dy])
    seq = (lambda t: _seq(_seq(t, cp, st.cp_rank), tp, st.tp_rank)) if sp else (lambda t: _seq(t, cp, st.cp_rank))
    x_loc = _seq(x, cp, st.cp_rank).chunk(tp, dim=-1)[st.tp_rank].contiguous()
    (y,), dx = _run(lay, x_loc, [seq(dy)])
    _close(y, seq(y_ref), "row output", rtol)
    _close(dx, _seq(dx_ref, cp, st.cp_rank).chunk(tp, dim=-1)[st.tp_rank], "row dx", rtol)
    dw = comm.all_reduce(lay.weight.grad.clone(), st, "cp")
    db = comm.all_reduce(comm.all_reduce(lay.bias.grad.clone(), st, "cp"), st, "tp") if sp else \
        comm.all_reduce(lay.bias.grad.clone(), st, "cp")
    _close(dw, ref.weight.grad.chunk(tp, dim=1)[st.tp_rank], "row weight grad", rtol)
    _close(db, ref.bias.grad, "row bias grad", rtol)


def _amax_bytes(recipe: str, splits: Splits, st: ParallelState, t: int, i: int, o: int) -> dict[str, Fraction]:
    out: dict[str, Fraction] = {}
    for groups, n in amax_reductions(recipe, splits, t, i, o):  # type: ignore[arg-type]
        for g in groups:
            out[g] = out.get(g, Fraction(0)) + RING_FACTORS["all_reduce"](st.size(g)) * 4 * n
    return out


def _check_quantize(st: ParallelState, recipe: str) -> None:
    """Each rank's quantized piece of a split tensor is bitwise the slice of the whole tensor's quantization
    (values and scales) when its amax is reduced over the splitting group, and not without: per tensor
    (tensorwise) and per row / column (rowwise), for each dimension tp or cp splits here."""
    from megalite.fp8.scaled_mm import E4M3

    group, n, i = ("tp", st.tp, st.tp_rank) if st.tp > 1 else ("cp", st.cp, st.cp_rank)
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(16, 32, generator=gen)
    for split_dim in (0, 1):
        # the pieces' magnitudes differ by 2^12, so a local amax lands in another binade
        w = torch.cat([t.chunk(n, split_dim)[0] * 2.0 ** -12, t.chunk(n, split_dim)[1]], dim=split_dim)
        piece = w.chunk(n, split_dim)[i].contiguous()
        for dim in ([None] if recipe == "tensorwise" else [0, 1]):
            spans = dim is None or dim == split_dim  # the amax spans the split dimension: reduce it
            q, sc = Fp8Gemm(recipe, Splits((), (), ()), ParallelState()).quantize(w, E4M3, dim, ())  # type: ignore[arg-type]
            gemm = Fp8Gemm(recipe, Splits((), (), ()), st)  # type: ignore[arg-type]
            lq, lsc = gemm.quantize(piece, E4M3, dim, (group,) if spans else ())  # type: ignore[arg-type]
            want_q = q.float().chunk(n, split_dim)[i]
            want_sc = sc if dim is None or dim == split_dim else sc.chunk(n, split_dim)[i]
            assert torch.equal(lq.float(), want_q) and torch.equal(lsc, want_sc), f"{group} split {split_dim} dim {dim}"
            if spans:
                uq, _ = gemm.quantize(piece, E4M3, dim, ())  # type: ignore[arg-type]
                differs = torch.tensor(float(not torch.equal(uq.float(), want_q)))  # on the small piece's rank
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=st.group(group))
                assert differs.item() == 1.0, f"local scales match over split {split_dim}: the check cannot fail"


def _check_layers(rank: int, tp: int, sp: bool, cp: int, recipe: str) -> None:
    st = layout(tp, sp=sp, cp=cp)
    what = f"tp={tp} sp={sp} cp={cp} {recipe}"
    for check in (_check_column, _check_row):
        try:
            check(st, recipe)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    _check_quantize(st, recipe)
    # The amax traffic: an fp8 layer's counted bytes minus the same layer's in the run dtype.
    tokens = B * S // cp
    cases = [(lambda s: ColumnParallelLinear(IN, PARTS, s, name="c", seed=3, std=0.5), "column", IN, sum(PARTS) // tp,
              lambda: wide((B, S // cp // (tp if sp else 1), IN), 1)),
             (lambda s: RowParallelLinear(IN, OUT, s, name="r", seed=4, std=0.5), "row", IN // tp, OUT,
              lambda: wide((B, S // cp, IN // tp), 2))]
    for make, kind, i, o, x in cases:
        counted = []
        for fp8 in (False, True):
            lay = make(st)
            if fp8:
                _fp8(lay, "c", recipe, st)
            st.counter.reset()
            ys = lay(x().requires_grad_(True))
            ys = list(ys) if isinstance(ys, tuple) else [ys]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
            counted.append({k: st.counter.exact_bytes(k) for k in ("tp", "cp")})
        splits = lay.gemms.splits  # type: ignore[attr-defined]
        want = _amax_bytes(recipe, splits, st, tokens, i, o)
        for k in ("tp", "cp"):
            assert counted[1][k] - counted[0][k] == want.get(k, 0), f"{what} {kind}: {k} amax bytes"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tp,sp,cp", [(2, False, 1), (2, True, 1), (1, False, 2)])
def test_fp8_layers_match_single_process(dist_world, tp: int, sp: bool, cp: int, recipe: str) -> None:
    dist_world(2).run(_check_layers, tp, sp, cp, recipe)


def _check_block_layers(rank: int, tp: int, sp: bool, cp: int) -> None:
    """The block recipes (megalite/fp8/blocks.py) at a layout whose blocks lie on one rank each: the same checks,
    the fp32 round-off bound of these longer sums, and no amax reduced (`amax_reductions` is empty)."""
    st = layout(tp, sp=sp, cp=cp)
    for recipe in ("blockwise", "mxfp8"):
        for check in (_check_column, _check_row):
            try:
                check(st, recipe, BLOCKS, BLOCKS_RTOL)
            except AssertionError as e:
                raise AssertionError(f"tp={tp} sp={sp} cp={cp} {recipe}: {e}") from None
        assert amax_reductions(recipe, Splits(("cp",), ("tp",), ("tp",)), 1, 1, 1) == []


@pytest.mark.parametrize("tp,sp,cp", [(2, True, 1), (1, False, 2)])
def test_block_recipe_layers_match_single_process(dist_world, tp: int, sp: bool, cp: int) -> None:
    dist_world(2).run(_check_block_layers, tp, sp, cp)
