"""Multi-head latent attention (DeepSeek-V2/V3): its attention module, cost formulas and config section (docs/mla.md)."""
