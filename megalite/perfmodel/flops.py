"""FLOPs counting, dense peak throughput per device, and MFU.

Two different counts, for two different questions:

* **Model FLOPs** (`model_flops_per_token`): what the model needs, independent of how it is run.
  This is the numerator of PaLM's *model FLOPs utilization* (MFU, Chowdhery et al. 2022, appendix B),
  the number megalite logs as `mfu`. Recomputation is deliberately NOT counted: a run that trades
  compute for memory does not get credit for the extra work.
* **Hardware FLOPs** (`megatron_flops_per_iteration`, generalised by `flops_per_token`): what the
  GPUs actually execute, including the work repeated by full or selective activation recomputation
  (Narayanan et al. 2021, the FLOPs equation; Korthikanti et al. 2022). Use it to predict step time
  (HFU), or to compare with papers that report "TFLOP/s per GPU" the Megatron way.

Peaks are *dense* (no 2:4 sparsity) vendor numbers: quoting the sparse figure would halve every MFU.

Attention under causal masking, two conventions (docs/tracking.md): the full count 12·L·H·Q·s (PaLM,
Megatron: `mfu`) and the causal-halved count 6·L·H·Q·s (only the unmasked half of QK^T and AV:
`mfu_causal`, what MaxText and flash-attention's block skipping report). One report uses one count:
HFU is the model FLOPs times `hfu_ratio` (executed over needed FLOPs of the same matmul count), so
HFU == MFU without recompute and HFU >= MFU always. FP8 runs keep MFU against the BF16 dense peak (the
"fp8" column is beside it, never instead of it).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from megalite.attention.costs import dense_pairs, visible_pairs
from megalite.errors import ConfigError
from megalite.mla import costs as mla_costs
from megalite.perfmodel.inputs import ModelDims
from megalite.perfmodel.mixers import attention_windows, linear_core_flops, mixer_weights
from megalite.perfmodel.mixers import pipeline_imbalance  # noqa: F401  (re-exported: its old home)

PEAK_ENV_VAR = "MEGALITE_PEAK_TFLOPS"
"""Set to a number of TFLOP/s to override the table (new GPUs, clocks capped, or a sanity check)."""

# (regex matched case-insensitively against `torch.cuda.get_device_name()`, {dtype: TFLOP/s}).
# Order matters: the first match wins, so the more specific variants (H100 PCIe / NVL) come before
# the generic H100 (the SXM part, whose name is e.g. "NVIDIA H100 80GB HBM3"). Word boundaries keep
# "A10" from matching "A100"/"A10G" and "L4" from matching "L40S".
# "fp32" is plain IEEE fp32 on the CUDA cores; "tf32" is the tensor-core TF32 rate (dense).
# Sources: NVIDIA A100/H100/H200/A10/L4/V100/Ada datasheets, AMD MI300X datasheet.
_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0, "fp8": 1671.0}),
    (r"\bGH200\b|\bH200\b|\bH100\b", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0, "fp8": 1979.0}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3, "fp8": 242.5}),
    # V100 has no bf16 tensor cores: bf16 is absent on purpose (-> None, MFU unknown).
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),
    # GeForce fp16/bf16 with fp32 accumulation (what PyTorch uses); fp16-accumulate is 2x but unused.
    (r"\bRTX 4090\b", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bMI300X\b", {"bf16": 1307.0, "fp16": 1307.0, "tf32": 653.7, "fp32": 163.4, "fp8": 2614.9}),
)

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "tf32": "tf32", "fp8": "fp8",
}
# "fp8" is the dense FP8 tensor-core rate; devices without FP8 tensor cores (A100, A10, V100) have none.


def attention_keys(seq_len: int, num_layers: int, windows: Sequence[int | None] = (), causal: bool = False) -> float:
    """The keys each query is counted against, summed over the layers (`windows`: each layer's sliding window, None
    for full attention; empty: every layer full). Full count: s per full layer, min(s, W) per windowed one (its dense
    S x min(S, W) block: `attention.costs.dense_pairs` / S). Causal-halved (`causal`): s / 2 per full layer (PaLM's
    half), and per windowed layer the pairs it computes, sum_i min(i + 1, W) / S (`attention.costs.visible_pairs`)."""
    if not windows:
        return num_layers * seq_len / (2.0 if causal else 1.0)
    full = seq_len / 2.0 if causal else float(seq_len)
    pairs = visible_pairs if causal else dense_pairs
    return sum(full if w is None else pairs(seq_len, w) / seq_len for w in windows)


def model_flops_per_token(num_params: int, num_layers: int, hidden_size: float, seq_len: int,
                          causal: bool = False, windows: Sequence[int | None] = ()) -> float:
    """Training FLOPs per token: 6N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B).

    * 6N: every weight is used in one multiply-add (2 FLOPs) in the forward pass and two in the
      backward pass (gradient w.r.t. the input and w.r.t. the weight): 2N + 4N.
    * 12·L·h·s: the attention matmuls that have no weights, QK^T and attention-times-V. Per layer
      and token each costs 2·s·h FLOPs forward (h = heads x head_dim, s = sequence length),
      i.e. 4·s·h forward and 8·s·h backward. Causal masking is NOT discounted, as in PaLM (it is
      what dense attention kernels without block skipping execute, and it keeps MFUs comparable).

    N is used exactly as the caller gives it; megalite's trainer passes the total parameter count
    (padded vocabulary rows included), PaLM's convention. PaLM shares its input and output
    embedding, whose use in the head is a real matmul, so the choice hardly matters there. For an
    *untied* model it does: the input-embedding lookup is a gather, not a matmul, so counting that
    table inflates 6N by 6·V·h per token (about 2% for Llama-2-7B). Callers that want the
    strictest count pass N minus the input embedding (and learned position) table.

    causal=True halves the attention term (6·L·h·s): the causal-halved convention (`mfu_causal`).
    `windows` (each layer's sliding window, model.layer_types): a windowed layer's term counts its window only,
    12·h·min(s, W), or causal-halved what it computes (`attention_keys`).
    """
    if windows:
        return 6.0 * num_params + 12.0 * hidden_size * attention_keys(seq_len, num_layers, windows, causal)
    return 6.0 * num_params + (6.0 if causal else 12.0) * num_layers * hidden_size * seq_len


def megatron_flops_per_iteration(
    batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int, recompute: bool
) -> float:
    """FLOPs executed per iteration for a GPT, Narayanan et al. 2021 ("Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM"), eq. 3.

    With full activation recomputation (the paper's setting, one extra forward pass):
        F = 96·B·s·l·h² · (1 + s/(6h) + V/(16·l·h))
    Without recomputation (forward + backward = 3 forward passes instead of 4):
        F = 72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h))
    The vocab term is the logits matmul (6·B·s·h·V either way: the output layer is not
    recomputed). B is the global batch in sequences. The formula assumes a 4h GeLU MLP and
    full multi-head attention; for SwiGLU/GQA models it is an approximation.
    """
    b, s, l, h, v = float(batch), float(seq_len), float(num_layers), float(hidden), float(vocab)
    if recompute:
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


def matmul_params(dims: ModelDims) -> tuple[int, int]:
    """(weights of the transformer layers' matmuls, weights of the logits matmul V·h).

    Biases, norms and the embedding / position lookups are not matmuls: Megatron's FLOPs equation
    leaves them out, and so do the hardware FLOPs here."""
    h = dims.hidden_size
    mlp = (3 if dims.arch == "llama" else 2) * h * dims.ffn
    if dims.mla is not None:
        return dims.num_layers * (sum(mla_costs.attention_weights(h, dims.num_heads, dims.mla)) + mlp), dims.vocab_size * h
    # each layer's mixer: attention's q/k/v/o, or a linear layer's projections and conv (`mixers.mixer_weights`)
    return sum(mixer_weights(dims, i) for i in range(dims.num_layers)) + dims.num_layers * mlp, dims.vocab_size * h


def attention_term(dims: ModelDims, causal: bool = False) -> float:
    """L·H·Q·s generalised: heads x head dimension x the keys each query sees, summed over the attention layers
    (`attention_keys` over their windows; a linear layer has none: its recurrence is `mixers.linear_core_flops`)."""
    layers = dims.num_layers - len(dims.linear_layers)
    return dims.num_heads * dims.hd * attention_keys(dims.seq_len, layers, attention_windows(dims), causal)


def flops_per_token(dims: ModelDims, num_params: float, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token of `dims` under `recompute`.

    Model FLOPs: PaLM's 6N + 12·L·H·Q·s (`model_flops_per_token`, H·Q = heads x head dimension,
    N = `num_params`), the MFU numerator, recompute never counted.
    Hardware FLOPs: what is executed, counted as Megatron does (Narayanan et al. 2021, the FLOPs
    equation): 6 FLOPs per matmul weight (`matmul_params`) plus the attention core 12·L·H·Q·s, plus
      full recompute:      one more forward of the layers, 2·(layer weights) + 4·L·H·Q·s (the logits
                           layer is not recomputed);
      selective recompute: one more forward of the attention core, 4·L·H·Q·s (Korthikanti et al. 2022:
                           72·B·s·l·h²·(1 + 2s/(9h) + V/(12·l·h)) per iteration, 4/3 of the s/(6h) term).
    For a GPT-3-shaped model (4h GeLU MLP, no GQA, head dimension h/heads) this is exactly
    `megatron_flops_per_iteration` / (B·s) with or without full recompute.
    """
    layers, head = matmul_params(dims)
    # sliding-window layers: their window's keys only (executed: the kernels skip tiles); linear layers: no keys,
    # their chunked recurrence instead (forward `rule`, x 3 for training as every matmul)
    attn = attention_term(dims)
    rule = linear_core_flops(dims)
    model = model_flops_per_token(int(num_params), dims.num_layers - len(dims.linear_layers),
                                  dims.num_heads * dims.hd, dims.seq_len, windows=attention_windows(dims)) + 3.0 * rule
    if dims.mla is not None:  # MLA: QK^T at d = nope + rope, AV at v_head_dim; executed at the padded width
        width = mla_costs.attention_width(dims.num_heads, dims.mla)
        model = model_flops_per_token(int(num_params), dims.num_layers, width, dims.seq_len)
        attn = dims.num_layers * mla_costs.core_flops_per_token(dims.seq_len, dims.num_heads, dims.mla)[1] / 4.0
        # (executed_flops counts the core as 12 x attn: 4·s·H·D forward, twice that backward)
    return model, executed_flops(layers, head, attn, recompute, rule)


def executed_flops(layer_weights: float, head_weights: float, attn: float, recompute: str,
                   linear_core: float = 0.0) -> float:
    """`flops_per_token`'s hardware count from the layers' and the head's matmul weights per token, the
    attention term attn = L·H·Q·s and the linear layers' recurrence, forward (`mixers.linear_core_flops`; its
    backward twice that, as a matmul's) (megalite.perfmodel.fp8_moe passes a mixture of experts' active weights).
    Full recompute re-runs every layer's forward; selective recompute the attention core only (a linear layer
    checkpoints nothing)."""
    hardware = 6.0 * (layer_weights + head_weights) + 12.0 * attn + 3.0 * linear_core
    if recompute == "full":
        hardware += 2.0 * layer_weights + 4.0 * attn + linear_core
    elif recompute == "selective":
        hardware += 4.0 * attn
    return hardware


HFU_CONVENTIONS = ("executed", "korthikanti")


def hfu_ratio(dims: ModelDims, recompute: str, convention: str = "executed") -> float:
    """Hardware over model FLOPs of one recompute mode, from one matmul count (so 1 without recompute).

    "executed" (the default: what the devices run): `flops_per_token`'s hardware count with recompute over
    the same count without it; selective recompute re-runs the attention core's forward, 4·L·H·Q·s.
    "korthikanti": the convention Korthikanti et al. 2022 computed Table 5's HFU with, for selective
    recompute 72·B·L·s·h²·(1 + s/(3h) + V/(12·h·L)) over the model's 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L))
    (it counts the attention core's forward twice more, up to 3.5% above "executed" at 22B); full
    recompute is the same in both (96·(1 + s/(6h) + V/(16·h·L)) over 72·(...)) for a GPT-3 shape.
    """
    if convention not in HFU_CONVENTIONS:
        raise ConfigError(f"unknown HFU convention {convention!r}; use one of {', '.join(HFU_CONVENTIONS)}")
    if recompute == "selective" and convention == "korthikanti":
        s, h, v, l = float(dims.seq_len), float(dims.hidden_size), float(dims.vocab_size), float(dims.num_layers)
        return (1.0 + s / (3.0 * h) + v / (12.0 * h * l)) / (1.0 + s / (6.0 * h) + v / (12.0 * h * l))
    return flops_per_token(dims, 0, recompute)[1] / flops_per_token(dims, 0, "none")[1]


def normalize_dtype(dtype: str) -> str:
    """Map `bf16`/`bfloat16`/`torch.bfloat16`/... to the table's key; ConfigError if unknown."""
    key = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if key is None:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32, tf32")
    return key


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for `dtype`, or None when unknown (CPU, unlisted GPU).

    `device_name` is a `torch.cuda.get_device_name()`-style string ("NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"). The environment variable
    `MEGALITE_PEAK_TFLOPS` (TFLOP/s) wins over the table, whatever the device or dtype.
    """
    override = os.environ.get(PEAK_ENV_VAR, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0.0:
            raise ConfigError(
                f"{PEAK_ENV_VAR}={override!r} is not a positive number; set it to the device's "
                f"dense peak in TFLOP/s (e.g. 989 for an H100 in bf16) or unset it"
            )
        return value * 1e12
    key = normalize_dtype(dtype)
    for pattern, table in _PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = table.get(key)
            return None if tflops is None else tflops * 1e12
    return None


def mfu(model_flops_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s per device over its dense peak.

    None when the peak is unknown (CPU, unlisted GPU): a made-up denominator would be worse
    than no number, and `metrics.jsonl` writes it as null.
    """
    if peak is None or peak <= 0.0:
        return None
    return model_flops_per_s_per_device / peak
