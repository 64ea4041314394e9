"""Multi-token prediction (DeepSeek-V3, Liu et al. 2024, section 2.2) against a reference written from the paper,
and at tp2 + SP, pp2, cp2, dp2 with ZeRO-3 and ep2 (a MoE block in the MTP module) against one process.

The reference truncates as the paper does (depth k runs on the first S - k positions: h'_i from h^{k-1}_i and
Emb(t_{i+k})); the model rolls the tokens and masks the last k positions instead, so equality also shows the
rolled tail never reaches a labelled position. Tolerances: fp32; the reference is the same products written
out (RMSNorm by hand), 1e-5 on losses and 1e-5 absolute on gradients of O(1e-2) values. The layouts: as
tests/test_moe_ep.py (the module doc there): losses 1e-5 absolute, norms 1e-5 relative, parameters after 3
steps at lr 1e-2 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megalite.context.options import ContextOptions
from megalite.data.sampler import cp_split
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.mtp.config import MTPConfig
from megalite.optim import build_distributed_optimizer
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import (ADAMW, HYPER, with_sections, layout, micro_batches, random_steps, reference_optimizer, step_context,
                                  tiny_model_cfg, train_steps)

SEQ, D, LAMBDA = 16, 2, 0.3
MTP = MTPConfig(num_layers=D, loss_weight=LAMBDA)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_loss(model: GPT, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """L_Main + lambda / D sum_k L_MTP^k (eq. 21-25), each L the mean cross-entropy over its labelled positions."""
    assert model.embedding is not None and model.head is not None and model.final_norm is not None
    assert model.mtp is not None
    v, eps = model.cfg.vocab_size, model.cfg.norm_eps
    x = model.embedding(ids)
    for block in model.layers.values():
        x = block(x, model.cos, model.sin)
    head = model.head.weight

    def ce(h: torch.Tensor, norm_w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = (_rms(h, norm_w, eps) @ head.t())[..., :v]
        return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))

    main = ce(x, model.final_norm.weight, labels)
    h, s, losses = x, ids.shape[1], []
    for k in range(1, D + 1):
        m = model.mtp.layers[k - 1]
        t = s - k                                           # positions with a token k+1 ahead
        emb = F.embedding(ids[:, k:], model.embedding.weight)  # Emb(t_{i+k}), i < t
        h = torch.cat([_rms(emb, m.enorm.weight, eps), _rms(h[:, :t], m.hnorm.weight, eps)], -1) @ m.eh_proj.t()
        h = m.block(h, model.cos, model.sin)                # its own transformer block
        losses.append(ce(h, m.norm.weight, labels[:, k:]))  # targets t_{i+k+1} = labels[i+k]
    return main + LAMBDA / D * torch.stack(losses).sum(), losses


def test_mtp_equals_the_papers_formulas() -> None:
    cfg = tiny_model_cfg(seq_len=SEQ)
    model = GPT(with_sections(cfg, mtp=MTP), ParallelState(), seed=3).train()
    ref = copy.deepcopy(model)
    ids, labels = micro_batches(random_steps(cfg, 1, 3)[0], 3)[0]
    model(ids, labels).mean().backward()   # the MTP losses reach the backward attached to the main loss
    want, losses = _reference_loss(ref, ids, labels)
    want.backward()
    assert model.mtp is not None
    for got_k, want_k in zip(model.mtp.sums, losses):
        assert abs(got_k - float(want_k.detach())) <= 1e-5
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=0, msg=name)
    names = {n for n, _ in model.named_parameters() if n.startswith("mtp.layers.1.")}
    assert {"mtp.layers.1.eh_proj", "mtp.layers.1.enorm.weight", "mtp.layers.1.hnorm.weight",
            "mtp.layers.1.norm.weight", "mtp.layers.1.block.attn.qkv.weight"} <= names


def test_mtp_config_problems() -> None:
    from megalite.mtp.config import mtp_problems

    good = tiny_model_cfg(seq_len=SEQ)
    from types import SimpleNamespace

    par = SimpleNamespace(zero=0, pp=1, schedule="1f1b")
    assert mtp_problems(MTP, good, par) == []
    assert "mtp.num_layers must be >= 0" in mtp_problems(MTPConfig(-1), good, par)[0]
    assert "arch=llama" in mtp_problems(MTP, tiny_model_cfg("gpt2", seq_len=SEQ), par)[0]
    assert "zbv" in mtp_problems(MTP, good, SimpleNamespace(zero=0, pp=2, schedule="zbv"))[0]

    def problems(world: int, *flags: str) -> str:  # through the config's validation, one line each
        from megalite.config import parse_args, resolve, validate

        try:
            validate(resolve(parse_args(list(flags)), world), world)
        except ConfigError as e:
            return str(e)
        return ""
    pp2 = ("--mtp.num_layers", "1", "--parallel.pp", "2", "--train.global_batch_size", "32")
    assert problems(2, *pp2) == ""
    assert "mtp.num_layers > 0 with parallel.zero=3 and pp > 1" in problems(4, *pp2, "--parallel.zero", "3")
    assert "mtp.loss_weight must be >= 0" in problems(1, "--mtp.num_layers", "1", "--mtp.loss_weight", "-1")


def test_estimator_prices_the_mtp_modules() -> None:
    """mtp/costs.py's parameter count equals the built model's extra parameters, dense and with a MoE block (the
    MTP block of a DeepSeek-like config is MoE: global layer num_layers + k), and the FLOPs follow 6N + 12 h s
    plus the head's 6 h V per depth."""
    from megalite.model.gpt import count_parameters
    from megalite.perfmodel.moe import mtp_costs

    for cfg in (tiny_model_cfg(seq_len=SEQ), tiny_moe_cfg(seq_len=SEQ, moe_first_dense=1, moe_shared_experts=1)):
        st = ParallelState()
        extra = count_parameters(GPT(with_sections(cfg, mtp=MTP), st, seed=1), st) - count_parameters(GPT(cfg, st, seed=1), st)
        costs = mtp_costs(cfg, D)
        assert costs.params == extra
        h, v, s = cfg.hidden_size, cfg.vocab_size, cfg.seq_len
        matmul = costs.active // D - 3 * h  # a depth's weights used in matmuls: its block and eh_proj
        assert costs.flops_per_token == D * (6 * matmul + 12 * h * s + 6 * h * v)
        assert costs.flops_per_token - costs.flops_per_token_causal == D * 6 * h * s


def test_estimate_counts_the_mtp_modules_per_stage() -> None:
    """`perfmodel.estimate` with `ModelDims.mtp_layers`: the model's parameters and the last stage's (its blocks, the
    eh_proj and norms, the embedding copy at pp > 1) equal the built model's, at pp 1 and 2 and tp 2; the FLOPs and
    the last stage's activations grow."""
    from megalite.model.gpt import count_parameters
    from megalite.perfmodel.estimate import Layout, ModelDims, dims_params, estimate, stage_params

    cfg = tiny_model_cfg(seq_len=SEQ, num_layers=2, vocab_size=64)
    dims = ModelDims(2, 32, 8, 64, SEQ, "llama", 4, 64, False, 4, mtp_layers=D)
    st = ParallelState()
    assert dims_params(dims) == count_parameters(GPT(with_sections(cfg, mtp=MTP), st, seed=1), st)
    last = GPT(with_sections(cfg, mtp=MTP), st, seed=1, layers=range(1, 2), pre_process=False, post_process=True)
    assert stage_params(dims, 1, 2, 1).total == sum(p.numel() for p in last.parameters())
    plain, with_mtp = (estimate(ModelDims(2, 32, 8, 64, SEQ, "llama", 4, 64, False, 4, mtp_layers=n),
                                Layout(tp=2, pp=2, dp=1, micro_batch_size=2, global_batch_size=4)) for n in (0, D))
    assert with_mtp.model_flops_per_step > plain.model_flops_per_step
    assert with_mtp.memory.activations > plain.memory.activations
    assert with_mtp.comm_bytes["embedding"] > 0 and "embedding" not in plain.comm_bytes


STEPS, MICRO, M = 3, 2, 2


def _check(rank: int, case: str) -> None:
    tp, pp, cp, sp, zero, ep = {"tp2+sp": (2, 1, 1, True, 0, 1), "pp2": (1, 2, 1, False, 0, 1),
                                "cp2": (1, 1, 2, False, 2, 1), "dp2-zero3": (1, 1, 1, False, 3, 1),
                                "ep2": (1, 1, 1, False, 1, 2), "pp2-tied": (1, 2, 1, False, 0, 1),
                                "pp2-moe": (1, 2, 1, False, 0, 1), "tp2+sp-moe": (2, 1, 1, True, 0, 1),
                                "cp2-moe": (1, 1, 2, False, 0, 1), "cp2-a2a": (1, 1, 2, False, 0, 1),
                                "cp2-allgather": (1, 1, 2, False, 0, 1), "pp2-zb-h1": (1, 2, 1, False, 0, 1)}[case]
    schedule = "zb-h1" if case == "pp2-zb-h1" else "1f1b"  # zero-bubble: the weight gradients deferred
    context = ContextOptions.of(case.removeprefix("cp2-") if case in ("cp2-a2a", "cp2-allgather") else "ring")
    if case.endswith("moe") or case == "ep2":  # DeepSeek MoE blocks, the MTP module's too (the sequence-wise
        st = moe_layout(tp=tp, pp=pp, cp=cp, ep=ep, sp=sp)  # balance loss over sequences split by SP / CP)
        cfg = tiny_moe_cfg(seq_len=SEQ, moe_router="deepseek", moe_groups=2, moe_group_top_k=1,
                           moe_bias_rate=0.01, moe_aux_loss=0.0, moe_seq_aux_loss=0.01)
    else:
        st = layout(tp, pp=pp, sp=sp, cp=cp)
        # pp2-tied: the last stage's tied head is the embedding copy the MTP modules read (one parameter)
        cfg = tiny_model_cfg(seq_len=SEQ, num_layers=2, tie_embeddings=case == "pp2-tied")
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    ref = GPT(with_sections(cfg, mtp=MTP), ParallelState(), seed=5)
    ref_results = train_steps(ref, ParallelState(), reference_optimizer(ref, ParallelState()),
                              [micro_batches(d, MICRO) for d in data], tiny_train_cfg_for())
    engine = build_pipeline(with_sections(cfg, mtp=MTP), st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            context=context, stages=StagePlan(schedule=schedule))
    model = engine.chunks[0]
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    ctx = step_context(engine, st, settings=tiny_train_cfg_for(), schedule=schedule)
    from megalite.training.step import train_step

    def local(d: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = d.shape[0] // st.dp
        rows = d[st.dp_rank * n:(st.dp_rank + 1) * n]
        return [(cp_split(i, st.cp, st.cp_rank), cp_split(t, st.cp, st.cp_rank)) for i, t in micro_batches(rows, MICRO)]

    results = [train_step(ctx, opt, local(d), i) for i, d in enumerate(data)]
    for i, (got, want) in enumerate(zip(results, ref_results)):
        assert abs(got.loss - want.loss) <= 1e-5, f"{case}: step {i} loss {got.loss} != {want.loss}"
        assert got.mtp is not None and want.mtp is not None and len(got.mtp) == D
        for a, b in zip(got.mtp, want.mtp):
            assert abs(a - b) <= 1e-5, f"{case}: step {i} mtp losses {got.mtp} != {want.mtp}"
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm, f"{case}: step {i} norm"
        if want.moe is not None:  # every MoE layer's loads on every stage, the MTP block's ("mtp.layers.0.block") too
            assert got.moe is not None and got.moe["load_max"] == want.moe["load_max"], f"{case}: step {i} loads"
            assert "mtp.layers.0.block" in want.moe["load_max"]
            for name, v in want.moe["seq_aux_loss"].items():  # per sequence, its tokens on several ranks or not
                assert abs(got.moe["seq_aux_loss"][name] - v) <= 1e-6, f"{case}: step {i} {name} seq_aux"
    ref_params = dict(ref.named_parameters())
    specs = named_param_specs(model, ConfigError)
    for name, value in opt.full_parameters().items():
        spec = specs[name]
        copies = ("mtp.embedding.weight", "head.weight" if cfg.tie_embeddings else "")  # of the embedding
        want_p = ref_params["embedding.weight" if name in copies else name].detach()
        if spec.grads == EXPERT_PARALLEL:
            n = want_p.shape[0] // st.size("ep")
            want_p = want_p[st.rank_in("ep") * n:(st.rank_in("ep") + 1) * n]
        err = (unshard(value, spec.layout, st) - want_p).abs().max().item()
        assert err <= 1e-4, f"{case}: parameter {name} off by {err:.2e} after {STEPS} steps"
    if pp > 1 and st.pp_rank == 1:  # the last stage's copy of the embedding, kept equal to it: its own or the head
        assert ("mtp.embedding.weight" in specs) == (not cfg.tie_embeddings)
    for name, buf in model.named_buffers():  # the MTP block's DeepSeek router bias follows the global loads
        if name.endswith("router.bias"):
            assert torch.equal(buf, dict(ref.named_buffers())[name]), f"{case}: {name}"


def tiny_train_cfg_for():
    from tests.parallel_utils import tiny_train_cfg
    return tiny_train_cfg(STEPS)


def _all_cases(rank: int) -> None:
    for case in ("tp2+sp", "pp2", "pp2-tied", "pp2-zb-h1", "cp2", "cp2-a2a", "cp2-allgather", "dp2-zero3", "ep2",
                 "pp2-moe", "tp2+sp-moe", "cp2-moe"):
        _check(rank, case)


def test_mtp_layouts_equal_one_process(dist_world) -> None:
    dist_world(2).run(_all_cases)




def _save_at_pp2(rank: int, root: str) -> str:
    """One step at pp2 (MTP on the last stage, the embedding's copy there), saved with the optimizer."""
    from megalite.checkpoint.sharded import save_sharded

    st = layout(1, pp=2)
    cfg = tiny_model_cfg(seq_len=SEQ, num_layers=2)
    engine = build_pipeline(with_sections(cfg, mtp=MTP), st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
    opt = build_distributed_optimizer(engine.chunks[0], st, 0, dtype=torch.float32, optimizer=ADAMW)
    data = random_steps(cfg, 2, MICRO * M)
    train_steps(engine, st, opt, [micro_batches(data[0], MICRO)], tiny_train_cfg_for())
    return str(save_sharded(root, 1, engine.chunks, opt, {}, st, keep=2))


def test_checkpoint_saved_at_pp2_resumes_at_pp1(dist_world, tmp_path) -> None:
    """The MTP parameters are named by depth (`mtp.layers.k...`, on the last stage at any pp) and the last
    stage's embedding copy is not written (it is `embedding.weight`): a pp2 checkpoint resumes in one process,
    optimizer included, and its second step equals two steps of one process."""
    from megalite.checkpoint.sharded import load_sharded

    step_dir = dist_world(2).run(_save_at_pp2, str(tmp_path))[0]
    cfg = tiny_model_cfg(seq_len=SEQ, num_layers=2)
    data = random_steps(cfg, 2, MICRO * M)
    st = ParallelState()
    ref = GPT(with_sections(cfg, mtp=MTP), st, seed=5)
    want = train_steps(ref, st, reference_optimizer(ref, st), [micro_batches(d, MICRO) for d in data],
                       tiny_train_cfg_for())
    model = GPT(with_sections(cfg, mtp=MTP), st, seed=9)  # another seed: every value must come from the checkpoint
    opt = build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
    load_sharded(step_dir, [model], opt, st)
    got = train_steps(model, st, opt, [micro_batches(data[1], MICRO)], tiny_train_cfg_for(), start=1)
    assert abs(got[0].loss - want[1].loss) <= 1e-5 and got[0].mtp is not None and want[1].mtp is not None
    assert all(abs(a - b) <= 1e-5 for a, b in zip(got[0].mtp, want[1].mtp))
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        rows = cfg.vocab_size if name in ("embedding.weight", "head.weight") else None  # padding is not saved
        assert (mine[name][:rows] - p[:rows]).abs().max().item() <= 1e-4, name


def test_resuming_without_the_checkpoints_mtp_modules_is_refused(tmp_path) -> None:
    """index.json records the depth: a resume must keep it (one line), a load for generation or init_from may not."""
    from megalite.checkpoint.sharded import load_sharded, read_index, save_sharded
    from megalite.errors import CheckpointError

    cfg = tiny_model_cfg(seq_len=SEQ)
    st = ParallelState()
    model = GPT(with_sections(cfg, mtp=MTP), st, seed=1)
    opt = build_distributed_optimizer(model, st, 0, dtype=torch.float32, optimizer=ADAMW)
    step_dir = save_sharded(tmp_path, 1, [model], opt, {}, st, keep=1)
    assert read_index(step_dir)["model"]["mtp_layers"] == D
    plain = GPT(cfg, st, seed=1)
    with pytest.raises(CheckpointError, match="trained with mtp.num_layers=2 but this run has 0"):
        load_sharded(step_dir, [plain], build_distributed_optimizer(plain, st, 0, dtype=torch.float32, optimizer=ADAMW), st)
    load_sharded(step_dir, [plain], None, st)  # generation: the main model alone
    v = cfg.vocab_size  # the padded rows are not saved
    torch.testing.assert_close(plain.head.weight[:v], model.head.weight[:v], atol=0, rtol=0)
