"""Which layers each pipeline stage (and each virtual chunk) holds.

With pp = P stages and vpp = v chunks per rank there are V = P*v *virtual* stages in model order.
Virtual stage s lives on pipeline rank s % P as its chunk s // P (Narayanan et al. 2021, the
interleaved schedule): rank r holds stages r, r+P, r+2P, ... so an activation visits every rank v
times and each rank's share of the bubble shrinks by v. The embedding is on virtual stage 0, the
final norm, head and loss on virtual stage V-1.
"""

from __future__ import annotations

from megalite.errors import ConfigError


def virtual_stage_layers(num_layers: int, pp: int, vpp: int, pp_layers: list[int] | None = None) -> list[range]:
    """Global layer ranges of the V = pp*vpp virtual stages, in model order."""
    stages = pp * vpp
    if pp_layers:
        if len(pp_layers) != stages or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            raise ConfigError(f"parallel.pp_layers={pp_layers} must have pp*vpp={stages} entries, each >= 1, "
                              f"summing to model.num_layers={num_layers}")
        counts = list(pp_layers)
    else:
        if num_layers % stages:
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by pp*vpp={stages}; "
                              "change the layer count or give parallel.pp_layers explicitly")
        counts = [num_layers // stages] * stages
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def balanced_counts(costs: list[float], stages: int) -> list[int]:
    """Layers per stage, contiguous in model order and at least one each, whose costliest stage is as cheap as any
    split makes it (layers of unequal cost: sliding-window beside full attention, MoE beside dense). Exact: dynamic
    programming over (layers placed, stages used); among equal splits the one that fills earlier stages less."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"{n} layers cannot fill {stages} pipeline stages of at least one layer each")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least possible costliest stage placing the first i layers on k stages; cut[k][i]: its last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12 * abs(v):
                    best[k][i], cut[k][i] = v, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def chunk_virtual_stages(pp_rank: int, pp: int, vpp: int, v_shape: bool = False) -> list[int]:
    """The virtual stages rank `pp_rank` holds, as its chunks 0..vpp-1. With `v_shape` (the ZB-V
    placement, Qi et al. 2024; vpp = 2) rank r holds stages r and 2P-1-r: the model runs down the
    ranks and back up, so the first and last stage share rank 0 and stage P-1 hands to P locally."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [c * pp + pp_rank for c in range(vpp)]


def stage_rank(vstage: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank holding virtual stage `vstage` (inverse of `chunk_virtual_stages`)."""
    if v_shape:
        return vstage if vstage < pp else 2 * pp - 1 - vstage
    return vstage % pp
