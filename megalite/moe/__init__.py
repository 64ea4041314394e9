"""Mixture of experts (docs/moe.md): routers, grouped expert GEMMs, expert-parallel dispatch, losses, stats.

One concept per file: `settings` (the model config's moe_* fields), `router`, `grouped` (the grouped GEMM),
`experts`, `dispatch` (local permutation and the expert-parallel all-to-all), `losses` (load balancing and
z-loss, attached to the backward), `layer` (the MoE block FFN), `stats` (per-step loads and DeepSeek's bias).
"""
