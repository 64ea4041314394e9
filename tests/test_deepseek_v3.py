"""The whole DeepSeek-V3 architecture (the `tiny-deepseek` preset: MLA with a low-rank query and v_head_dim != the
q/k head dim, YaRN, the group-limited sigmoid router with a shared expert and its correction bias moving, layer 0
dense, one MTP module whose block is MoE) trained at tp2 + SP, pp2, cp2, ep2 (ZeRO-1), dp2 ZeRO-2 and ZeRO-3, under
the blockwise FP8 recipe at dp2, and cp2 in the ring, allgather and a2a modes with document masking (hybrid needs cp 4: MLA's is
tests/test_mla_parallel.py's), against the single-process run: each step's loss, MTP loss and gradient norm, every
parameter after the steps, and the router biases. MTP under document masking is checked against each document run
alone (the last test). FP8 blockwise runs at dp2: at tp = cp = 1 no 128-block can
span two ranks whatever the widths, so the tiny widths (partial edge blocks) are a valid layout; the block recipes at
tp2 + SP on 128-multiple widths are tests/test_fp8_training.py's (and the ep2 expert GEMMs tests/test_fp8_moe.py's).

One rank function runs every layout in turn in one warm pool of 2 gloo ranks. Tolerances: tests/test_mtp.py's
(losses 1e-5, norms 1e-5 relative: the layouts sum the same terms in another order), parameters as PARAM_MAX says;
FP8: tests/test_fp8_training.py's block-recipe bounds (the first step as tightly, then rounding
flips of values within round-off of an fp8 midpoint let the runs drift, which its module doc measures).
"""

from __future__ import annotations

import torch

from megalite.config.presets import PRESETS, section_values
from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.fp8.enable import Fp8Settings, enable_fp8
from megalite.mla.config import MLAConfig
from megalite.model.gpt import GPT
from megalite.mtp.config import MTPConfig
from megalite.optim import build_distributed_optimizer
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import build_pipeline
from megalite.training.step import train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import ADAMW, HYPER, micro_batches, random_steps, reference_optimizer, step_context, tiny_train_cfg
from tests.test_cp_training import MICRO, local_batches
from tests.test_fp8_training import BLOCK_GRAD_RTOL, BLOCK_LOSS_ATOL, BLOCK_PARAM_MAX, BLOCK_PARAM_MEAN

STEPS, M, SEQ = 3, 2, 16  # MICRO: tests/test_cp_training.py's (local_batches cuts by it)
# Parameters after 3 AdamW steps at lr 1e-2 (module doc): Adam divides each update by its gradient's RMS, so an
# element whose gradient is near zero (an expert row few tokens reach) moves by up to ~lr whatever its size, and
# round-off in that gradient shows as a visible step difference (measured at most 2e-4 at tp2 + sp, 1.5e-4 at cp2,
# 3e-5 elsewhere; means 3e-7 or less). A systematic error (a wrong split or reduction) moves every element of a
# tensor by O(lr), so its mean exceeds PARAM_MEAN a hundredfold.
PARAM_MAX, PARAM_MEAN = 1e-3, 1e-6
PRESET = PRESETS["tiny-deepseek"]
MLA = MLAConfig(**section_values(PRESET, "mla"))
MTP = MTPConfig(**section_values(PRESET, "mtp"))
EOD = 3  # document masking: about one token in five ends a document (as tests/test_mla_parallel.py)
# (tp, pp, cp, ep, sp, zero, fp8 recipe, cp mode, document masking)
CASES = {"tp2+sp": (2, 1, 1, 1, True, 0, "", "ring", False), "pp2": (1, 2, 1, 1, False, 0, "", "ring", False),
         "cp2-ring-docs": (1, 1, 2, 1, False, 0, "", "ring", True),
         "cp2-allgather-docs": (1, 1, 2, 1, False, 0, "", "allgather", True),
         "cp2-a2a-docs": (1, 1, 2, 1, False, 0, "", "a2a", True), "cp2": (1, 1, 2, 1, False, 0, "", "ring", False),
         "ep2": (1, 1, 1, 2, False, 1, "", "ring", False), "dp2-zero2": (1, 1, 1, 1, False, 2, "", "ring", False),
         "dp2-zero3": (1, 1, 1, 1, False, 3, "", "ring", False),
         "dp2-fp8-blockwise": (1, 1, 1, 1, False, 1, "blockwise", "ring", False)}


def tiny_deepseek_cfg(**over: object):
    """The preset's model section at a test's sequence length, the bias moving, no z-loss."""
    model = {k: v for k, v in section_values(PRESET).items() if k != "seq_len"}
    moe = {f"moe_{k}": v for k, v in section_values(PRESET, "moe").items()}
    return tiny_moe_cfg(**{**model, **moe, "seq_len": SEQ, "moe_bias_rate": 0.01, "moe_aux_loss": 0.0,
                           "moe_z_loss": 0.0, "kernels": "torch", "mla": MLA, "mtp": MTP, **over})


HYBRID = {"cp4-hybrid-docs": (1, 1, 4, 1, False, 0, "", "hybrid", True)}


def _check(rank: int, case: str) -> None:
    tp, pp, cp, ep, sp, zero, recipe, mode, docs = {**CASES, **HYBRID}[case]
    st = moe_layout(tp=tp, pp=pp, cp=cp, ep=ep, sp=sp)
    cfg = tiny_deepseek_cfg(num_layers=2 * pp)  # layer 0 dense, the rest (and the MTP block) MoE
    fp8 = Fp8Settings(recipe, 16) if recipe else None  # every block linear in FP8 (smallest dim 16), not the head
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    if docs:
        data = [torch.where(d % 5 == 0, EOD, d) for d in data]
    context = ContextOptions.of(mode, EOD if docs else None, a2a_degree=2 if mode == "hybrid" else 1)
    ref = GPT(cfg, ParallelState(), seed=5, context=context)
    if fp8 is not None:
        assert enable_fp8([ref], fp8, ParallelState())
    ref_ctx = step_context(ref, ParallelState(), torch.float32, tiny_train_cfg(STEPS))
    ref_opt = reference_optimizer(ref, ParallelState())
    want = [train_step(ref_ctx, ref_opt, micro_batches(d, MICRO), i) for i, d in enumerate(data)]
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32, context=context)
    if fp8 is not None:
        enable_fp8(engine.chunks, fp8, st)
    model = engine.chunks[0]
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(STEPS))
    got = [train_step(ctx, opt, local_batches(d, st), i) for i, d in enumerate(data)]
    for i, (g, w) in enumerate(zip(got, want)):
        loss_atol, rtol = (BLOCK_LOSS_ATOL, BLOCK_GRAD_RTOL) if fp8 is not None and i > 0 else (1e-5, 1e-5)
        assert abs(g.loss - w.loss) <= loss_atol, f"{case}: step {i} loss {g.loss} != single-process {w.loss}"
        assert g.mtp is not None and w.mtp is not None and len(g.mtp) == 1, case
        assert abs(g.mtp[0] - w.mtp[0]) <= loss_atol, f"{case}: step {i} MTP loss {g.mtp} != {w.mtp}"
        assert abs(g.grad_norm - w.grad_norm) <= rtol * w.grad_norm, f"{case}: step {i} norm"
    ref_params = dict(ref.named_parameters())
    specs = named_param_specs(model, ConfigError)
    diffs = {}
    for name, value in opt.full_parameters().items():
        want_p = ref_params["embedding.weight" if name == "mtp.embedding.weight" else name].detach()
        if specs[name].grads == EXPERT_PARALLEL:  # this ep rank's experts
            n = want_p.shape[0] // st.size("ep")
            want_p = want_p[st.rank_in("ep") * n:(st.rank_in("ep") + 1) * n]
        diffs[name] = (unshard(value, specs[name].layout, st) - want_p).abs()
    worst = max(diffs, key=lambda k: diffs[k].max().item())
    mean = torch.cat([d.flatten() for d in diffs.values()]).mean().item()
    most, avg = (BLOCK_PARAM_MAX, BLOCK_PARAM_MEAN) if fp8 is not None else (PARAM_MAX, PARAM_MEAN)
    assert diffs[worst].max() <= most and mean <= avg, f"{case}: {worst} off by {diffs[worst].max():.2e} after {STEPS} steps"
    ref_buffers = dict(ref.named_buffers())
    for name, buf in model.named_buffers():  # the aux-loss-free biases follow the global expert loads
        if name.endswith("router.bias"):
            assert torch.allclose(buf, ref_buffers[name], atol=0 if fp8 is None else 0.02), f"{case}: {name}"


def _all_cases(rank: int) -> None:
    for case in CASES:
        _check(rank, case)


def _hybrid(rank: int) -> None:
    # hybrid needs cp >= 4 (all-to-all inside pairs, the ring across them): its own 4-rank pool, one case
    _check(rank, "cp4-hybrid-docs")


def test_tiny_deepseek_v3_trains_as_one_process_at_every_layout(dist_world) -> None:
    dist_world(2).run(_all_cases)


def test_tiny_deepseek_v3_trains_as_one_process_at_cp4_hybrid(dist_world) -> None:
    dist_world(4).run(_hybrid)


def test_presets_set_the_mla_and_mtp_sections() -> None:
    """A preset's tables set other sections (under the file's and the command line's values, as its model
    ones); deepseek-v3 is the released architecture (its HF config: MLA widths, YaRN, one MTP module)."""
    from megalite.config import parse_args

    cfg = parse_args(["--model.preset", "deepseek-v3"])
    assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.qk_nope_head_dim,
            cfg.mla.v_head_dim) == (512, 1536, 64, 128, 128)
    m = cfg.model
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_positions, m.rope_beta_fast, m.rope_beta_slow,
            m.rope_mscale, m.rope_mscale_all_dim) == ("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert cfg.mtp.num_layers == 1 and (cfg.moe.groups, cfg.moe.group_top_k, cfg.moe.router) == (8, 4, "deepseek")
    cfg = parse_args(["--model.preset", "tiny-deepseek", "--mla.kv_lora_rank", "64", "--mtp.num_layers", "2"])
    assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.mtp.num_layers) == (64, 48, 2)  # flags beat the preset
    assert parse_args([]).mla.kv_lora_rank == 0  # the default preset sets no other section


def test_mtp_under_document_masking_equals_each_document_alone() -> None:
    """Two documents packed in one sequence with document masking give the per-token main losses and the MTP loss
    that each document run alone gives: depth k's positions whose token k ahead lies in the next document carry no
    label (a document's EOD keeps its label, as in the main model), and the MTP block attends within documents."""
    cfg = tiny_deepseek_cfg(num_layers=2)
    tokens = torch.randint(4, cfg.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(9))
    tokens[0, 6] = EOD  # document A: positions 0..6 (its EOD last), document B: 7..15
    packed = GPT(cfg, ParallelState(), seed=5, context=ContextOptions.of("ring", EOD)).train()
    alone = GPT(cfg, ParallelState(), seed=5).train()  # the same weights (seed and names)
    got = packed(tokens[:, :-1], tokens[:, 1:])
    assert packed.mtp is not None and alone.mtp is not None
    want, sums, counts = [], 0.0, 0
    for lo, hi in ((0, 7), (7, SEQ)):
        alone.mtp.reset()
        want.append(alone(tokens[:, lo:hi], tokens[:, lo + 1:hi + 1]))
        n = hi - lo - 1  # labelled MTP positions of the document alone: all but its last
        sums, counts = sums + alone.mtp.sums[0] * n, counts + n
    # fp32, the same products over fewer keys (masked ones add exact zeros): round-off only.
    torch.testing.assert_close(got, torch.cat(want, dim=1), atol=1e-5, rtol=0)
    assert abs(packed.mtp.sums[0] - sums / counts) <= 1e-5, (packed.mtp.sums, sums / counts)
