"""Triton fused kernels, each with an autograd.Function and a plain-torch reference."""
