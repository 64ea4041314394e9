"""The GPT: embedding -> blocks -> final norm -> vocab-parallel head and loss.

Built for a slice of layers so a pipeline stage holds only its own: `layers` are global layer
indices, the embedding lives on the stage with `pre_process`, the final norm, head and loss on the
stage with `post_process`. Parameter names (and so init and checkpoints) use global layer indices
and do not depend on tp/pp: see `megalite.layers.init`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megalite.context.options import ContextOptions
from megalite.context.zigzag import zigzag_merge, zigzag_positions, zigzag_split
from megalite.context.documents import DocumentIds, Documents, documents
from megalite.errors import ConfigError
from megalite.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from megalite.layers.init import full_normal
from megalite.layers.linear import ColumnParallelLinear
from megalite.model.block import Block, BlockFeatures, Norm, mlp_activation
from megalite.model.layer_rope import LayerRope, RopeKey
from megalite.model.pattern import layer_spec
from megalite.mla.attention import MLAContext
from megalite.model.ops import TORCH_OPS, get_ops, masked_attention, resolve_kernels
from megalite.model.rope import RopeScaling, rope_tables, softmax_scale_factor
from megalite.model.spec import ModelSpec, head_dim
from megalite.moe.layer import MoEContext
from megalite.moe.losses import AuxScale
from megalite.moe.settings import moe_layers, moe_settings
from megalite.mtp.config import MTPConfig
from megalite.mtp.module import MTPDepth, MultiTokenPrediction
from megalite.parallel import comm
from megalite.parallel.param_spec import REPLICATED, ParamSpec, Tied, children_specs, spec_table
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState


class GPT(nn.Module):
    """A GPT stage. `forward(ids, labels)` returns the per-token loss [B, S] on the last stage (fp32),
    else the hidden states to send to the next stage."""

    def __init__(self, cfg: ModelSpec, state: ParallelState, seed: int, rng: RNGStreams | None = None,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                 context: ContextOptions = ContextOptions()) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (from the tokenizer) before building the model")
        self.cfg, self.state = cfg, state
        self.document_eod = context.document_eod
        self.ops = get_ops(resolve_kernels(cfg.kernels, state.device))
        self.rng = rng or RNGStreams(seed, state)
        self.layer_ids = layers if layers is not None else range(cfg.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, state.tp, cfg.make_vocab_divisible_by)
        h = cfg.hidden_size
        self.embedding: VocabParallelEmbedding | None = None
        self.position: nn.Parameter | None = None
        if pre_process:
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, self.padded_vocab, h, state,
                                                    name="embedding", seed=seed, std=cfg.init_std)
            if cfg.arch == "gpt2":
                self.position = nn.Parameter(full_normal((cfg.seq_len, h), cfg.init_std, seed, "position"))
        resolved_moe = moe_settings(cfg)
        self.aux_scale = AuxScale()
        moe = (MoEContext(resolved_moe, self.aux_scale, len(cfg.moe.layers(cfg.num_layers)), mlp_activation(cfg),
                          bool(cfg.mlp_bias)) if resolved_moe is not None else None)
        mla = cfg.mla
        self.mla = mla if mla.enabled else None  # recorded by checkpoints (`model_info`)
        rope = RopeScaling.of(cfg)
        # Multi-head latent attention (`[mla]`, megalite/mla) in every block when mla.kv_lora_rank > 0.
        latent = MLAContext(mla, softmax_scale_factor(rope), TORCH_OPS, masked_attention) if mla.enabled else None
        features = BlockFeatures(moe, latent)
        self.layers = nn.ModuleDict({str(i): Block(cfg, state, self.ops, self.rng, i, seed, context, features)
                                     for i in self.layer_ids})
        mtp = cfg.mtp
        self.mtp_depth = mtp.num_layers  # multi-token prediction (megalite/mtp)
        self._context, self._features = context, features
        self.final_norm: Norm | None = None
        self.head: ColumnParallelLinear | None = None
        if post_process:
            self.final_norm = Norm(h, cfg.arch, cfg.norm_eps, state, self.ops)
            self.head = ColumnParallelLinear(h, [self.padded_vocab], state, name="head", seed=seed,
                                             std=cfg.init_std)
            if cfg.tie_embeddings and self.embedding is not None:
                self.head.weight = self.embedding.weight  # same [V/tp, h] shard: one parameter
            elif cfg.tie_embeddings:
                # Pipeline: the head is on the last stage, the embedding on the first. The head starts as
                # an exact copy and their gradients are summed over the embedding group every step.
                twin = VocabParallelEmbedding(cfg.vocab_size, self.padded_vocab, h, state, name="embedding",
                                              seed=seed, std=cfg.init_std)
                with torch.no_grad():
                    self.head.weight.copy_(twin.weight)
        self.mtp: MultiTokenPrediction | None = None
        if post_process and mtp.num_layers > 0:
            self.mtp = self._build_mtp(mtp, seed)
        rope_dim = latent.config.qk_rope_head_dim if latent is not None else head_dim(cfg)
        cos, sin = rope_tables(cfg.seq_len, rope_dim, cfg.rope_theta, rope)
        # Document masking indexes the whole tables by each token's position in its document.
        self.cos_full: torch.Tensor
        self.sin_full: torch.Tensor
        if self.document_eod is not None:
            self.register_buffer("cos_full", cos, persistent=False)
            self.register_buffer("sin_full", sin, persistent=False)
        # Context parallelism: this rank holds the tokens at `positions` (its zigzag split) of every
        # sequence, from embedding to loss; RoPE and learned positions are indexed there.
        positions = zigzag_positions(cfg.seq_len, state.cp, state.cp_rank) if state.cp > 1 else None
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        self.positions: torch.Tensor | None
        self.register_buffer("positions", positions, persistent=False)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # Layers whose RoPE differs (the layer pattern: another base, partial RoPE) read their own tables.
        self.rope_keys: dict[str, RopeKey] = {}
        if latent is None and cfg.arch == "llama":
            for i in self.layer_ids:
                spec = layer_spec(cfg, i)
                key = (spec.rope_theta, spec.rotary_dim(rope_dim))
                if key[1] and key != (cfg.rope_theta, rope_dim):
                    self.rope_keys[str(i)] = key
        self.layer_rope = LayerRope(sorted(set(self.rope_keys.values())), cfg.seq_len, rope, positions,
                                    self.document_eod is not None)

    def _build_mtp(self, mtp: MTPConfig, seed: int) -> MultiTokenPrediction:
        """The MTP modules (megalite/mtp), depth k's block built as global layer num_layers + k - 1 (its init
        name and whether it is a MoE layer); on a stage without the embedding, the embedding they read: the tied
        head, or a copy of the first stage's embedding (summed over the 'embedding' group like a tied one)."""
        cfg, h, st = self.cfg, self.cfg.hidden_size, self.state

        def norm() -> Norm:
            return Norm(h, cfg.arch, cfg.norm_eps, st, self.ops)
        depths = [MTPDepth(h, norm, Block(cfg, st, self.ops, self.rng, cfg.num_layers + k, seed, self._context,
                                          self._features), st, f"mtp.layers.{k}", seed, cfg.init_std)
                  for k in range(mtp.num_layers)]
        copy = None
        if self.embedding is None:
            copy = VocabParallelEmbedding(cfg.vocab_size, self.padded_vocab, h, st, name="embedding", seed=seed,
                                          std=cfg.init_std)
            if cfg.tie_embeddings and self.head is not None:
                copy.weight = self.head.weight  # the tied head is already the embedding's copy: one parameter
        return MultiTokenPrediction(depths, mtp.loss_weight, st, copy)

    def _shares_embedding(self) -> bool:
        """The embedding has a copy on the last stage: a tied head there, or the MTP modules' input embedding."""
        return bool(self.cfg.tie_embeddings) or self.mtp_depth > 0

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter's spec (`megalite.parallel.param_spec`): the layers' own declarations, plus the
        learned positions and the pipeline roles of a shared embedding, which only the model knows."""
        specs = children_specs(self)
        if self.position is not None:  # replicated, added to each rank's 1/tp of the sequence under SP
            specs["position"] = ParamSpec(REPLICATED, sp_partial=self.state.sp)
        if self._shares_embedding() and self.embedding is not None and not self.post_process:
            specs["embedding.weight"] = replace(specs["embedding.weight"], tied=Tied.EMBEDDING)
        if self.cfg.tie_embeddings and self.head is not None and self.embedding is None:
            specs["head.weight"] = replace(specs["head.weight"], tied=Tied.HEAD_COPY)
        if self.mtp is not None and self.mtp.embedding is not None:
            specs["mtp.embedding.weight"] = replace(specs["mtp.embedding.weight"], tied=Tied.HEAD_COPY)
        return specs

    def set_aux_loss_scale(self, scale: float) -> None:
        """`megalite.moe.losses.ScalesAuxLoss`: the factor on this micro-batch's loss, for the router losses."""
        self.aux_scale.value = scale

    def units(self) -> list[nn.Module]:
        """The units this stage is made of (`megalite.parallel.units`): its transformer blocks, in order."""
        return list(self.layers.values()) + (list(self.mtp.layers) if self.mtp is not None else [])

    def moe_layer_names(self) -> list[str]:
        """The names of every MoE layer of the whole model, any stage's (`megalite.moe.step_metrics`)."""
        s = moe_settings(self.cfg)
        mtp = [f"mtp.layers.{k}.block" for k in range(self.mtp_depth)
               if s is not None and s.is_moe_layer(self.cfg.num_layers + k)]
        return [f"layers.{i}" for i in moe_layers(self.cfg)] + mtp

    def local_seq_len(self) -> int:
        """Tokens of each sequence this rank holds: seq_len / cp (its zigzag split) under context parallelism."""
        return self.cfg.seq_len // self.state.cp

    def embed(self, ids: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        assert self.embedding is not None
        if self.positions is not None and ids.shape[1] != self.local_seq_len():
            raise ValueError(f"context parallel: got {ids.shape[1]} tokens per sequence, expected this rank's "
                             f"zigzag split of seq_len {self.cfg.seq_len}: {self.local_seq_len()}")
        x = self.embedding(ids)  # [B, S/tp, H] under SP (reduce-scattered), else [B, S, H]
        x = self.scale_embedding(x)
        if self.position is not None:
            if docs is not None:  # positions restart at each document: [B, S, H]
                rows, seq_dim = self.position[docs.positions], 1
            else:
                seq_dim = 0
                rows = self.position[: ids.shape[1]] if self.positions is None else self.position[self.positions]
            pos = rows.to(x.dtype)
            x = x + (comm.split(pos, self.state, "tp", dim=seq_dim) if self.state.sp else pos)
        return self.rng.dropout(x, self.cfg.dropout, self.training, tp_local=self.state.sp)

    def scale_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden) with model.embed_scale (Gemma), else as they are."""
        return x * (self.cfg.hidden_size ** 0.5) if self.cfg.embed_scale else x

    def rope_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `name`'s RoPE tables at every position (cp = 1: the KV-cached decoder)."""
        key = self.rope_keys.get(name)
        return self.layer_rope.whole(key) if key is not None else (self.cos, self.sin)

    def _documents(self, ids: torch.Tensor | None) -> tuple[Documents | None, DocumentIds | None]:
        """Document masking: this rank's tokens' documents and positions, and the document ids attention
        needs. Under context parallelism the documents are those of the whole sequence: the cp ranks all-gather
        their token ids first (int64, b·S/cp each, counted under 'cp'). Every pipeline stage reads the ids (the
        engine gives them to each chunk)."""
        if self.document_eod is None:
            return None, None
        if ids is None:
            raise ValueError("data.document_mask: every pipeline stage needs the token ids")
        cp, rank = self.state.cp, self.state.cp_rank
        whole = ids if cp == 1 else zigzag_merge(list(comm.all_gather(ids.contiguous(), self.state, "cp", dim=0)
                                                      .chunk(cp, dim=0)))
        full = documents(whole, self.document_eod)
        if cp == 1:
            return full, DocumentIds(full.ids, full.ids)
        local = Documents(zigzag_split(full.ids, cp, rank), zigzag_split(full.positions, cp, rank))
        return local, DocumentIds(local.ids, full.ids)

    def _replayable(self, block: nn.Module):
        """Wrap a block for full recompute so the recomputation draws the same dropout masks.

        torch's checkpoint restores the global generators, not megalite's dropout streams (explicit
        generators, see `megalite.parallel.random`): remember their states at the first call and replay
        from them on the recompute, then put back whatever states the streams had reached meanwhile."""
        start, calls = self.rng.state_dict(), [0]

        def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: DocumentIds | None = None) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 1:
                return block(x, cos, sin, docs)
            now = self.rng.state_dict()
            self.rng.load_state_dict(start)
            try:
                return block(x, cos, sin, docs)
            finally:
                self.rng.load_state_dict(now)

        return run

    def forward(self, ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        docs, doc_ids = self._documents(ids)
        cos, sin = (self.cos, self.sin) if docs is None else (self.cos_full[docs.positions],
                                                              self.sin_full[docs.positions])
        if self.pre_process:
            assert ids is not None, "the first pipeline stage needs the token ids"
            x = self.embed(ids, docs).to(dtype)
        else:
            assert hidden is not None, "a non-first pipeline stage needs the hidden states from the previous stage"
            x = hidden
        tables = self.layer_rope.tables(None if docs is None else docs.positions)
        for name, block in self.layers.items():
            c, s = tables[self.rope_keys[name]] if name in self.rope_keys else (cos, sin)
            if self.cfg.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(self._replayable(block), x, c, s, doc_ids, use_reentrant=False)
            else:
                x = block(x, c, s, doc_ids)
        if not self.post_process:
            return x
        assert self.final_norm is not None and self.head is not None
        if labels is not None and self.mtp is not None and self.training and torch.is_grad_enabled():
            assert ids is not None, "multi-token prediction needs the token ids on the last stage"
            depths = self.mtp.hidden(x, ids, labels, self._mtp_embed, cos, sin, doc_ids, self.document_eod)
            losses = self._head_loss([self.final_norm(x), *(h for h, _ in depths)], [labels, *(t for _, t in depths)])
            return self.mtp.add_loss(losses[0], losses[1:], [t for _, t in depths], self.aux_scale.value)
        logits = self.logits(self.final_norm(x))  # [B, S, V/tp]: never gathered
        if labels is None:
            return logits
        return self._token_loss(logits, labels)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the output logits, soft-capped by model.final_softcap (Gemma 2:
        c tanh(logits / c), elementwise, so it holds on vocab-parallel columns as on whole rows)."""
        assert self.head is not None
        (logits,) = self.head(normed)
        cap = self.cfg.final_softcap
        return logits if not cap else cap * torch.tanh(logits / cap)

    def _token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = labels.shape
        return self._loss(logits.reshape(b * s, -1), labels.reshape(-1)).view(b, s)

    def _mtp_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding on the last stage (no dropout, no learned positions: DeepSeek-V3's MTP input)."""
        embedding = self.embedding if self.embedding is not None else self.mtp.embedding if self.mtp else None
        assert embedding is not None
        return embedding(ids)

    def _head_loss(self, hidden: list[torch.Tensor], labels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token losses [B, S'] of normed hidden states (the main model's and each MTP depth's) through one
        call of the shared output head on them stacked along the batch."""
        assert self.head is not None
        logits = self.logits(torch.cat(hidden))
        return list(self._token_loss(logits, torch.cat(labels)).chunk(len(hidden)))

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross-entropy from the backend's ops (the logits are never gathered)."""
        return self.ops.cross_entropy(logits, labels, self.state, self.cfg.vocab_size)


def count_parameters(model: nn.Module, state: ParallelState) -> int:
    """Parameters of the *whole* model on this stage (TP shards counted at full size, padding excluded
    from neither: the padded vocab rows are real memory). Each shared parameter counted once; a parameter
    split along dim 0 over other ranks too (`GradReduction.split_over`: MoE experts over ep) at full size."""
    specs = spec_table(model, ConfigError)
    return sum(p.numel() * (state.tp if spec.layout.split else 1)
               * (state.size(spec.grads.split_over) if spec.grads.split_over else 1) for p, spec in specs.items())
