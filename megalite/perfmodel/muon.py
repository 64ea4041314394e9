"""Muon's cost in the estimator: the Newton-Schulz FLOPs and the "muon" bytes of its whole-matrix exchanges.

Muon (`megalite.optim.muon`) orthogonalises each logical hidden matrix (q, k, v, attention out, gate, up,
down: `megalite.optim.muon_plan`) once per step on one owner rank. A step of the quintic iteration on an
m x n matrix (m <= n) is three matmuls, X X^T (2 m^2 n), A^2 (2 m^3) and (bA + cA^2) X (2 m^2 n).

Bytes, the `CommCounter` convention for all-to-all (what a rank sends to the others), fp32 (4 bytes):
  tp   each matrix of S elements (S/tp per TP rank) goes to its owner and comes back: the tp group sends
       2 (tp-1) S/tp x 4 bytes for it; per rank, on average, 2 (tp-1)/tp^2 x 4 S. At ZeRO >= 1 a tp group
       handles only the matrices its dp index owns (1/N of them), at ZeRO 0 every dp rank all of them.
  dp   (ZeRO >= 1) each matrix's pieces outside its owner's shard go to the owner and come back:
       2 x 4 x (S/tp - owner's piece) over the group. That depends on where the bucket's shard boundaries
       fall; `exchange_bytes` is exact for a given geometry, `muon_dp_bytes_bound` the worst case (every
       matrix spread evenly over the N shards): 2 (N-1)/N^2 x 4 S/tp per rank on average.
Compare the alternative of an all-gather over tp and a Newton-Schulz on every TP rank (Liu et al. 2025's
distributed Muon gathers over dp likewise): (tp-1)/tp x 4 S received per rank, (tp-1) S x 4 in all, against
2 (tp-1)/tp S x 4 in all here: equal at tp = 2, fewer here for tp > 2, and each matrix orthogonalised once.
"""

from __future__ import annotations

from typing import Sequence

from megalite.perfmodel.inputs import Layout, ModelDims

FP32 = 4


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Matmul FLOPs of one Newton-Schulz orthogonalisation of a rows x cols matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def muon_matrices(dims: ModelDims) -> list[tuple[int, int]]:
    """The logical matrices (rows = outputs, cols = inputs) Muon orthogonalises, all layers."""
    h, f = dims.hidden_size, dims.ffn
    q, kv = dims.num_heads * dims.hd, dims.kv_heads * dims.hd
    per_layer = [(q, h), (kv, h), (kv, h), (h, q)]
    per_layer += [(f, h), (f, h), (h, f)] if dims.arch == "llama" else [(f, h), (h, f)]
    return per_layer * dims.num_layers


def muon_flops(dims: ModelDims, steps: int = 5) -> int:
    """Newton-Schulz FLOPs of one optimizer step over the whole model (spread over the owners)."""
    return sum(ns_flops(r, c, steps) for r, c in muon_matrices(dims))


def muon_tp_bytes_total(matrix_elements: int, tp: int) -> int:
    """Bytes a tp group sends to orthogonalise matrices of `matrix_elements` (whole-matrix) elements."""
    return 2 * (tp - 1) * (matrix_elements // tp) * FP32


def muon_dp_bytes_bound(matrix_elements: int, tp: int, n: int) -> float:
    """Worst-case average bytes per rank of the dp exchange (ZeRO >= 1 over N ranks)."""
    return 2 * (n - 1) / n ** 2 * FP32 * matrix_elements / tp


def exchange_bytes(sizes: Sequence[Sequence[int]], owners: Sequence[int], me: int) -> int:
    """Exact bytes rank `me` sends in one gather + scatter (`megalite.optim.muon_exchange.OwnerExchange`):
    its pieces of the items others own, and the others' pieces of the items it owns."""
    out = 0
    for size, owner in zip(sizes, owners):
        out += sum(s for r, s in enumerate(size) if r != me) if owner == me else size[me]
    return out * FP32


def muon_report(optimizer: str, dims: ModelDims | None, lay: Layout, steps: int = 5) -> tuple[dict, list[str]]:
    """`tools/estimate.py --optimizer muon`: Muon's FLOPs (`steps` Newton-Schulz steps: muon.ns_steps) and "muon"
    bytes per step per rank (averages over the ranks: the owners share the matrices), as a JSON section and text
    lines; nothing for AdamW."""
    if optimizer != "muon" or dims is None:
        return {}, []
    n = lay.dp * lay.cp if lay.zero >= 1 else 1  # the dp owners: ZeRO 0 orthogonalises on every dp rank
    stage_elements = sum(r * c for r, c in muon_matrices(dims)) // lay.pp  # an even pp split of the layers
    tp_bytes = muon_tp_bytes_total(stage_elements, lay.tp) / lay.tp / n
    dp_bytes = muon_dp_bytes_bound(stage_elements, lay.tp, n) if n > 1 else 0.0
    flops = muon_flops(dims, steps) / (lay.pp * lay.tp * n)
    section = {"muon": {"ns_flops_per_rank": flops, "tp_bytes_per_rank": tp_bytes,
                        "dp_bytes_per_rank_bound": dp_bytes}}
    return section, [f"muon: Newton-Schulz {flops:.4e} FLOPs per step per rank; 'muon' bytes per rank "
                     f"{tp_bytes / 1e9:.4g} GB over tp + at most {dp_bytes / 1e9:.4g} GB over dp (docs/muon.md)"]


# The step's fp32 copies of the Nesterov direction U (`megalite.optim.muon.ShardMuon._muon_updates`), alive together
# at its dp scatter: the momentum step's output (dirs), the dp gather's flat buffer (its last pieces, still bound to
# the loop variable, keep it), the owners' concatenated pieces (local), the tp gather's flat buffer (whole),
# Newton-Schulz's scaled results, and the tp and dp scatters' flat buffers: 7 copies of the Muon elements a rank
# handles. Measured on bench/memory_peak.py's `mid` (fp32, one rank, 48 MiB of Muon elements): glibc's in-use heap
# rises 4 copies (198 MiB) as the step starts and peaks 336 MiB (7.0 copies) above the step's start.
MUON_STEP_COPIES = 7


def muon_step_bytes(dims: ModelDims, lay: Layout) -> float:
    """Bytes Muon's step allocates and frees on one rank (`PeakOptions.optimizer_temp_bytes`): seven fp32 copies of
    the Muon elements it handles (its 1/(tp·pp) of the matrices; at ZeRO >= 1 the 1/N its dp index owns)."""
    n = lay.replicas if lay.zero >= 1 else 1
    elements = sum(r * c for r, c in muon_matrices(dims)) / (lay.pp * lay.tp * n)
    return MUON_STEP_COPIES * FP32 * elements
