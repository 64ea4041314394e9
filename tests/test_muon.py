"""Muon (`megalite.optim.muon`): the paper's update on one process, and every layout computing the same thing.

1. One process: `build_distributed_optimizer(optimizer="muon")` on the gradient sync matches a plain Muon
   written below from Jordan et al. 2024 / Liu et al. 2025's pseudo-code (whole tensors, autograd's
   `.grad`, torch.optim.AdamW for the rest). Tolerance: the sync sums dW inside the linears' GEMMs, and
   the fused AdamW differs from torch's by an ulp; Newton-Schulz is a smooth map of its normalised input
   (no division by a small sqrt(v)), so after 4 steps at lr 1e-2 parameters agree to 2e-6 and losses to 1e-6;
   dropping Nesterov, the LR scale or the per-part split of qkv moves parameters by >= 1e-3.
2. Layouts (gloo ranks, fp32): tp2, tp2+sp, pp2, pp2 interleaved (vpp 2), dp2 at ZeRO 1, 2 and 3, cp2, a
   MoE model at ep2 + ZeRO-1 (world 2) and tp2 x dp2 at ZeRO 1 (world 4: both exchange levels) against the single-process Muon: losses to 1e-5 (O(1) values,
   the dp/cp/tp sums are other orders of the same sums, ~1e-7 observed) and parameters to 2e-5 (after 3
   steps at lr 1e-2: a lost piece, a wrong owner or a matrix orthogonalised per TP shard instead of whole
   moves them by ~1e-3). The "muon" bytes each rank counts equal `megalite.perfmodel.muon` exactly.
3. Checkpoints: Muon's momentum is saved as "exp_avg", loads back, and its checkpoint view is the same at
   every layout (so it reshards like AdamW's moments), and a checkpoint saved at tp2 or dp2 + ZeRO-1 resumes
   on one process with the uninterrupted run's losses; a checkpoint of the other optimizer
   is refused on resume (tests/test_muon_cli.py runs that through pretrain.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.config import MuonConfig
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.perfmodel.inputs import Layout, ModelDims
from megalite.perfmodel.muon import exchange_bytes, muon_matrices, muon_report, muon_tp_bytes_total
from megalite.pipeline import StagePlan, build_pipeline
from tests.parallel_utils import (ADAMW, layout, micro_batches, random_steps, step_context, tiny_model_cfg,
                                  tiny_train_cfg)
from megalite.training.step import train_step
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.test_cp_training import local_batches

STEPS, MICRO, M, SEQ = 4, 2, 2, 16
# The layouts train 3 steps: losses before the first update and after the first and the second, parameters
# after the third (one step fewer than the single-process test, where 4 cost little).
LAYOUT_STEPS = 3
HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
MU = 0.95


def _muon(model: nn.Module | list[nn.Module], st: ParallelState, zero: int):
    return build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=replace(ADAMW, name="muon"),
                                       muon=MuonConfig(momentum=MU))


# ---------------------------------------------------------------- the plain reference (paper pseudo-code)
def _ns5(g: torch.Tensor) -> torch.Tensor:
    """Jordan et al.'s Newton-Schulz quintic, as in their pseudo-code."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    if g.size(0) > g.size(1):
        x = x.T
    for _ in range(5):
        A = x @ x.T
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.T if g.size(0) > g.size(1) else x


def _plain_muon_run(cfg, data: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT(cfg, ParallelState(), seed=5)
    specs = named_param_specs(model, ConfigError)
    params = dict(model.named_parameters())
    muon = {n for n, p in params.items()  # the blocks' linears: not the output layer (a column linear too)
            if n.startswith("layers.") and p.dim() == 2 and specs[n].layout.kind in ("column", "row")}
    ffn = cfg.moe.ffn_hidden_size
    experts = {n: ((ffn, ffn) if cfg.arch == "llama" else (ffn,)) if n.endswith(".up") else (cfg.hidden_size,)
               for n in params if n.endswith((".experts.up", ".experts.down"))}  # [E, rows, cols]: each expert
    muon |= set(experts)
    rest = [p for n, p in params.items() if n not in muon]
    adam = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], foreach=False)
    bufs = {n: torch.zeros_like(params[n]) for n in muon}
    lr, wd = HYPER["lr"], HYPER["weight_decay"]
    losses = []
    for d in data:
        model.zero_grad()
        mbs = micro_batches(d, MICRO)
        total = 0.0
        for ids, labels in mbs:
            model.set_aux_loss_scale(1 / len(mbs))  # MoE router losses: backpropagated as the loss / M is
            loss = model(ids, labels).mean()
            (loss / len(mbs)).backward()
            total += loss.item()
        losses.append(total / len(mbs))
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values()))  # type: ignore[union-attr]
        if norm > 1.0:  # clip_grad 1.0, as the step does
            for p in params.values():
                p.grad.mul_(1.0 / (norm + 1e-6))  # type: ignore[union-attr]
        with torch.no_grad():
            for n in muon:
                p, g = params[n], params[n].grad
                bufs[n].mul_(MU).add_(g)
                u = g + MU * bufs[n]
                parts = specs[n].layout.parts or (p.shape[-2],)  # q, k, v / gate, up: each its own matrix
                ns = lambda m, rows: torch.cat([_ns5(x) * 0.2 * math.sqrt(max(x.shape)) for x in m.split(list(rows))])
                o = torch.stack([ns(m, experts[n]) for m in u]) if n in experts else ns(u, parts)
                p.mul_(1 - lr * wd).sub_(lr * o)
        adam.step()
    return losses, {n: p.detach().clone() for n, p in params.items()}


def _megalite_run(cfg, data: list[torch.Tensor], zero: int = 0):
    st = ParallelState()
    model = GPT(cfg, st, seed=5)
    opt = _muon(model, st, zero)
    ctx = step_context(model, st, torch.float32, tiny_train_cfg(STEPS))
    losses = [train_step(ctx, opt, micro_batches(d, MICRO), i).loss for i, d in enumerate(data)]
    return losses, opt.full_parameters(), opt


@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama-moe"])
def test_muon_matches_the_papers_pseudo_code_on_one_process(arch: str) -> None:
    # llama-moe: every expert's matrices on Muon (its up as gate and up), the router on AdamW
    cfg = tiny_moe_cfg("llama", seq_len=SEQ) if arch == "llama-moe" else tiny_model_cfg(arch, seq_len=SEQ)
    data = random_steps(cfg, STEPS, MICRO * M)
    want_losses, want = _plain_muon_run(cfg, data)
    losses, got, opt = _megalite_run(cfg, data)
    for i, (a, b) in enumerate(zip(losses, want_losses)):
        assert abs(a - b) <= 1e-6, f"{arch} step {i}: loss {a} != plain Muon {b}"
    for name, value in got.items():
        expect = want[name]
        if name.endswith("attn.qkv.bias"):  # the key bias: true gradient 0, AdamW amplifies round-off (as in
            h = cfg.hidden_size             # tests/test_zero.py): compare q and v only
            value, expect = torch.cat([value[:h], value[-h:]]), torch.cat([expect[:h], expect[-h:]])
        err = (value - expect).abs().max().item()
        assert err <= 2e-6, f"{arch}: {name} off by {err:.2e} from the plain Muon"
    # The momentum is checkpointed as "exp_avg" (and restored by load_param_states).
    states = opt.param_states()
    assert torch.count_nonzero(states["layers.0.attn.qkv.weight"]["exp_avg"]) > 0
    fresh = _muon(GPT(cfg, ParallelState(), seed=5), ParallelState(), 0)
    fresh.load_param_states(states)
    for name, entry in fresh.param_states().items():
        for kind, t in entry.items():
            assert torch.equal(t, states[name][kind]), (name, kind)


# ---------------------------------------------------------------- layouts
# vpp: an interleaved pipeline (two chunks per rank, 4 layers); ep: a MoE model with its experts over 2 ranks
# (the blocks' attention matrices on Muon, the experts on AdamW, ZeRO-1 over their own 'edp' group).
CASES_2 = [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(zero=1), dict(zero=2), dict(zero=3), dict(cp=2),
           dict(pp=2, vpp=2), dict(ep=2, zero=1), dict(tp=2, sp=True, moe=True)]
CASES_4 = [dict(tp=2, zero=1), dict(ep=2, zero=2)]  # ep2 x dp4: the experts' matrices owned over 'edp' 2


def _check_layouts(rank: int, cases: list[dict]) -> list[str]:
    done = []
    # The single-process run depends only on the model and the global batch: cases sharing them share it.
    references: dict[tuple[bool, int, int], tuple] = {}
    for case in cases:
        tp, pp, cp, sp, zero = (case.get("tp", 1), case.get("pp", 1), case.get("cp", 1), case.get("sp", False),
                                case.get("zero", 0))
        vpp, ep = case.get("vpp", 1), case.get("ep", 1)
        moe = ep > 1 or case.get("moe", False)
        st = moe_layout(tp, pp, cp, ep, sp) if moe else layout(tp, pp, sp=sp, cp=cp)
        what = f"tp={tp} pp={pp} vpp={vpp} cp={cp} dp={st.dp} ep={ep} sp={sp} zero={zero} moe={moe}"
        cfg = (tiny_moe_cfg if moe else tiny_model_cfg)("llama", seq_len=SEQ, num_layers=2 * vpp)
        data = random_steps(cfg, LAYOUT_STEPS, MICRO * M * st.dp)
        key = (moe, vpp, st.dp)
        if key not in references:
            references[key] = _megalite_run(cfg, data)
        want_losses, want, ref_opt = references[key]
        schedule = "interleaved" if vpp > 1 else "1f1b"
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                                stages=StagePlan(vpp=vpp, schedule=schedule))
        opt = _muon(engine.chunks, st, zero)
        ctx = step_context(engine, st, torch.float32, tiny_train_cfg(LAYOUT_STEPS), schedule)
        st.counter.reset()
        losses = [train_step(ctx, opt, local_batches(d, st), i).loss for i, d in enumerate(data)]
        for i, (a, b) in enumerate(zip(losses, want_losses)):
            assert abs(a - b) <= 1e-5, f"{what} step {i}: loss {a} != one process {b}"
        specs = {n: sp_ for c in engine.chunks for n, sp_ in named_param_specs(c, ConfigError).items()}

        def mine(name: str, full: torch.Tensor) -> torch.Tensor:  # an expert stack: this ep rank's block of it
            n = full.shape[0] // ep
            return full[st.rank_in("ep") * n:(st.rank_in("ep") + 1) * n] if specs[name].grads == EXPERT_PARALLEL else full

        def plain(name: str) -> str:  # full_parameters of several chunks (vpp): "<chunk>.<global name>"
            return name if name in specs else name.split(".", 1)[1]

        for key, value in opt.full_parameters().items():
            name = plain(key)
            err = (unshard(value, specs[name].layout, st) - mine(name, want[name])).abs().max().item()
            assert err <= 2e-5, f"{what}: {name} off by {err:.2e} from one process"
        # The checkpoint view of the momentum ("exp_avg", each TP shard) is the single process's: it reshards.
        ref_states = ref_opt.param_states()
        for key, entry in opt.param_states().items():
            name = plain(key)
            got = unshard(entry["exp_avg"], specs[name].layout, st)
            torch.testing.assert_close(got, mine(name, ref_states[name]["exp_avg"]), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: what + m)
        # Every "muon" byte is the plan's exchanges, exactly as the perfmodel counts them.
        plan = opt.optimizer.plan  # type: ignore[attr-defined]
        per_step = exchange_bytes(plan.tp.sizes, plan.tp.owners, plan.tp.me)
        per_step += sum(exchange_bytes(ex.sizes, ex.owners, ex.me) for _, ex in plan.dp.values())
        assert st.counter.exact_bytes("muon") == LAYOUT_STEPS * per_step, f"{what}: muon bytes"
        # Over the tp group, the tp exchange is the perfmodel's total for the matrices this dp index owns.
        tp_sent = torch.tensor([float(exchange_bytes(plan.tp.sizes, plan.tp.owners, plan.tp.me))])
        torch.distributed.all_reduce(tp_sent, group=st.group("tp"))
        owned = sum(plan.matrices[i].numel * tp for i in plan.tp_items)
        assert tp_sent.item() == muon_tp_bytes_total(owned, tp), what
        if zero == 0 and pp == 1 and not moe:  # every matrix of the model, owned whole by this dp index
            dims = ModelDims(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size, SEQ,
                             num_kv_heads=cfg.num_kv_heads, ffn_hidden_size=cfg.ffn_hidden_size)
            assert owned == sum(r * c for r, c in muon_matrices(dims)), what
        done.append(what)
    return done


def test_muon_layouts_at_world_2_match_one_process(dist_world) -> None:
    assert len(dist_world(2).run(_check_layouts, CASES_2)[0]) == len(CASES_2)


def test_muon_tp2_dp2_zero1_matches_one_process(dist_world) -> None:
    assert len(dist_world(4).run(_check_layouts, CASES_4)[0]) == len(CASES_4)


def test_the_estimator_prices_muon_only_when_asked() -> None:
    dims = ModelDims(2, 32, 8, 61, SEQ, num_kv_heads=4, ffn_hidden_size=64)
    assert muon_report("adamw", dims, Layout(tp=2)) == ({}, [])
    section, lines = muon_report("muon", dims, Layout(tp=2))
    # tp = 2, ZeRO 0: every matrix's other half goes to its owner and back, averaged over the 2 TP ranks
    assert section["muon"]["tp_bytes_per_rank"] == muon_tp_bytes_total(18432, 2) / 2 == 18432 * 4 / 2
    assert section["muon"]["dp_bytes_per_rank_bound"] == 0.0 and "Newton-Schulz" in lines[0]


# ---------------------------------------------------------------- a checkpoint moving between layouts
def _train_2_steps_and_save(rank: int, case: dict, root: str) -> None:
    from megalite.checkpoint.sharded import save_sharded

    st = layout(case.get("tp", 1), 1, sp=case.get("sp", False))
    cfg = tiny_model_cfg("llama", seq_len=SEQ, num_layers=2)
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
    opt = _muon(engine.chunks[0], st, case.get("zero", 0))
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(STEPS))
    for i in range(2):
        train_step(ctx, opt, local_batches(data[i], st), i)
    save_sharded(root, 2, [engine.chunks[0]], opt, {}, st, keep=2)


@pytest.mark.parametrize("case", [dict(tp=2), dict(zero=1)], ids=["tp2", "dp2-zero1"])
def test_muon_checkpoint_from_two_ranks_resumes_on_one_process(dist_world, tmp_path, case: dict) -> None:
    """Saved after 2 steps at tp2 (momentum cut over tp) or at dp2 with ZeRO-1 (momentum sharded over dp),
    loaded by one process: steps 3-4 give the uninterrupted single-process run's losses (1e-5, as the layout
    tests above). A lost or misplaced momentum slice moves them by >= 1e-4 (lr 1e-2, momentum 0.95)."""
    from megalite.checkpoint.sharded import load_sharded

    dist_world(2).run(_train_2_steps_and_save, case, str(tmp_path))
    cfg = tiny_model_cfg("llama", seq_len=SEQ, num_layers=2)
    dp = 1 if case.get("tp") else 2
    data = random_steps(cfg, STEPS, MICRO * M * dp)
    st = ParallelState()
    want_losses, _, _ = _megalite_run(cfg, data)
    model = GPT(cfg, st, seed=7)  # another seed: every weight must come from the checkpoint
    opt = _muon(model, st, 0)
    load_sharded(tmp_path / "step_00000002", [model], opt, st)
    opt.step_count = 2
    ctx = step_context(model, st, torch.float32, tiny_train_cfg(STEPS))
    for i in (2, 3):
        loss = train_step(ctx, opt, micro_batches(data[i], MICRO), i).loss
        assert abs(loss - want_losses[i]) <= 1e-5, f"{case} step {i + 1}: resumed {loss} != {want_losses[i]}"
