"""The run configuration's schema: one dataclass per section, each field with its `--help` doc.

A feature's section lives in the feature's folder (`[moe]`: megalite/moe/config.py, `[optimizer]` and `[muon]`:
megalite/optim/config.py, `[fp8]`: megalite/fp8/config.py) and is listed in `Config` below; the names
these fields had before they got their own sections are answered by `aliases.py`.

Precedence and parsing live in `parse.py`, derived values in `derive.py`, the rules in `validate.py`.
Each field's one-line doc lives in its `metadata["doc"]`, which `--help` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megalite.fp8.config import FP8Config
from megalite.mla.config import MLAConfig
from megalite.moe.config import MoEConfig
from megalite.mtp.config import MTPConfig
from megalite.optim.config import MuonConfig, OptimizerConfig
from megalite.section import doc_field as _f
from megalite.section import doc_list as _lf


@dataclass
class ModelConfig:
    preset: str = _f("tiny", "named model size whose values replace these defaults (see PRESETS)")
    arch: str = _f("llama", "llama (RMSNorm, RoPE, SwiGLU) | gpt2 (LayerNorm, learned positions, GELU)")
    num_layers: int = _f(4, "transformer blocks")
    hidden_size: int = _f(128, "model width h")
    num_heads: int = _f(4, "attention (query) heads")
    num_kv_heads: int = _f(0, "key/value heads; 0 = num_heads (multi-head), fewer = grouped-query attention")
    ffn_hidden_size: int = _f(0, "MLP width; 0 = llama: round_up(int(8h/3), 64), gpt2: 4h")
    seq_len: int = _f(128, "tokens per training sequence")
    vocab_size: int = _f(0, "vocabulary size; 0 = the tokenizer's (filled in by pretrain.py)")
    make_vocab_divisible_by: int = _f(64, "embedding rows are padded to a multiple of this x tp")
    norm_eps: float = _f(1e-5, "epsilon of RMSNorm / LayerNorm")
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama)")
    # Long-context RoPE scaling (megalite/model/rope.py, docs/mla.md "YaRN"), as transformers' rope_parameters.
    rope_scaling: str = _f("none", "RoPE frequency scaling: none | yarn (DeepSeek-V3) | llama3 (Llama 3.1)")
    rope_factor: float = _f(1.0, "yarn / llama3: context extension factor")
    rope_original_max_positions: int = _f(0, "yarn / llama3: the context length the model was pretrained at")
    rope_beta_fast: float = _f(32.0, "yarn: rotations that bound the extrapolated (unscaled) dims")
    rope_beta_slow: float = _f(1.0, "yarn: rotations that bound the interpolated (scaled) dims")
    rope_mscale: float = _f(0.0, "yarn: mscale (0 = unset); with mscale_all_dim sets the cos/sin factor")
    rope_mscale_all_dim: float = _f(0.0, "yarn: mscale_all_dim (0 = unset); MLA's softmax scale x mscale(factor, it)^2")
    rope_low_freq_factor: float = _f(1.0, "llama3: wavelengths above original / this are divided by factor")
    rope_high_freq_factor: float = _f(4.0, "llama3: wavelengths below original / this are kept")
    rope_truncate: bool = _f(True, "yarn: round the ramp's dims to whole ones (transformers' truncate; gpt-oss: false)")
    dropout: float = _f(0.0, "dropout probability on the embedding and the residual branches")
    tie_embeddings: bool | None = _f(None, "share input/output embedding; unset = arch default (llama no, gpt2 yes)")
    init_std: float = _f(0.02, "std of the normal weight init")
    kernels: str = _f("auto", "auto | torch | triton (auto = triton on CUDA, torch elsewhere)")
    recompute: str = _f("none", "activation recompute: none | selective (attention core) | full (whole block)")
    # Qwen3's per-head RMSNorm of q and k before RoPE (q_norm / k_norm, one [head_dim] weight each, llama arch).
    qk_norm: bool = _f(False, "RMSNorm each attention head's q and k before RoPE (Qwen3); llama arch only")
    head_dim: int = _f(0, "attention head width; 0 = hidden_size / num_heads (Qwen3 sets it apart); llama arch only")
    # The layer pattern and the attention / MLP variants (megalite/model/pattern.py, docs/attention.md).
    layer_types: list[str] = _lf("each layer's mixer in Hugging Face's vocabulary: full_attention | "
                                 "sliding_attention | linear_attention (Gated DeltaNet) | kimi_delta_attention (Kimi Linear's KDA), "
                                 "each with its MLP; or Nemotron-H's one-part layers: mamba (Mamba2) | attention (full, no MLP) | "
                                 "mlp (no mixer); fewer entries than layers = a period repeated (Gemma 3: 5 x "
                                 "sliding_attention then full_attention); empty = full_attention everywhere")
    sliding_window: int = _f(0, "W of sliding_attention layers: query i sees keys i - W < j <= i (W keys, its own "
                                "included: transformers' sliding_window)")
    # Gated DeltaNet, the linear_attention layers' mixer (megalite/recurrent, docs/linear-attention.md), with
    # transformers' Qwen3-Next / Qwen3.5 names; 0 = derived from the attention's shape. kimi_delta_attention layers
    # read the same fields (Kimi Linear's linear_num_heads: key heads = value heads; linear_head_dim: both widths).
    linear_num_key_heads: int = _f(0, "linear_attention: key (and query) heads; 0 = num_heads")
    linear_num_value_heads: int = _f(0, "linear_attention: value heads, a multiple of the key heads; 0 = key heads")
    linear_key_head_dim: int = _f(0, "linear_attention: key (and query) head width; 0 = the attention's head_dim")
    linear_value_head_dim: int = _f(0, "linear_attention: value head width; 0 = linear_key_head_dim")
    linear_conv_kernel_dim: int = _f(4, "linear_attention: the causal depthwise conv's kernel width")
    # Mamba2, the mixer of `mamba` layers (Nemotron-H; megalite/recurrent/mamba2.py, docs/linear-attention.md), with
    # transformers' NemotronH names.
    mamba_num_heads: int = _f(0, "mamba: heads (mamba_num_heads); 0 = num_heads")
    mamba_head_dim: int = _f(0, "mamba: head width (mamba_head_dim); 0 = the attention's head_dim")
    mamba_n_groups: int = _f(1, "mamba: groups of heads sharing B and C (n_groups); divides mamba_num_heads")
    mamba_state_size: int = _f(128, "mamba: the state's width per head (ssm_state_size)")
    mamba_conv_kernel: int = _f(4, "mamba: the causal depthwise conv's kernel width (conv_kernel)")
    rope_local_theta: float = _f(0.0, "RoPE base of sliding_attention layers (Gemma 3: 10000); 0 = rope_theta")
    rope_fraction: float = _f(1.0, "share of each head's dims RoPE rotates, the first ones (partial_rotary_factor; "
                                   "Qwen3-Next 0.25); 0 = NoPE everywhere")
    nope_layers: list[int] = _lf("layer indices (from 0) with no RoPE at all (NoPE)")
    attn_sinks: bool = _f(False, "a learnable logit per query head in every attention softmax's denominator (gpt-oss)")
    attn_output_gate: str = _f("none", "none | head | element: attention output x sigmoid(gate), the gate emitted by "
                                       "the q projection per head or per element (Qwen3-Next)")
    attn_softcap: float = _f(0.0, "attention logits -> c tanh(logits / c) after scaling (Gemma 2's "
                                  "attn_logit_softcapping); 0 = off")
    final_softcap: float = _f(0.0, "output logits -> c tanh(logits / c) (Gemma 2's final_logit_softcapping); 0 = off")
    query_pre_attn_scalar: float = _f(0.0, "softmax scale = this^-1/2 (Gemma); 0 = head_dim")
    attn_bias: bool = _f(False, "biases on q, k, v and o (gpt-oss); gpt2 has them always")
    sandwich_norm: bool = _f(False, "a norm after attention and after the MLP too, before each residual add (Gemma 2/3's "
                                    "post_attention / post_feedforward norms)")
    embed_scale: bool = _f(False, "multiply the token embeddings by sqrt(hidden_size) (Gemma)")
    mlp: str = _f("auto", "MLP activation: auto (llama swiglu, gpt2 gelu) | swiglu | geglu (tanh GeLU gate, Gemma) | "
                          "clamped_swiglu (gpt-oss) | gelu | relu2 (relu(x)^2, not gated: Nemotron-H); MoE experts use "
                          "it too")
    swiglu_limit: float = _f(7.0, "clamped_swiglu: gate clamped to <= limit, up to [-limit, limit] (gpt-oss)")
    swiglu_alpha: float = _f(1.702, "clamped_swiglu: gate x sigmoid(alpha x gate) x (up + 1) (gpt-oss)")
    mlp_bias: bool = _f(False, "biases on the dense MLP's and each routed expert's linears (gpt-oss); gpt2's dense MLP "
                               "has them always")
    # torch.compile of each transformer block (megalite/model/compile.py, docs/performance.md "torch.compile").
    compile: bool = _f(False, "torch.compile each transformer block (inductor needs a C++ compiler on CPU)")
    compile_backend: str = _f("inductor", "torch.compile backend: inductor | aot_eager | eager (the last two only "
                                          "trace: for checks)")


@dataclass
class ModelArgs(ModelConfig):
    """What the model is built from (`megalite.model.spec.ModelSpec`): the `[model]` section with the sections of
    the features that change the model's shape: `[moe]`, `[mla]` and `[mtp]`."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    @classmethod
    def of(cls, model: ModelConfig, moe: MoEConfig, mla: MLAConfig | None = None,
           mtp: MTPConfig | None = None) -> ModelArgs:
        """The sections as one (fields copied by name: a reordering cannot mix them up)."""
        return cls(**{f.name: getattr(model, f.name) for f in fields(ModelConfig)}, moe=moe,
                   mla=mla if mla is not None else MLAConfig(), mtp=mtp if mtp is not None else MTPConfig())

    @classmethod
    def from_config(cls, cfg: Config) -> ModelArgs:
        """A whole run config's model: `[model]`, `[moe]`, `[mla]` and `[mtp]`."""
        return cls.of(cfg.model, cfg.moe, cfg.mla, cfg.mtp)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel size (Megatron column/row-parallel linears)")
    pp: int = _f(1, "pipeline-parallel stages")
    cp: int = _f(1, "context-parallel size: each sequence split over cp ranks (ring attention, zigzag split)")
    cp_mode: str = _f("ring", "context-parallel attention: ring (K/V passed around) | allgather (K/V gathered, "
                              "Llama 3) | a2a (all-to-all to head-sharded, DeepSpeed-Ulysses) | hybrid (a2a "
                              "inside groups of cp_a2a ranks, the ring across them; USP)")
    cp_a2a: int = _f(2, "cp_mode=hybrid: cp ranks per all-to-all group (divides cp; the ring is cp / cp_a2a long)")
    dp: int = _f(0, "data-parallel size; 0 = world_size // (tp*cp*pp)")
    sp: bool = _f(False, "sequence parallelism: shard norm/dropout activations over the tp ranks")
    ep: int = _f(1, "expert-parallel size: MoE experts split over ep ranks taken from dp x cp (all-to-all dispatch)")
    vpp: int = _f(1, "virtual pipeline chunks per rank (interleaved; zbv: 2)")
    schedule: str = _f("1f1b", "pipeline schedule: 1f1b | gpipe | interleaved | zb-h1 | zbv")
    zero: int = _f(0, "ZeRO stage 0..3: shard optimizer state (1), + grads (2), + params (3) over dp")
    bucket_mb: float = _f(25.0, "gradient bucket size in MiB (fp32 grads): one dp reduction per bucket, launched "
                                "in the backward as soon as the bucket is complete")
    first_bucket_mb: float = _f(1.0, "size of the first bucket in MiB (the output layer's grads, ready first): small, "
                                     "so its reduction starts early in the backward")
    overlap_param_gather: bool = _f(True, "ZeRO-1/2: wait for each bucket's parameter all-gather in the next forward, "
                                          "just before its first module; false = at the end of the step")
    zero3_prefetch: int = _f(1, "ZeRO-3: blocks whose parameters are gathered ahead of the one computing; 0 = none")
    pp_layers: list[int] = _lf("layers per (virtual) stage in model order; empty = even split")
    timeout_s: float = _f(600.0, "collective timeout in seconds before a hung rank is reported")
    backend: str = _f("auto", "process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo")


@dataclass
class TrainConfig:
    steps: int = _f(300, "optimizer steps to train")
    micro_batch_size: int = _f(8, "sequences per micro-batch per data-parallel rank")
    global_batch_size: int = _f(0, "sequences per optimizer step; 0 = micro_batch_size * dp")
    seed: int = _f(1234, "random seed (init, dropout, data order)")
    dtype: str = _f("auto", "auto | fp32 | bf16 | fp16 (auto = bf16 on CUDA, fp32 on CPU)")
    device: str = _f("auto", "auto | cpu | cuda")
    tune_malloc: bool = _f(True, "glibc: keep freed host memory for the next step instead of returning it to the "
                                 "OS (no page-fault storm on CPU), its tcache and fastbins off (freed tensors fit "
                                 "the next identical one: pretrain.py runs once more at start to set the tcache); "
                                 "see megalite/runtime/malloc.py")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(20, "linear warmup steps")
    clip_grad: float = _f(1.0, "global gradient-norm clip; 0 = no clipping")
    eval_interval: int = _f(100, "steps between validation runs; 0 = never")
    eval_steps: int = _f(4, "validation batches per evaluation")
    max_skipped_steps: int = _f(10, "abort after this many consecutive skipped (inf/nan) steps")
    spike_factor: float = _f(0.0, "log a loss spike when loss > this x the running median loss; 0 = off")
    watchdog_factor: float = _f(20.0, "a step longer than this x the median step is a hang: report and exit; 0 = off")
    watchdog_min_s: float = _f(60.0, "never call a step a hang before it has run this many seconds")
    memory_check: bool = _f(True, "refuse before step 1 when the predicted peak memory exceeds the free RAM "
                                  "(CPU) or device memory (GPU)")
    init_from: str = _f("", "start from these weights (a megalite checkpoint of any layout, or a Hugging Face model "
                            "directory) with a fresh optimizer, schedule and data position; ignored when resuming")


@dataclass
class DataConfig:
    path: list[str] = _lf(".bin/.idx prefixes and raw sources streamed as read (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, "
                          "a directory of them, a datasets save_to_disk directory, hf:NAME from the local cache); "
                          "empty = the embedded demo corpus")
    weights: list[float] = _lf("blend weights, one per path; empty = proportional to size")
    tokenizer: str = _f("", "SentencePiece .model, HF tokenizer.json or tiktoken file; empty = the demo tokenizer")
    valid_fraction: float = _f(0.02, "share of documents held out for validation")
    cache_dir: str = _f("", "empty = $MEGALITE_CACHE or ~/.cache/megalite")
    demo_max_bytes: int = _f(3_000_000, "bytes of the embedded demo corpus to use")
    demo_vocab_size: int = _f(2048, "vocabulary size of the demo tokenizer")
    document_mask: bool = _f(False, "attend only within each document of a packed sample (the EOD tokens end them) "
                                    "and restart positions at each document (Llama 3; Megatron's "
                                    "--reset-attention-mask --reset-position-ids)")
    # Raw sources (megalite/data/sources.py, loader.py; docs/data.md "Raw data, streamed").
    format: str = _f("text", "raw records: text (a string under text_key) | chat (a messages list under messages_key, "
                             "rendered with the chat template; loss on the assistant tokens only)")
    text_key: str = _f("text", "JSON key / column holding a text record's document")
    messages_key: str = _f("messages", "JSON key / column holding a chat record's messages list")
    chat_template: str = _f("", "Jinja chat template file with {% generation %} blocks; empty = the tokenizer's "
                                "tokenizer_config.json chat_template")
    streams: int = _f(0, "independent data streams (fixed for the run's life; a multiple of every dp it will run "
                         "at, dividing train.global_batch_size); 0 = dp")
    workers: int = _f(2, "tokenizer processes per rank for raw sources; 0 = tokenize in the loader thread")
    prefetch: int = _f(4, "steps of batches the loader prepares ahead of training")
    max_record_bytes: int = _f(16 << 20, "a raw record larger than this is counted as oversized and skipped")
    max_bad_records: int = _f(-1, "stop the run when more raw records than this were bad (over all ranks); -1 = no "
                                  "count limit")
    max_bad_fraction: float = _f(0.01, "stop the run when more than this share of the raw records read were bad "
                                       "(checked from the 1,000th record on)")
    on_change: str = _f("refuse", "a resumed run whose raw data changed since the checkpoint (files, sizes, content): "
                                  "refuse (name the file) | restart (read the data from its start; weights, optimizer "
                                  "and step are resumed)")


@dataclass
class CheckpointConfig:
    dir: str = _f("", "directory for checkpoints; empty = no checkpoints")
    interval: int = _f(0, "steps between saves; 0 = only at the end (when dir is set)")
    load: str = _f("", '"" (resume from the newest in dir if any) | "none" | "latest" | a checkpoint directory')
    keep: int = _f(3, "most recent checkpoints kept in dir (older ones are deleted)")
    async_save: bool = _f(False, "copy the tensors to host memory and write them in a background thread while "
                          "training goes on (at most one save in flight; same files and guarantees)")


@dataclass
class LoggingConfig:
    dir: str = _f("runs/latest", "directory for metrics.jsonl and config.toml")
    interval: int = _f(10, "steps between log lines")
    wandb_project: str = _f("", "wandb project; empty = no wandb")
    wandb_entity: str = _f("", "wandb entity (team or user)")
    wandb_run_name: str = _f("", "wandb run name; empty = wandb's default")
    sample_interval: int = _f(0, "steps between greedy text samples (stdout, metrics.jsonl, wandb; pp=1, no sp); 0 = never")
    sample_prompt: str = _f("", "text the samples continue; empty = the start of a new document")
    sample_tokens: int = _f(32, "new tokens per sample at most")
    verbose: bool = _f(False, "print the start-up details too: malloc and thread settings, the model-state bytes")


def _section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


@dataclass
class Config:
    model: ModelConfig = _section(ModelConfig, "model shape and kernels")
    moe: MoEConfig = _section(MoEConfig, "mixture of experts (megalite/moe, docs/moe.md); moe.experts = 0 is dense")
    mla: MLAConfig = _section(MLAConfig, "multi-head latent attention (DeepSeek-V2/V3; docs/mla.md)")
    mtp: MTPConfig = _section(MTPConfig, "multi-token prediction (DeepSeek-V3; docs/mtp.md)")
    parallel: ParallelConfig = _section(ParallelConfig, "3D parallel layout and ZeRO")
    train: TrainConfig = _section(TrainConfig, "steps, batches, learning rate and precision")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "the optimizer and its AdamW settings (megalite/optim)")
    muon: MuonConfig = _section(MuonConfig, "Muon, when optimizer.name=muon (megalite/optim/muon.py, docs/muon.md)")
    fp8: FP8Config = _section(FP8Config, "FP8 matmuls (megalite/layers/fp8.py, docs/fp8.md)")
    data: DataConfig = _section(DataConfig, "datasets and tokenizer")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "saving and resuming")
    logging: LoggingConfig = _section(LoggingConfig, "metrics, JSONL and wandb")
