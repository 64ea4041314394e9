"""Writes Megatron-LM checkpoints of two tiny GPTModels with megatron-core's own code, for
tests/test_interop_megatron.py (run in a subprocess: it initialises torch.distributed and patches CUDA-only calls).

    python tests/megatron_writer.py OUT [PORT]

OUT/llama: Llama-style (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied head). OUT/gpt2: GPT-2-style (LayerNorm
with bias, learned absolute positions, GeLU MLP with Megatron-LM's default bias-GeLU fusion, i.e. the tanh GeLU,
biases in every linear, tied head). For each model, in OUT/<model>/:

  torch_dist  `megatron.core.dist_checkpointing.save` of the model's sharded state dict with Megatron-LM's `args`
              and iteration in the common state (what Megatron-LM's save_checkpoint does for torch_dist);
  legacy      the same weights as Megatron-LM's legacy files at TP 2 x PP 2 (mp_rank_0T_00P/model_optim_rng.pt),
              split by Megatron's rules: query groups, [gate_r; up_r], row-parallel columns (their biases whole),
              vocab rows; layers renumbered per stage; a tied head's copy on the last stage, as Megatron keeps it;
  logits.pt   megatron-core's forward on fixed tokens.

Small CPU patches (megatron-core assumes CUDA for RNG forks, the causal mask, RoPE frequencies and a synchronize)
are the only changes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
from pathlib import Path

import numpy as np

# megatron-core wraps its fused kernels (bias-GeLU, SwiGLU, ...) in torch.compile: on CPU their first call compiles
# them through inductor for two tiny forwards (measured: ~1 CPU-second with the tests' OMP_NUM_THREADS=1, ~6 with
# 2 threads). Dynamo disabled, the same functions run eagerly; the logits came out bit-equal to the compiled ones
# (checked when this was added).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ = 512, 4, 32, 4, 2, 64, 12  # 512: the demo tokenizer's vocab
MAX_POS = 64


def megatron_args(gpt2: bool) -> argparse.Namespace:
    """The `args` Megatron-LM's argparse would have produced for the model (the fields the converter reads)."""
    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  padded_vocab_size=VOCAB, seq_length=MAX_POS, max_position_embeddings=MAX_POS, norm_epsilon=1e-5,
                  params_dtype=torch.float32, num_experts=None)
    if gpt2:
        return argparse.Namespace(**common, group_query_attention=False, normalization="LayerNorm", swiglu=False,
                                  position_embedding_type="learned_absolute", add_bias_linear=True,
                                  bias_gelu_fusion=True, openai_gelu=False, untie_embeddings_and_output_weights=False)
    return argparse.Namespace(**common, group_query_attention=True, num_query_groups=GROUPS, normalization="RMSNorm",
                              swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                              untie_embeddings_and_output_weights=True, rotary_base=10000)


def _split_legacy(sd: dict[str, torch.Tensor], tp: int, pp: int, gated: bool,
                  tied: bool) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {(t, p): {} for t in range(tp) for p in range(pp)}
    per = LAYERS // pp
    for key, v in sd.items():
        if v is None or "_extra_state" in key:
            continue
        if key.startswith("decoder.layers."):
            i, rest = key.split(".", 3)[2:]
            p, local = int(i) // per, int(i) % per
            key = f"decoder.layers.{local}.{rest}"
        else:
            p = 0 if key.startswith("embedding.") else pp - 1
        for t in range(tp):
            if key.endswith("mlp.linear_fc1.weight") and gated:
                gate, up = v.chunk(2)
                piece = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
            elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
                piece = v.chunk(tp, dim=1)[t]
            elif key.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                               "word_embeddings.weight", "output_layer.weight")):
                piece = v.chunk(tp)[t]  # qkv rows are whole query groups in order: a plain row split
            else:
                piece = v  # norms, position embeddings and the row-parallel biases are whole on every rank
            out[(t, p)][key] = piece.clone()
            if tied and key == "embedding.word_embeddings.weight" and pp > 1:  # the last stage's head copy
                out[(t, pp - 1)]["output_layer.weight"] = piece.clone()
    return out


def _model(gpt2: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    norm = "LayerNorm" if gpt2 else "RMSNorm"
    arch = (dict(num_query_groups=None, gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True,
                 bias_activation_fusion=True) if gpt2 else
            dict(num_query_groups=GROUPS, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False))
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                            use_cpu_initialization=True, normalization=norm, params_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1, **arch)  # type: ignore[arg-type]
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=norm), vocab_size=VOCAB, max_sequence_length=MAX_POS,
                     position_embedding_type="learned_absolute" if gpt2 else "rope",
                     share_embeddings_and_output_weights=gpt2).eval()
    if gpt2:  # biases and norm shifts start at zero: make them matter, so a dropped or misplaced one is seen
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.1)
    return model


def _write(model: torch.nn.Module, out: Path, gpt2: bool) -> None:
    from megatron.core import dist_checkpointing

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=mask)  # [b, s, vocab]
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits}, out / "logits.pt")
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    args = megatron_args(gpt2)
    args.model_type, args.attention_backend = ModelType.encoder_or_decoder, AttnBackend.auto  # as Megatron-LM's args
    root = out / "torch_dist"
    (root / "iter_0000005").mkdir(parents=True)
    sharded = model.sharded_state_dict()
    sharded.update(args=args, iteration=5)
    dist_checkpointing.save(sharded, str(root / "iter_0000005"))
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    legacy = out / "legacy" / "iter_0000005"
    for (t, p), part in _split_legacy(model.state_dict(), 2, 2, gated=not gpt2, tied=gpt2).items():
        (legacy / f"mp_rank_{t:02d}_{p:03d}").mkdir(parents=True)
        # What else Megatron-LM's save_checkpoint puts in the file (not converted, but it must be readable):
        # its RNG states (numpy's among them) and the optimizer and scheduler states.
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
        rest = {"rng_state": [rng], "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 5},
                "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}}}
        torch.save({"args": args, "iteration": 5, "checkpoint_version": 3.0, "model": part, **rest},
                   legacy / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt")
    (out / "legacy" / "latest_checkpointed_iteration.txt").write_text("5")


def main() -> int:
    out = Path(sys.argv[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[2] if len(sys.argv) > 2 and sys.argv[2].isdigit() else "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.initialize_model_parallel(1, 1)
    # CPU patches: megatron-core forks a CUDA RNG for dropout (0 here), and puts a few small tensors on CUDA.
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    for name, gpt2 in (("llama", False), ("gpt2", True)):
        torch.manual_seed(0)
        _write(_model(gpt2), out / name, gpt2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
