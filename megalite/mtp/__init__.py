"""Multi-token prediction (DeepSeek-V3, Liu et al. 2024, section 2.2; docs/mtp.md): D sequential modules on the
last pipeline stage, each predicting one token further ahead with its own transformer block and the model's
shared embedding and output head.

`config` (the `[mtp]` section and its checks), `module` (the modules and their losses), `metrics` (the step's
per-depth losses for metrics.jsonl), `costs` (torch-free parameter and FLOP counts the estimator reads).
"""
