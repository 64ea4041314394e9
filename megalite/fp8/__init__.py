"""FP8 training, one folder (docs/fp8.md): current-scaling FP8 GEMMs for the parallel linears and the MoE expert GEMMs.

Read in this order: `costs.py` (torch-free: the recipes, the filter, the amax reductions and scale bytes, which the
estimator imports), `scaled_mm.py` (torch's private FP8 GEMM and the power-of-two casts), `blocks.py` (the block
recipes' quantisers: DeepSeek-V3's 1x128 / 128x128 and MX's 1x32 e8m0), `linear.py` (the dense linears' autograd
function), `experts.py` (the expert GEMMs'), `enable.py` (which modules run in FP8), `checks.py` (the config
problems validation reports), `checkpoint.py` (DeepSeek's block-scaled FP8 weights, dequantised on load).

This file imports nothing, so `megalite.fp8.costs` stays importable without torch.
"""
