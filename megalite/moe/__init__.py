"""Mixture of experts (docs/moe.md): routers, grouped expert GEMMs, expert-parallel dispatch, losses, stats.

One concept per file: `config` (the `[moe]` config section and its checks), `settings` (a model's section,
resolved), `router`, `grouped` (the grouped GEMM),
`experts`, `dispatch` (local permutation and the expert-parallel all-to-all), `losses` (load balancing and
z-loss, attached to the backward), `layer` (the MoE block FFN), `stats` (per-step loads and DeepSeek's bias).
"""
