"""Muon's per-matrix math (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Liu et al. 2025,
"Muon is scalable for LLM training"), on whole matrices, with no knowledge of where they live.

For a 2-D weight W with gradient G (Liu et al.'s Algorithm 1, momentum written as in their code):

    M <- mu M + G                          the momentum buffer (kept as "exp_avg" in checkpoints)
    U  = G + mu M   (Nesterov)  or  M      the direction to orthogonalise
    O  = NS5(U)                            ~ U's orthogonal polar factor (singular values pushed to ~1)
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(A, B)) * O     (decoupled weight decay; W is A x B)

`NS5` is Jordan et al.'s quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T on X = U /
||U||_F (transposed so that A is the smaller Gram matrix), coefficients (a, b, c) = (3.4445, -4.7750, 2.0315)
and 5 steps: the coefficients maximise the slope at 0 so small singular values grow fast, at the price of
leaving them in roughly [0.7, 1.2] instead of converging to exactly 1, which the papers found does not hurt.

The scale: an orthogonal A x B matrix has RMS sqrt(1 / max(A, B)); multiplying by 0.2 sqrt(max(A, B)) gives
every Muon update an RMS of ~0.2, the RMS of a typical AdamW update (Liu et al. section 2.2), so Muon's
matrices can share AdamW's learning rate and weight decay (`train.lr`, `optimizer.weight_decay`). 0.2 is
`muon.rms` here. Everything runs in fp32 (Jordan et al. run NS in bf16 on GPUs; fp32 keeps every
layout equal to round-off, which the parity tests hold it to).
"""

from __future__ import annotations

import math
import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024's quintic (a, b, c)
NS_STEPS = 5
NS_EPS = 1e-7  # guards the Frobenius normalisation of an all-zero update


@torch.no_grad()
def newton_schulz(u: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Jordan et al.'s quintic Newton-Schulz orthogonalisation of the 2-D `u` (fp32, a new tensor)."""
    a, b, c = NS_COEFFICIENTS
    x = u.float() / (u.norm() + NS_EPS)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T.contiguous() if tall else x


def lr_scale(rows: int, cols: int, rms: float) -> float:
    """Liu et al.'s factor rms * sqrt(max(A, B)) by which a Muon update of an A x B matrix is scaled."""
    return rms * math.sqrt(max(rows, cols))

