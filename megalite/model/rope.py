"""RoPE's angle tables and their long-context scalings (`model.rope_scaling`): none, YaRN, Llama 3.

The model rotates q and k by cos/sin tables [seq_len, dim/2] (`model.ops.apply_rope`); a scaling changes only
the inverse frequencies the tables are built from, and YaRN also multiplies the tables by an "attention
factor" (so q.k by its square), exactly as transformers' `ROPE_INIT_FUNCTIONS` compute them:

  yarn (Peng et al. 2023, arXiv 2309.00071; DeepSeek-V2/V3 extend their context with it): each frequency is
    blended between the original one (extrapolation, the fast-rotating dims) and the one divided by `factor`
    (interpolation, the slow dims), by a linear ramp over the dims between the ones that turn `beta_fast` and
    `beta_slow` times over `original_max_positions`; the tables are multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by mscale(factor, 1),
    with mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1). MLA (megalite/mla) also multiplies its softmax
    scale by mscale(factor, mscale_all_dim)^2 (`softmax_scale_factor`), as transformers' DeepseekV3Attention.
  llama3 (Llama 3.1): wavelengths longer than original_max_positions / low_freq_factor are divided by
    `factor`, shorter than original_max_positions / high_freq_factor kept, and the band between blends the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite.model.spec import RopeFields

ROPE_SCALINGS = ("none", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | yarn | llama3
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0          # yarn; 0 = unset (transformers' None)
    mscale_all_dim: float = 0.0  # yarn; 0 = unset
    low_freq_factor: float = 1.0   # llama3
    high_freq_factor: float = 4.0  # llama3
    truncate: bool = True  # yarn: floor / ceil the ramp's ends (transformers' `truncate`; gpt-oss releases false)

    @classmethod
    def of(cls, m: RopeFields) -> RopeScaling:
        """The scaling a model config asks for (validation has checked the values)."""
        return cls(m.rope_scaling, m.rope_factor, m.rope_original_max_positions, m.rope_beta_fast, m.rope_beta_slow,
                   m.rope_mscale, m.rope_mscale_all_dim, m.rope_low_freq_factor, m.rope_high_freq_factor,
                   m.rope_truncate)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 m ln(s) + 1 (its eq. 21 with DeepSeek's factor m); 1 for s <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(r: RopeScaling) -> float:
    """The factor on the cos/sin tables (transformers' `attention_scaling`): YaRN's, else 1."""
    if r.kind != "yarn":
        return 1.0
    if r.mscale and r.mscale_all_dim:
        return yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    return yarn_mscale(r.factor)


def softmax_scale_factor(r: RopeScaling) -> float:
    """MLA's extra factor on 1/sqrt(qk_head_dim) (transformers' `yarn_apply_mscale`): mscale(f, all_dim)^2."""
    if r.kind != "yarn" or not r.mscale_all_dim:
        return 1.0
    return yarn_mscale(r.factor, r.mscale_all_dim) ** 2


def inv_freq(dim: int, theta: float, r: RopeScaling = RopeScaling()) -> torch.Tensor:
    """The dim/2 inverse frequencies (fp32, computed as transformers does: fp32 powers)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    plain = 1.0 / base
    if r.kind == "yarn":
        def correction_dim(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times
            return dim * math.log(r.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        span = (high - low) if high != low else 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
        return (1.0 / (r.factor * base)) * (1 - keep) + plain * keep
    if r.kind == "llama3":
        old = r.original_max_positions
        wavelen = 2 * math.pi / plain
        scaled = torch.where(wavelen > old / r.low_freq_factor, plain / r.factor, plain)
        smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        blended = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = ~(wavelen < old / r.high_freq_factor) & ~(wavelen > old / r.low_freq_factor)
        return torch.where(medium, blended, scaled)
    return plain


def rope_tables(seq_len: int, dim: int, theta: float, r: RopeScaling = RopeScaling()
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, dim/2] in fp32 for rotate-half RoPE, times the scaling's attention factor."""
    if r.kind == "none":  # float64 angles, as megalite has always built its plain tables
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    else:  # the scaled frequencies exactly as transformers computes them (fp32), then float64 angles
        freqs = inv_freq(dim, theta, r).double()
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    f = attention_factor(r)
    return (angles.cos() * f).float(), (angles.sin() * f).float()


def rope_scaling_problems(r: RopeScaling) -> list[str]:
    """One line per bad `model.rope_*` value (config validation calls it)."""
    if r.kind not in ROPE_SCALINGS:
        return [f"model.rope_scaling={r.kind!r}: expected one of {', '.join(ROPE_SCALINGS)}"]
    if r.kind == "none":
        return []
    out = []
    if not r.factor >= 1:
        out.append(f"model.rope_factor = {r.factor} must be >= 1 with rope_scaling={r.kind}")
    if r.original_max_positions < 1:
        out.append(f"model.rope_original_max_positions = {r.original_max_positions} must be >= 1 with "
                   f"rope_scaling={r.kind} (the context length the model was pretrained at)")
    if r.kind == "yarn" and not r.beta_fast > r.beta_slow > 0:
        out.append(f"model.rope_beta_fast = {r.beta_fast} must exceed model.rope_beta_slow = {r.beta_slow} > 0")
    if r.kind == "llama3" and not r.high_freq_factor > r.low_freq_factor > 0:
        out.append(f"model.rope_high_freq_factor = {r.high_freq_factor} must exceed model.rope_low_freq_factor = "
                   f"{r.low_freq_factor} > 0")
    return out
