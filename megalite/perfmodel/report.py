"""The estimator's human-readable report (`tools/estimate.py` prints it): memory, communication, FLOPs,
step time and MFU of one `Estimate`, with the layout it was computed for."""

from __future__ import annotations

from megalite.attention.costs import kv_cache_bytes
from megalite.fp8.costs import is_block_recipe
from megalite.mla import costs as mla_costs
from megalite.perfmodel.estimate import GB, Estimate, Layout, ModelDims, Precision
from megalite.perfmodel.flops import attention_keys
from megalite.perfmodel.mixers import linear_cache_bytes
from megalite.perfmodel.peak_memory import PeakMemory, run_peak


def _gb(x: float) -> str:
    return f"{x / GB:10.2f}"


def render(est: Estimate, kw: dict) -> str:
    """The human-readable report."""
    lay: Layout = kw["layout"]
    dims: ModelDims | None = kw["dims"]
    name = "custom model" if dims is None else f"{dims.arch} L={dims.num_layers} h={dims.hidden_size}"
    if dims is not None and dims.mtp_layers:  # multi-token prediction modules, counted in every number below
        name += f" + {dims.mtp_layers} MTP"
    prec: Precision = kw["prec"]
    bytes_each = f"{prec.param}+{prec.grad}+{prec.master}+{prec.optimizer} bytes/param"
    out = [f"{name}: {est.params / 1e9:.3f} B parameters, {kw['dtype']}, {kw['memory_layout']} memory layout "
           f"({bytes_each} before ZeRO)",
           f"layout: tp={lay.tp}{f' cp={lay.cp}' if lay.cp > 1 else ''} pp={lay.pp} dp={lay.dp} zero={lay.zero} "
           f"sp={'on' if lay.sp else 'off'} "
           f"vpp={lay.vpp} schedule={lay.schedule} recompute={lay.recompute} "
           f"micro-batch={lay.micro_batch_size} micro-batches/step={est.num_microbatches}",
           f"pipeline bubble: {est.bubble:.1%}", "",
           f"memory per device (worst stage), GB   [{est.params_per_device / 1e9:.3f} B params here]",
           "  the papers' formulas (ZeRO's states; Korthikanti et al.'s activations, unfused attention's "
           "scores kept):"]
    mem = est.memory
    for label, value in (("parameters", mem.params), ("gradients", mem.grads),
                         ("fp32 master weights", mem.master), ("optimizer states", mem.optimizer),
                         ("model states", mem.model_states), ("activations", mem.activations)):
        out.append(f"  {label:<22}{_gb(value)}")
    out.append(f"  {'sum (not a peak)':<22}{_gb(mem.total)}   model states + activations by those formulas")
    if dims is not None:
        peak = _peak(kw)
        out.append(f"  {'peak (size by this)':<22}{_gb(peak.total)}   what the device holds at its worst moment: the "
                   f"{peak.peak_phase} phase, stage {peak.pp_rank} (docs/estimator.md):")
        out += [f"    {t.name:<28}{_gb(t.bytes)}   {t.formula}" for t in peak.terms() if t.bytes > 0]
    header = "communication per step per rank (wire bytes), GB"
    out += ["", header + ("      seconds" if est.comm_seconds else "")]
    for group, b in est.comm_bytes.items():
        secs = est.comm_seconds.get(group)
        out.append(f"  {group:<22}{_gb(b)}" + (f"   {secs:10.4f}" if secs is not None else ""))
    if est.model_flops_per_step is not None:
        out += ["", f"model FLOPs per step (PaLM 6N + 12·L·H·Q·s): {est.model_flops_per_step:.4e}",
                f"hardware FLOPs per step (Megatron's count, recompute={lay.recompute}): "
                f"{est.hardware_flops_per_step:.4e}"]
    if est.compute_seconds is not None:
        out.append(f"compute incl. bubble: {est.compute_seconds:.4g} s")
    if lay.cp > 1 and dims is not None:
        moved = {"ring": "K/V forward, K/V + fp32 dK/dV backward", "allgather": "K/V gathered, fp32 dK/dV "
                 "reduce-scattered", "a2a": "q, k, v and the output all-to-all'd, their gradients back",
                 "hybrid": f"all-to-all over {lay.cp_a2a} ranks, then the ring over {lay.cp // lay.cp_a2a}"}[lay.cp_mode]
        out.append(f"context parallel ({lay.cp_mode}): {dims.seq_len // lay.cp} of {dims.seq_len} tokens per rank; "
                   f"the cp attention ({moved}) moves {est.comm_bytes.get('cp', 0.0) / GB:.4g} GB")
    if est.cp_exposed_seconds is not None:
        how = ("each ring step overlaps one block's transfer with one block's attention" if lay.cp_mode == "ring"
               else "its collectives are not overlapped: all exposed")
        out.append(f"cp {lay.cp_mode}: {est.comm_seconds.get('cp', 0.0):.4g} s of transfers, "
                   f"{est.cp_exposed_seconds:.4g} s exposed ({how})")
    if est.step_seconds is not None:
        hidden = "DP traffic" + (" and the cp ring" if lay.cp > 1 else "")
        out += [f"step time: {est.step_seconds:.4g} s no overlap, {est.step_seconds_overlapped:.4g} s "
                f"with {hidden} hidden behind compute",
                f"predicted MFU (no overlap): {est.predicted_mfu:.1%}, HFU {est.predicted_hfu:.1%} "
                f"({est.hfu_convention}), causal-halved MFU {est.predicted_mfu_causal:.1%}"]
    if est.fp8 is not None:
        f8 = est.fp8
        names = [g["name"] for g in f8["gemms"] if g["fp8"]]
        out.append(f"fp8 {f8['recipe']} (min dim {f8['min_dim']}): {', '.join(names) or 'no GEMM'} in FP8, "
                   f"{f8['fp8_flops_fraction']:.1%} of the hardware FLOPs; amax all-reduces "
                   + (", ".join(f"{g} {b / 1e6:.3g} MB" for g, b in f8["amax_bytes"].items()) or ("none (block scales)" if is_block_recipe(f8["recipe"]) else "none (tp = cp = 1)")) +
                   f"; largest FP8 weight copy {f8['weight_copy_bytes'] / 2**20:.1f} MiB; scale tensors "
                   f"{f8['scale_bytes'] / 2**20:.2f} MiB per layer and micro-batch")
        if is_block_recipe(f8["recipe"]):
            out.append(f"fp8 {f8['recipe']}: the FP8 peak prices a native block-scaled GEMM; megalite emulates it "
                       "today (megalite/fp8/blocks.py), so a run is slower than predicted")
        if est.predicted_mfu_fp8_peak is not None:
            out.append(f"MFU is over the bf16 dense peak; over the FP8 dense peak "
                       f"({f8['fp8_peak_flops'] / 1e12:.0f} TFLOP/s) it is {est.predicted_mfu_fp8_peak:.1%}")
    if dims is not None and dims.mla is not None:
        out.append(mla_cache_line(dims, prec.activation))
    if dims is not None and dims.windows:
        out += window_lines(dims, prec.activation)
    if dims is not None and dims.linear_layers:
        out.append(linear_line(dims, prec.activation))
    for w in est.warnings:
        out.append(f"WARNING: {w}")
    return "\n".join(out)


def window_lines(dims: ModelDims, bytes_per_element: int) -> list[str]:
    """What the sliding-window layers (model.layer_types) change: the FLOPs convention and the KV cache."""
    assert dims.windows
    s, kv, hd = dims.seq_len, dims.kv_heads, dims.hd
    sliding = [w for w in dims.windows if w is not None]
    cache = sum(kv_cache_bytes(1, s, kv, hd, bytes_per_element, w) for w in dims.windows)
    full = kv_cache_bytes(1, s, kv, hd, bytes_per_element) * len(dims.windows)
    share = attention_keys(s, len(dims.windows), dims.windows) / (s * len(dims.windows))
    widths = ", ".join(map(str, sorted(set(sliding))))
    return [f"sliding-window layers: {len(sliding)} of {len(dims.windows)} (W = {widths}): MFU counts their attention "
            f"at min(s, W) keys per query (the full count, 12·h·min(s, W)), the causal-halved MFU at the pairs they "
            f"compute (sum_i min(i + 1, W) / s); the attention term is {share:.1%} of all-full attention's",
            f"KV cache for generation at {s} tokens: {cache / GB:.4g} GB per sequence (a windowed layer keeps "
            f"min(s, W) positions), against {full / GB:.4g} GB with every layer full"]


def linear_line(dims: ModelDims, bytes_per_element: int) -> str:
    """What the linear_attention layers change: their FLOPs and their generation cache (megalite/perfmodel/mixers.py)."""
    s, n, full_layers = dims.seq_len, len(dims.linear_layers), dims.num_layers - len(dims.linear_layers)
    windows = [w for i, w in enumerate(dims.windows or (None,) * dims.num_layers) if i not in dims.linear_layers]
    kv = sum(kv_cache_bytes(1, s, dims.kv_heads, dims.hd, bytes_per_element, w) for w in windows)
    every = kv_cache_bytes(1, s, dims.kv_heads, dims.hd, bytes_per_element) * dims.num_layers
    cache = linear_cache_bytes(dims, 1, bytes_per_element)
    return (f"linear_attention layers: {n} of {dims.num_layers} (Gated DeltaNet), priced by their chunked recurrence "
            f"(no s^2 term); generation cache at {s} tokens: {cache / GB:.4g} GB of recurrent state (any length) + "
            f"{kv / GB:.4g} GB KV cache of the {full_layers} attention layers per sequence, against {every / GB:.4g} GB "
            "with every layer full attention")


def mla_cache_line(dims: ModelDims, bytes_per_element: int) -> str:
    """Multi-head latent attention's KV cache for generation (megalite/mla/costs.py), per token."""
    assert dims.mla is not None
    small = mla_costs.kv_cache_bytes_per_token(dims.num_layers, dims.mla, bytes_per_element)
    full = mla_costs.expanded_kv_cache_bytes_per_token(dims.num_layers, dims.num_heads, dims.mla, bytes_per_element)
    return (f"MLA KV cache for generation: {small / 1024:.4g} KiB per token (kv_lora_rank + qk_rope_head_dim per "
            f"layer), against {full / 1024:.4g} KiB for the expanded keys and values ({full / small:.3g}x)")


def peak_of(kw: dict) -> dict | None:
    """The peak-memory model's terms for the JSON output (None without a model shape)."""
    if kw["dims"] is None:
        return None
    return _peak(kw).to_dict()


def _peak(kw: dict) -> PeakMemory:
    """The run's peak as the check before step 1 predicts it (`run_peak`), for the tool's flags."""
    return run_peak(kw["dims"], kw["layout"], kw["prec"], kw.get("memory_device", "cuda"),
                    kw.get("optimizer", "adamw"), kw.get("fp8"))
