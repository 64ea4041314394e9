"""One typed, frozen spec per parameter: how it is cut over TP and how its gradient is treated.

The layer that creates a parameter declares it (`param_specs()`, by attribute name); the model adds
what only it knows (the learned positions it owns, the roles of a tied embedding's two pipeline
copies). Everyone who must know how a parameter is laid out asks `spec_table` / `named_param_specs`:
the optimizers (gradient norm: count TP-replicated parameters once; the SP-partial TP reduction; the
tied-embedding sum), the checkpoint (who writes which slice) and `sharding.unshard`. A parameter
without a spec is an error that names it, never a silent "replicated": a new layer that forgets to
declare its weights fails when the optimizer is built or a checkpoint is saved, instead of quietly
breaking the gradient norm or the saved file.

Why specs are declared by modules and looked up by parameter *name* on demand (not set as attributes
on the tensors, nor kept in a map keyed by tensor identity built once at construction):
  - the module tree and its names survive everything that happens to a parameter after construction:
    `model.to(dtype)` (which may replace the parameter objects, see torch's
    `swap_module_params_on_conversion`), `nn.ModuleList(chunks)` for interleaved pipelines (names get
    a "0." prefix: `declared_specs` prefixes the chunk's declarations the same way), and ZeRO's
    flattening (which repoints `p.data` into flat buffers);
  - a tied embedding/head is one parameter registered under two names; `named_parameters()` lists it
    once, under the name it was first registered with (`embedding.weight`), so its spec is the
    embedding's, not the head's: no conflict to resolve.
A reader that needs per-tensor lookups calls `spec_table` once (an identity map over the parameters
as they are at that moment).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal, Mapping, Protocol, runtime_checkable

import torch.nn as nn

from megalite.errors import MegaliteError
from megalite.parallel.state import GroupKind

LayoutKind = Literal["replicated", "column", "row", "vocab"]


@dataclass(frozen=True)
class TPLayout:
    """How a parameter is split over the TP ranks (Megatron-LM, Shoeybi et al. 2019, section 3).

      replicated  every TP rank holds the whole tensor
      column      dim 0 is split; the tensor is the concatenation of `parts` logical matrices (e.g. q, k, v),
                  each split separately, so [q_i; k_i; v_i] is rank i's shard
      row         dim 1 (the input features) is split
      vocab       dim 0 of the padded vocabulary is split in contiguous blocks (`layers.embedding`)
    """

    kind: LayoutKind
    parts: tuple[int, ...] = ()  # column only: the logical output sizes fused along dim 0

    def __post_init__(self) -> None:
        if (self.kind == "column") != bool(self.parts):
            raise ValueError(f"TPLayout {self.kind!r} with parts {self.parts}: column layouts (only) need parts")

    @property
    def split(self) -> bool:
        """Each TP rank holds a different piece (the full tensor is tp times the local one)."""
        return self.kind != "replicated"


REPLICATED = TPLayout("replicated")
ROW = TPLayout("row")
VOCAB = TPLayout("vocab")


def column(parts: tuple[int, ...] | list[int]) -> TPLayout:
    """A column-parallel layout fusing logical outputs of sizes `parts` (full, unsplit sizes)."""
    return TPLayout("column", tuple(int(p) for p in parts))


class Tied(enum.Enum):
    """A tied input/output embedding split over pipeline stages (Megatron-LM): the first stage holds
    the embedding, the last stage a copy as its head, and their gradients are summed over the
    "embedding" group every step so both copies take the same update. (Tied within one stage, the
    embedding and head are one parameter: `NONE`.)"""

    NONE = "none"
    EMBEDDING = "embedding"  # the first stage's embedding, whose twin is the last stage's head
    HEAD_COPY = "head_copy"  # the last stage's copy: counted in the gradient norm and saved only as the embedding


@dataclass(frozen=True)
class GradReduction:
    """How a parameter's gradient is reduced over the data-parallel ranks and counted in the global norm: the
    data side of a `ParamSpec`, as `TPLayout` is its tensor-parallel side. Code outside `parallel/` reads
    these fields and never names a group of its own.

      group       the ranks holding the same values: the gradient is summed over them and ZeRO shards the
                  states over them (the gradient sync never puts two groups into one bucket)
      split_over  the ranks (beyond TP's layout) holding *other* rows, along dim 0, of the same logical
                  tensor, or None: their squared norms add, the parameter count and a checkpoint's global
                  tensor are that many times the local rows
      mean        the group whose size the sum is divided by (None: `group`'s, the plain average)
      whole       `group` and `split_over` together (None: `group`): the ranks whose ZeRO shards hold every
                  element of the logical tensor once between them
    """

    group: GroupKind = "dp_cp"
    split_over: GroupKind | None = None
    mean: GroupKind | None = None
    whole: GroupKind | None = None

    @property
    def divisor_group(self) -> GroupKind:
        """The group whose size the summed gradient is divided by."""
        return self.mean or self.group

    def norm_group(self, sharded: bool) -> GroupKind | None:
        """The ranks over which the squared norms of such gradients add up to distinct parts of the model
        (None: this rank's alone, the others hold the same). `sharded` (ZeRO >= 1): each rank of `whole`
        holds its own 1/N; unsharded, only the `split_over` ranks hold other elements."""
        return (self.whole or self.group) if sharded else self.split_over


# Every dense weight: summed over dp x cp (the cp ranks saw other tokens of the same sequences) and averaged.
DATA_PARALLEL = GradReduction()
# Mixture-of-experts weights (`megalite.moe.experts`): rank ep_rank holds experts [ep_rank * E/ep, ...) of the
# layer, and the 'edp' ranks (the rest of dp x cp) the same ones. Each rank's loss is the mean over its own
# tokens, so the global-token mean is the sum over the dp x cp ranks / (dp x cp); an expert's gradient already
# holds the tokens of every ep rank (the dispatch all-to-all's backward), so its sum over edp covers all dp x cp
# ranks and takes the same divisor (the edp size would make expert gradients ep times too large).
EXPERT_PARALLEL = GradReduction(group="edp", split_over="ep", mean="dp_cp", whole="dp_cp")


@dataclass(frozen=True)
class MatrixStack:
    """A parameter [n, rows, cols] that is n whole matrices stacked along dim 0 (the MoE experts: one per
    expert, each replicated over tp), not one tensor; each matrix's rows fuse the logical matrices of sizes
    `rows` (an expert's gate and up). An optimizer that treats matrices as matrices (Muon) takes each on its
    own; the FP8 filter decides on their logical sizes."""

    rows: tuple[int, ...]

    def dims(self, cols: int) -> list[int]:
        """Every logical size of one matrix (its row parts, then `cols`)."""
        return [*self.rows, cols]


@dataclass(frozen=True)
class ParamSpec:
    """Everything the optimizer and the checkpoint need to know about one parameter."""

    layout: TPLayout
    # Replicated over TP, but under sequence parallelism each TP rank saw 1/tp of the sequence, so its
    # gradient is a partial sum to be all-reduced over TP (Korthikanti et al. 2022).
    sp_partial: bool = False
    tied: Tied = Tied.NONE
    # How the gradient is reduced over the data-parallel ranks and counted in the norm (`GradReduction`).
    grads: GradReduction = DATA_PARALLEL
    # A stack of whole matrices along dim 0 (the MoE experts), not one tensor (`MatrixStack`), or None.
    stack: MatrixStack | None = None
    # False for a 2-D parameter that is no linear map (a depthwise conv's kernel [channels, width]): Muon, which
    # orthogonalises matrices, leaves it to AdamW.
    matrix: bool = True

    @property
    def grad_group(self) -> GroupKind:
        """The ranks this parameter's gradient is summed over and ZeRO shards its states over."""
        return self.grads.group

    @property
    def pipeline_tied(self) -> bool:
        """One of a tied embedding's two pipeline copies: gradients summed over the embedding group."""
        return self.tied is not Tied.NONE


@runtime_checkable
class DeclaresParamSpecs(Protocol):
    """A module that declares the specs of the parameters under it, by name relative to itself."""

    def param_specs(self) -> Mapping[str, ParamSpec]: ...


_CHUNK_PREFIX = re.compile(r"^\d+\.")


def logical_name(name: str) -> str:
    """A parameter's global name: `name` without the "0." / "1." chunk prefix `nn.ModuleList(chunks)` adds
    under interleaved pipelines (the name checkpoints, optimizer states and the reference use)."""
    return _CHUNK_PREFIX.sub("", name, count=1)


def declared_specs(module: nn.Module) -> dict[str, ParamSpec]:
    """Specs by parameter name relative to `module`: its own declaration when it makes one, else its
    children's, prefixed with the child's name. (A tied parameter may appear under both names.)"""
    if isinstance(module, DeclaresParamSpecs):
        return dict(module.param_specs())
    return children_specs(module)


def children_specs(module: nn.Module) -> dict[str, ParamSpec]:
    """The declarations of `module`'s children, prefixed (for a model that adds its own on top)."""
    out: dict[str, ParamSpec] = {}
    for child_name, child in module.named_children():
        for name, spec in declared_specs(child).items():
            out[f"{child_name}.{name}"] = spec
    return out


def named_param_specs(model: nn.Module, error: type[MegaliteError]) -> dict[str, ParamSpec]:
    """Every parameter's spec, by the name `model.named_parameters()` gives it; raises `error`, naming
    every parameter that has none."""
    declared = declared_specs(model)
    names = [name for name, _ in model.named_parameters()]
    missing = [name for name in names if name not in declared]
    if missing:
        raise error(f"parameter{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {type(model).__name__} "
                    "ha{} no ParamSpec: the layer that creates a parameter must declare its TP layout in "
                    "`param_specs()` (megalite.parallel.param_spec)".format("ve" if len(missing) > 1 else "s"))
    return {name: declared[name] for name in names}


def spec_table(model: nn.Module, error: type[MegaliteError]) -> dict[nn.Parameter, ParamSpec]:
    """Every parameter of `model` (each once) -> its spec; raises `error` as `named_param_specs` does."""
    specs = named_param_specs(model, error)
    return {p: specs[name] for name, p in model.named_parameters()}
