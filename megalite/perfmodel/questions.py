"""Questions users ask the cost model directly, answered with `megalite.perfmodel.estimate`'s arithmetic:

* the largest model that fits (the ZeRO paper's Table 2 question, Rajbhandari et al. 2020): from
  model states alone, or, given a shape, the most layers whose states *and* activations fit;
* how long training takes: Narayanan et al. 2021's 8TP/(nX) next to the exact form (the hardware
  FLOPs per token of the layout), or from an MFU, or from the predicted step time;
* the utilizations of a measured step time (Korthikanti et al. 2022, Table 5's MFU and HFU columns).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megalite.errors import ConfigError
from megalite.perfmodel.estimate import Estimate, estimate
from megalite.perfmodel.inputs import Layout, ModelDims, Precision

DAY = 86400.0


def bytes_per_param(nd: int, stage: int, prec: Precision) -> float:
    """Model-state bytes one device holds per parameter of its model-parallel shard, ZeRO `stage`
    over `nd` ranks, without padding: DDP 2+2+K; stage 1: 4 + K/Nd; stage 2: 2 + (2+K)/Nd; stage 3:
    (2+2+K)/Nd for the paper's layout (Rajbhandari et al. 2020, section 5)."""
    sharded = {"param": stage >= 3, "grad": stage >= 2, "master": stage >= 1, "optimizer": stage >= 1}
    return sum(getattr(prec, kind) / (nd if cut else 1) for kind, cut in sharded.items())


@dataclass(frozen=True)
class LargestModel:
    """The answer to "what is the largest model that fits?" on `memory_bytes` per device."""

    params: float  # whole model: per-device parameters x tp x pp
    params_per_device: float
    bytes_per_param: float
    memory_bytes: float
    num_layers: int | None = None  # with a model shape: its most layers that fit (activations included)
    estimate: Estimate | None = None  # that model's estimate

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("params", "params_per_device", "bytes_per_param",
                                              "memory_bytes", "num_layers")}
        out["estimate"] = None if self.estimate is None else self.estimate.to_dict()
        return out


def largest_params(memory_bytes: float, layout: Layout, prec: Precision = Precision()) -> LargestModel:
    """Model states only, as the ZeRO paper's Table 2: Ψ = memory / bytes_per_param per device, and
    Ψ x tp x pp for the model (model parallelism splits the parameters, ZeRO their states over dp)."""
    if not memory_bytes > 0:
        raise ConfigError(f"device memory must be > 0, got {memory_bytes}; pass --gpu-memory-gb")
    per = bytes_per_param(layout.replicas, layout.zero, prec)
    psi = memory_bytes / per
    return LargestModel(params=psi * layout.tp * layout.pp, params_per_device=psi, bytes_per_param=per,
                        memory_bytes=memory_bytes)


def largest_num_layers(dims: ModelDims, layout: Layout, memory_bytes: float,
                       prec: Precision = Precision()) -> LargestModel:
    """The most layers (a multiple of pp x vpp) of `dims`'s shape whose worst stage, model states plus
    activations, fits in `memory_bytes`: memory grows with the layers, so a doubling then a bisection."""
    step = layout.pp * layout.vpp

    def cost(multiple: int) -> Estimate:
        return estimate(replace(dims, num_layers=multiple * step), layout, prec)

    if cost(1).memory.total > memory_bytes:
        need = cost(1).memory.total
        raise ConfigError(f"not even {step} layer(s) of this shape fit: they need {need / 1e9:.1f} GB per "
                          f"device of {memory_bytes / 1e9:.1f} GB; shrink the hidden size, the sequence or "
                          f"the micro-batch, or add recompute, ZeRO or model parallelism")
    lo, hi = 1, 2
    while cost(hi).memory.total <= memory_bytes:
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            raise ConfigError("the layer search did not converge: is the memory limit absurdly large?")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid).memory.total <= memory_bytes else (lo, mid)
    est = cost(lo)
    return LargestModel(params=est.params, params_per_device=est.params_per_device,
                        bytes_per_param=bytes_per_param(layout.replicas, layout.zero, prec),
                        memory_bytes=memory_bytes, num_layers=lo * step, estimate=est)


@dataclass(frozen=True)
class TrainingTime:
    """Seconds to train on `tokens` tokens with `devices` devices, by each method that the inputs allow."""

    tokens: float
    devices: int
    rows: tuple[tuple[str, str, float], ...]  # (method, formula, seconds)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "devices": self.devices,
                "methods": [{"method": m, "formula": f, "seconds": s, "days": s / DAY} for m, f, s in self.rows]}


@dataclass(frozen=True)
class Throughput:
    """What is known of the rate: an achieved FLOP/s per device, or an MFU with the device's peak."""

    achieved_flops: float | None = None
    mfu: float | None = None
    peak_flops: float | None = None


def training_time(tokens: float, devices: int, params: float, est: Estimate | None = None,
                  dims: ModelDims | None = None, layout: Layout | None = None,
                  rate: Throughput = Throughput()) -> TrainingTime:
    """How long training on `tokens` takes (`rate` holds `achieved_flops`, `mfu` and `peak_flops`).

    * `achieved_flops` X per device, counted as Megatron counts (hardware FLOPs, recompute included):
      Narayanan et al. 2021's estimate 8TP/(nX) (6 FLOPs per parameter and token plus 2 for the
      recomputed forward, attention and logits neglected), and, with `est` from a model shape, the
      exact form T x (its hardware FLOPs per token, the layout's recompute) / (nX).
    * `mfu` with `peak_flops`: model FLOPs per token x T / (n x MFU x peak); 6TP/(n x MFU x peak) without a shape.
    * `est` with a predicted step time: the steps T / (tokens per step) x that time.
    """
    achieved_flops, mfu, peak_flops = rate.achieved_flops, rate.mfu, rate.peak_flops
    if not tokens > 0 or not devices > 0:
        raise ConfigError(f"training tokens ({tokens}) and devices ({devices}) must be > 0")
    rows: list[tuple[str, str, float]] = []
    per_step_tokens = None
    if est is not None and dims is not None and layout is not None and est.model_flops_per_step:
        per_step_tokens = float(est.num_microbatches) * layout.micro_batch_size * layout.dp * dims.seq_len
    if achieved_flops is not None:
        if not achieved_flops > 0:
            raise ConfigError(f"achieved throughput must be > 0 TFLOP/s, got {achieved_flops / 1e12}")
        rows.append(("8TP/(nX)", "Narayanan et al. 2021, full recompute", 8 * tokens * params / (devices * achieved_flops)))
        if per_step_tokens and est is not None and est.hardware_flops_per_step:
            hw = est.hardware_flops_per_step / per_step_tokens
            rows.append(("exact", f"T x {hw:.4g} hardware FLOPs/token / (nX)", tokens * hw / (devices * achieved_flops)))
    if mfu is not None:
        if not 0 < mfu <= 1 or not peak_flops:
            raise ConfigError(f"--mfu {mfu} needs to be in (0, 1] and a peak (--peak-tflops or --device)")
        x = mfu * peak_flops
        rows.append(("6TP/(n MFU peak)", "model FLOPs, attention neglected", 6 * tokens * params / (devices * x)))
        if per_step_tokens and est is not None and est.model_flops_per_step:
            model = est.model_flops_per_step / per_step_tokens
            rows.append(("exact at MFU", f"T x {model:.4g} model FLOPs/token / (n MFU peak)",
                         tokens * model / (devices * x)))
    if per_step_tokens and est is not None and est.step_seconds_overlapped:
        rows.append(("predicted steps", f"T / {per_step_tokens:.4g} tokens/step x "
                     f"{est.step_seconds_overlapped:.4g} s (DP overlapped)",
                     tokens / per_step_tokens * est.step_seconds_overlapped))
    if not rows:
        raise ConfigError("--train-tokens needs a throughput: --achieved-tflops X, or --mfu F with a peak, "
                          "or a model shape with --peak-tflops/--device for the predicted step time")
    return TrainingTime(tokens, devices, tuple(rows))


def utilizations(est: Estimate, world: int, step_seconds: float, peak_flops: float) -> dict[str, float]:
    """MFU and HFU of a measured step time (Korthikanti et al. 2022, Table 5 reports both): model and
    hardware FLOPs per step / (devices x step time x peak)."""
    if not step_seconds > 0 or not peak_flops > 0:
        raise ConfigError("a measured step time needs a positive --step-seconds and a peak (--peak-tflops/--device)")
    denominator = world * step_seconds * peak_flops
    return {"mfu": float(est.model_flops_per_step or 0.0) / denominator,
            "hfu": float(est.model_flops_per_step or 0.0) / denominator * est.hfu_ratio,  # one count: >= MFU
            "mfu_causal": float(est.model_flops_causal_per_step or 0.0) / denominator,
            "achieved_tflops": float(est.hardware_flops_per_step or 0.0) / world / step_seconds / 1e12}
