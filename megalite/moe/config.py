"""The `[moe]` config section (docs/moe.md) and its checks; torch-free, so `megalite.config` reads it cheaply.

`experts = 0` is a dense model. `resolved` fills the widths that default to the model's; `problems` is what
config validation asks of this section (one line per problem).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megalite.section import doc_field as _f

ROUTERS = ("mixtral", "qwen3", "deepseek")
GROUPED_ROUTERS = ("deepseek",)  # the routers that read moe.groups / moe.group_top_k (the others ignore them)
# Upper bounds where a larger value hangs, overflows or allocates absurdly rather than meaning anything:
MAX_EXPERTS = 2**16  # DeepSeek-V3 has 256; the router's [tokens, experts] logits and per-expert tables grow with it
MAX_FFN = 2**22      # as model.ffn_hidden_size (megalite/checkpoint/index_check.py MAX_DIM): one expert's width
MAX_SHARED = 2**10   # shared experts are fused into one MLP of shared_experts x width: 1e9 of them is 32 TB
MAX_COEF = 1e3       # aux_loss, z_loss, bias_rate, route_scale: real runs use <= ~10; 1e308 overflows to inf at step 1


@dataclass
class MoEConfig:
    experts: int = _f(0, "routed experts per MoE layer; 0 = dense MLP everywhere")
    top_k: int = _f(2, "experts each token is routed to")
    ffn_hidden_size: int = _f(0, "each routed expert's FFN width; 0 = model.ffn_hidden_size")
    shared_experts: int = _f(0, "shared experts every token goes through (DeepSeek), fused in one MLP")
    shared_ffn_hidden_size: int = _f(0, "each shared expert's FFN width; 0 = moe.ffn_hidden_size")
    first_dense: int = _f(0, "the first this many layers keep a dense MLP (DeepSeek's first_k_dense)")
    every: int = _f(1, "after moe.first_dense, every n-th layer is MoE (1 = all of them)")
    router: str = _f("mixtral", "mixtral (softmax over the top-k logits) | qwen3 (softmax over all, top-k) | "
                                "deepseek (sigmoid scores, aux-loss-free bias)")
    renorm: bool = _f(True, "qwen3/deepseek: renormalise the top-k weights to sum to 1")
    route_scale: float = _f(1.0, "deepseek: factor on the routing weights (routed_scaling_factor)")
    groups: int = _f(1, "deepseek group-limited routing: expert groups (1 = off)")
    group_top_k: int = _f(1, "deepseek group-limited routing: groups each token may use")
    bias_rate: float = _f(0.001, "deepseek: aux-loss-free bias update per step (0 = no bias update)")
    aux_loss: float = _f(0.0, "load-balancing loss coefficient (Switch/GShard form, mean over MoE layers)")
    seq_aux_loss: float = _f(0.0, "DeepSeek-V3's sequence-wise balance loss coefficient alpha (per sequence, "
                                  "mean over MoE layers; 0 = off)")
    z_loss: float = _f(0.0, "router z-loss coefficient (ST-MoE)")
    capacity_factor: float | None = _f(None, "expert capacity = factor x tokens x top_k / experts per rank; "
                                             "unset = dropless")
    router_bias: bool = _f(False, "a learned bias on the router logits (gpt-oss), apart from deepseek's balancing bias")
    shared_gate: bool = _f(False, "scale the shared experts' output by sigmoid(x . w), w one [hidden] vector per layer "
                                  "(Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE's shared_expert_gate)")

    def resolved(self, ffn_hidden_size: int) -> MoEConfig | None:
        """This section with the widths that default to the model's filled in; None for a dense model."""
        if not self.experts:
            return None
        ffn = self.ffn_hidden_size or ffn_hidden_size
        return replace(self, ffn_hidden_size=ffn, shared_ffn_hidden_size=self.shared_ffn_hidden_size or ffn)

    def is_moe_layer(self, index: int) -> bool:
        """Layers first_dense, first_dense + every, ... are MoE (global layer indices); none for a dense model."""
        return self.experts > 0 and index >= self.first_dense and (index - self.first_dense) % self.every == 0

    def layers(self, num_layers: int) -> list[int]:
        """The global indices of the MoE layers of a `num_layers`-layer model (empty for a dense model)."""
        return [i for i in range(num_layers) if self.is_moe_layer(i)]


def problems(moe: MoEConfig, num_layers: int, ffn_hidden_size: int, tp: int, dp: int, cp: int, ep: int) -> list[str]:
    """The `[moe]` section against the model and the parallel layout (expert parallelism), one line each."""
    out: list[str] = []
    if moe.experts < 0:
        out.append(f"moe.experts must be >= 0 (0 = dense), got {moe.experts}")
    if ep < 1:
        out.append(f"parallel.ep must be >= 1, got {ep}")
        return out
    if moe.experts <= 0:
        if ep > 1:
            out.append(f"parallel.ep={ep} needs a mixture-of-experts model: set moe.experts > 0 or ep=1")
        return out
    if moe.router not in ROUTERS:
        out.append(f"moe.router: {moe.router!r} is not one of {', '.join(ROUTERS)}")
    if not 1 <= moe.top_k <= moe.experts:
        out.append(f"moe.top_k {moe.top_k} must be between 1 and moe.experts {moe.experts}")
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        out.append(f"moe.capacity_factor must be > 0 (or unset for dropless), got {moe.capacity_factor}")
    elif moe.capacity_factor is not None and moe.capacity_factor > max(moe.experts, 1):
        # capacity = factor x tokens x top_k / experts >= tokens x top_k already at factor = experts: nothing
        # can be dropped, and a factor like 1e308 overflows the capacity computation at step 1
        out.append(f"moe.capacity_factor {moe.capacity_factor:g} is above moe.experts {moe.experts}, where no token "
                   "can be dropped any more: unset it for dropless routing")
    if moe.experts > MAX_EXPERTS:
        out.append(f"moe.experts {moe.experts} is above {MAX_EXPERTS}, far beyond any real model")
    for key, value in (("ffn_hidden_size", moe.ffn_hidden_size), ("shared_experts", moe.shared_experts),
                       ("shared_ffn_hidden_size", moe.shared_ffn_hidden_size), ("first_dense", moe.first_dense)):
        if value < 0:
            out.append(f"moe.{key} must be >= 0, got {value}")
    for key, value, most in (("ffn_hidden_size", moe.ffn_hidden_size, MAX_FFN), ("shared_experts", moe.shared_experts,
                             MAX_SHARED), ("shared_ffn_hidden_size", moe.shared_ffn_hidden_size, MAX_FFN)):
        if value > most:
            out.append(f"moe.{key} {value} is above {most}, far beyond any real model (the weights alone would not "
                       "fit any memory)")
    if moe.every < 1:
        out.append(f"moe.every must be >= 1, got {moe.every}")
    elif num_layers > 0 and moe.first_dense >= num_layers:  # would train a dense model, silently
        out.append(f"moe.first_dense {moe.first_dense} leaves no MoE layer among the {num_layers} layers: "
                   "lower it, or set moe.experts=0 for a dense model")
    if not moe.route_scale > 0:
        out.append(f"moe.route_scale must be > 0 (it multiplies the routing weights), got {moe.route_scale}")
    for key, rate in (("aux_loss", moe.aux_loss), ("seq_aux_loss", moe.seq_aux_loss), ("z_loss", moe.z_loss),
                      ("bias_rate", moe.bias_rate), ("route_scale", moe.route_scale)):
        if not rate >= 0:
            if key != "route_scale":  # said above
                out.append(f"moe.{key} must be >= 0, got {rate}")
        elif rate > MAX_COEF:
            out.append(f"moe.{key} {rate:g} is above {MAX_COEF:g}: it would drown the language-model loss or "
                       "overflow to inf")
    if moe.groups < 1 or moe.experts % moe.groups:
        out.append(f"moe.groups {moe.groups} must divide moe.experts {moe.experts}")
    elif moe.groups > 1 and moe.router not in GROUPED_ROUTERS:  # it would be accepted and silently ignored
        out.append(f"moe.groups {moe.groups} needs moe.router={' or '.join(GROUPED_ROUTERS)} (the {moe.router} router "
                   "has no group-limited routing): set moe.groups=1")
    elif moe.groups > 1 and (not 1 <= moe.group_top_k <= moe.groups  # groups 1: group routing off
                             or moe.top_k > moe.group_top_k * (moe.experts // moe.groups)):
        out.append(f"moe.group_top_k {moe.group_top_k} must be in 1..moe.groups {moe.groups} and leave "
                   f"at least moe.top_k {moe.top_k} experts")
    if moe.experts % ep:
        out.append(f"moe.experts {moe.experts} is not divisible by parallel.ep {ep}: each expert-parallel "
                   "rank needs an equal share of the experts")
    if dp >= 1 and cp >= 1 and (dp * cp) % ep:
        out.append(f"parallel.ep {ep} does not divide dp x cp = {dp} x {cp} = {dp * cp}: expert "
                   "parallelism takes its ranks from the data- and context-parallel ones")
    shared = moe.shared_experts * (moe.shared_ffn_hidden_size or moe.ffn_hidden_size or ffn_hidden_size)
    if shared and tp >= 1 and shared % tp:
        out.append(f"the shared experts' width {shared} is not divisible by parallel.tp {tp}")
    return out
