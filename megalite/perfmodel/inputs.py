"""The inputs of megalite's arithmetic (`megalite.perfmodel.estimate`): a model's shape (and well-known shapes by
name), a parallel layout and batch, and the bytes per element of each kind of state. Plain dataclasses,
validated on construction.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from megalite.errors import ConfigError
from megalite.mla.costs import MLADims
from megalite.model.pattern import LinearDims


@dataclass(frozen=True)
class MoEDims:
    """The expert part of a mixture-of-experts model (`megalite.moe.settings.MoESettings`, read there once):
    each MoE layer (global index in `layers`) replaces the dense MLP by a router, `experts` routed experts of
    width `ffn` (whole on every tp rank, split over ep) and `shared` shared experts fused into one tp-split MLP
    of width shared x shared_ffn."""

    experts: int
    ffn: int
    layers: tuple[int, ...]
    top_k: int = 1
    shared: int = 0
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        for name in ("experts", "ffn", "top_k"):
            if not getattr(self, name) >= 1:
                raise ConfigError(f"moe {name}={getattr(self, name)} must be >= 1")
        if self.shared < 0 or self.shared_ffn < 0:
            raise ConfigError(f"moe shared experts {self.shared} x width {self.shared_ffn} must be >= 0")


@dataclass(frozen=True)
class ModelDims:
    """A megalite GPT's shape (names as in the `model` config section)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    arch: str = "llama"
    num_kv_heads: int | None = None  # None: = num_heads (no GQA)
    ffn_hidden_size: int | None = None  # None: 4h for gpt2, llama's 8h/3 rounded up to 64
    tie_embeddings: bool | None = None  # None: tied for gpt2, untied for llama
    make_vocab_divisible_by: int = 1  # vocab padded to a multiple of this x tp
    head_dim: int | None = None  # None: hidden_size / num_heads (megalite's models); PaLM decouples them
    mla: MLADims | None = None  # multi-head latent attention's widths (`[mla]`, megalite/mla/costs.py); None: off
    mtp_layers: int = 0  # multi-token prediction depth D (docs/mtp.md): D more blocks and logits on the last stage
    moe: MoEDims | None = None  # None: a dense model
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window (model.layer_types); None: all full
    linear_layers: tuple[int, ...] = ()  # the linear_attention (Gated DeltaNet) layers' global indices
    linear: LinearDims | None = None  # their shape (the model.linear_* fields resolved); set with linear_layers

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ConfigError(f"model.arch={self.arch!r} is unknown; use 'llama' or 'gpt2'")
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len", "num_kv_heads",
                     "ffn_hidden_size", "make_vocab_divisible_by", "head_dim"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"model {name}={value} must be > 0; pass a positive "
                                  f"--{name.replace('_', '-')}")
        if self.mtp_layers < 0:
            raise ConfigError(f"mtp_layers={self.mtp_layers} must be >= 0 (0 = no multi-token prediction)")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                              f"{self.num_heads}; pick sizes with hidden_size = num_heads x head_dim")
        if self.linear_layers and (self.linear is None or not all(0 <= i < self.num_layers for i in self.linear_layers)
                                   or any(self.windows[i] is not None for i in self.linear_layers if self.windows)):
            raise ConfigError(f"linear_layers={self.linear_layers} must be full-width layer indices in "
                              f"[0, {self.num_layers}) given with their shape (linear=LinearDims(...))")
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                              f"{self.kv_heads}; each kv head must serve a whole group of query heads")

    @property
    def hd(self) -> int:
        """Attention head dimension Q (PaLM's notation); the attention width is num_heads x Q."""
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.arch == "gpt2":
            return 4 * self.hidden_size
        return -(-int(8 * self.hidden_size / 3) // 64) * 64  # megalite's rule (config.resolve)

    @property
    def tied(self) -> bool:
        return self.arch == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    def padded_vocab(self, tp: int) -> int:
        multiple = tp * self.make_vocab_divisible_by
        return -(-self.vocab_size // multiple) * multiple


# Well-known shapes, named as in `megalite.config.PRESETS` where both have them (the CLI prefers the
# config's table when it can import it); vocabularies as the models were trained.
PRESETS: dict[str, ModelDims] = {
    "tiny": ModelDims(4, 128, 4, 2048, 128, "llama", 2),  # the demo tokenizer's 2048 tokens
    "gpt2-small": ModelDims(12, 768, 12, 50257, 1024, "gpt2"),
    "gpt2-medium": ModelDims(24, 1024, 16, 50257, 1024, "gpt2"),
    "gpt2-xl": ModelDims(48, 1600, 25, 50257, 1024, "gpt2"),
    "llama-1b": ModelDims(16, 2048, 32, 128256, 2048, "llama", 8, 8192, True),
    "llama-7b": ModelDims(32, 4096, 32, 32000, 4096, "llama", 32, 11008, False),
    "llama-13b": ModelDims(40, 5120, 40, 32000, 4096, "llama", 40, 13824, False),
    "llama2-70b": ModelDims(80, 8192, 64, 32000, 4096, "llama", 8, 28672, False),
    "gpt3-175b": ModelDims(96, 12288, 96, 50257, 2048, "gpt2"),
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout and batch (names as in the `parallel` and `train` config sections)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    sp: bool = False
    vpp: int = 1
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved (vpp > 1 implies interleaved)
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size x dp (one micro-batch)
    recompute: str = "none"  # none | selective | full
    cp: int = 1  # context parallel: every sequence split over cp ranks (S/cp tokens each)
    cp_mode: str = "ring"  # ring | allgather | a2a | hybrid (megalite/context/options.py)
    cp_a2a: int = 1  # hybrid: cp ranks per all-to-all group (parallel.cp_a2a); the ring is cp / cp_a2a long
    document_mask: bool = False  # data.document_mask: under cp the token ids are all-gathered once per forward
    ep: int = 1  # expert parallel: a MoE model's routed experts split over ep ranks of dp x cp

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "vpp", "ep", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, numbers.Integral) and int(value) >= 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer; pass "
                                  f"--{name.replace('_', '-')} 1 or more")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero={self.zero!r} is invalid; use 0, 1, 2 or 3")
        if self.dp * self.cp % self.ep:
            raise ConfigError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp}")
        if self.cp_mode not in ("ring", "allgather", "a2a", "hybrid"):
            raise ConfigError(f"cp_mode={self.cp_mode!r} is invalid; use ring, allgather, a2a or hybrid")
        if self.cp_mode == "hybrid" and (self.cp_a2a < 1 or self.cp % self.cp_a2a):
            raise ConfigError(f"cp_a2a={self.cp_a2a} must be >= 1 and divide cp={self.cp} (cp_mode=hybrid)")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"recompute={self.recompute!r} is invalid; use none, selective or full")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, dp x cp: gradients are reduced, and ZeRO shards, over them
        (each cp rank saw other tokens of the same sequences)."""
        return self.dp * self.cp

    def local_seq_len(self, seq_len: int) -> int:
        """Tokens of each sequence on one rank: S/cp (the zigzag split needs 2·cp equal chunks)."""
        if seq_len % (2 * self.cp) and self.cp > 1:
            raise ConfigError(f"seq_len {seq_len} is not divisible by 2 x cp = {2 * self.cp}: context parallelism "
                              f"cuts each sequence into 2·cp chunks; use a multiple of {2 * self.cp}")
        return seq_len // self.cp

    @property
    def num_microbatches(self) -> int:
        gbs = self.global_batch_size or self.micro_batch_size * self.dp
        per_step = self.micro_batch_size * self.dp
        if gbs % per_step:
            raise ConfigError(f"global batch {gbs} is not divisible by micro_batch_size x dp = "
                              f"{per_step}; change train.global_batch_size or train.micro_batch_size")
        return gbs // per_step


@dataclass(frozen=True)
class Hardware:
    """The device and links an estimate times a step on (None: not known, the step is not timed). Links default to
    each other: `inter_bytes_per_s` (PP / DP / embedding traffic), `intra_bytes_per_s` (TP, NVLink), the cp ring's
    `cp_bytes_per_s` (intra-node, where the rank order tp, cp, dp, pp puts it). `efficiency` x peak is the FLOP
    rate reached; FP8 GEMMs run at `fp8_peak_flops` instead of the BF16 `peak_flops`."""

    peak_flops: float | None = None
    inter_bytes_per_s: float | None = None
    intra_bytes_per_s: float | None = None
    cp_bytes_per_s: float | None = None
    efficiency: float = 1.0
    fp8_peak_flops: float | None = None


@dataclass(frozen=True)
class Precision:
    """Bytes per element. Default: the ZeRO paper's mixed-precision Adam, 2 param + 2 grad +
    K=12 (4 fp32 master + 8 moments), 16-bit activations (`Precision.paper`). megalite's own
    optimizer keeps fp32 gradients (`Precision.megalite`: 2 + 4 + 4 + 8 = 18 bytes/param in bf16)."""

    param: int = 2
    grad: int = 2
    master: int = 4
    optimizer: int = 8
    activation: int = 2
    grad_comm: int | None = None  # dtype gradients are reduced in; None: = grad
    # ZeRO-3 gradient reduce-scatter once per step (megalite: a full fp32 gradient buffer accumulates
    # the micro-batches) instead of once per micro-batch (the ZeRO paper's accounting).
    zero3_reduce_once: bool = False

    def __post_init__(self) -> None:
        for name in ("param", "grad", "master", "optimizer", "activation"):
            if getattr(self, name) < 0 or (name in ("param", "activation") and getattr(self, name) == 0):
                raise ConfigError(f"bytes per {name} element must be > 0 (master/optimizer >= 0)")

    @classmethod
    def paper(cls, dtype: str = "bf16") -> "Precision":
        """The ZeRO paper's layout (K = 12): 16-bit params and grads, fp32 master and Adam moments."""
        return cls.for_dtype(dtype)

    @classmethod
    def megalite(cls, dtype: str = "bf16") -> "Precision":
        """What megalite's ZeRO optimizer allocates (`megalite.optim.zero`): params in `dtype`, fp32
        main gradients (also reduced in fp32), fp32 master weights unless the params are fp32 already,
        fp32 Adam moments. bf16/fp16: 2 + 4 + 4 + 8 = 18 bytes/param before sharding; fp32: 16."""
        sizes = {"bf16": 2, "fp16": 2, "fp32": 4}
        if dtype not in sizes:
            raise ConfigError(f"dtype {dtype!r} is unknown; use bf16, fp16 or fp32")
        b = sizes[dtype]
        return cls(param=b, grad=4, master=0 if b == 4 else 4, optimizer=8, activation=b, grad_comm=4,
                   zero3_reduce_once=True)

    @classmethod
    def for_dtype(cls, dtype: str, param_dtype: str | None = None) -> "Precision":
        """`dtype` is the compute (activation) dtype; `param_dtype` what weights and grads are
        stored in (default: the same). fp32 weights with 16-bit compute (autocast-style, no separate
        master copy: 4 + 4 + 0 + 8 bytes) is how megalite's replicated optimizer trains."""
        sizes = {"bf16": 2, "fp16": 2, "fp32": 4}
        if dtype not in sizes or (param_dtype or dtype) not in sizes:
            raise ConfigError(f"dtype {dtype!r}/{param_dtype!r} is unknown; use bf16, fp16 or fp32")
        if sizes[param_dtype or dtype] == 4:
            return cls(param=4, grad=4, master=0, optimizer=8, activation=sizes[dtype])
        return cls(activation=sizes[dtype])

    @property
    def reduce_bytes(self) -> int:
        return self.grad if self.grad_comm is None else self.grad_comm
