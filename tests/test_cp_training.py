"""Context-parallel training against the single-process run: losses over several optimizer steps, every
parameter after them, the evaluation loss, and the bytes each group moved (gloo ranks, fp32).

Each cp rank holds the zigzag split of every sequence (`megalite.data.sampler.cp_split`), attends over
the whole sequence through the ring (`megalite.context.ring`), and the gradients are averaged over
dp x cp (each parameter's `ParamSpec.grad_group`).

Tolerances (as in tests/test_tensor_parallel.py and tests/test_zero.py): the cp run sums the same terms in
another order (the ring merges per-block softmaxes by their log-sum-exp, each rank's loss is the mean of
its S/cp tokens, the gradient sum over dp x cp is another order of the same sum), so losses (O(1) values)
agree to 1e-5 absolute, observed ~1e-7, and so do the gradient norms (relative). Parameters after 3 AdamW steps at lr 1e-2 are compared to 1e-4:
Adam's first steps are ~lr * g/|g|, so the ~1e-7 relative round-off of a near-zero gradient becomes up to
~1e-5 there, while a wrong position, mask, split or scaling moves parameters by O(lr) = 1e-2 (checked by
breaking the positions on purpose). A gradient scaled by a constant barely moves Adam's steps, which is
why the gradient norm is compared too (dividing by dp instead of dp x cp fails there). gpt2's key bias has a true gradient
of 0 (softmax is shift-invariant), so Adam amplifies pure round-off there into O(lr) steps: excluded,
as in the other parity tests.

Bytes are integers and asserted exactly: 'cp' holds exactly the ring's K/V (+ dK/dV) traffic
(`megalite.context.costs` x layers x micro-batches, x 2 forwards under full recompute), 'dp' the gradient
reduction over N = dp x cp ranks, and the optimizer's memory is sharded 1/N (the ZeRO formulas of
tests/test_zero.py with dp -> N).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megalite.context.costs import cp_attention_bytes
from megalite.context.options import ContextOptions
from megalite.data.sampler import cp_split
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import evaluate, train_step
from tests.parallel_utils import (layout, micro_batches, random_steps, reference_optimizer,
                                  step_context, tiny_model_cfg, tiny_train_cfg)
from tests.parallel_utils import ADAMW
from tests.test_zero import _padded_size, expected_dp_bytes, expected_memory

STEPS, MICRO, M, SEQ = 3, 2, 2, 16  # 3 optimizer steps of M micro-batches of MICRO sequences of SEQ tokens
LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-4


def local_batches(data: torch.Tensor, st: ParallelState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step: its dp slice of the rows, its cp split of the tokens."""
    per_rank = data.shape[0] // st.dp
    rows = data[st.dp_rank * per_rank:(st.dp_rank + 1) * per_rank]
    return [(cp_split(ids, st.cp, st.cp_rank), cp_split(labels, st.cp, st.cp_rank))
            for ids, labels in micro_batches(rows, MICRO)]


def reference_run(cfg, data: list[torch.Tensor], context: ContextOptions = ContextOptions()
                  ) -> tuple[GPT, list[tuple[float, float]]]:
    """The single-process run: the model after the steps and each step's (loss, gradient norm)."""
    ref_state = ParallelState()
    ref = GPT(cfg, ref_state, seed=5, context=context)
    opt = reference_optimizer(ref, ref_state)
    tcfg = tiny_train_cfg(STEPS)
    results = [train_step(step_context(ref, ref_state, torch.float32, tcfg), opt,
                          micro_batches(d, MICRO), i) for i, d in enumerate(data)]
    return ref, [(r.loss, r.grad_norm) for r in results]


def assert_params_match(opt, st: ParallelState, chunks: list[nn.Module], ref: GPT, what: str) -> None:
    """Every parameter this rank's stage holds, gathered over ZeRO shards and tp, equals the reference's."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    specs = {}
    for chunk in chunks:
        specs.update(named_param_specs(chunk, ConfigError))
    full = opt.full_parameters()
    assert full, what
    for name, value in full.items():
        name = name.split(".", 1)[1] if name.split(".", 1)[0].isdigit() else name  # a ModuleList's chunk prefix
        got, want = unshard(value, specs[name].layout, st), ref_params[name].detach()
        if name.endswith("attn.qkv.bias"):  # zero true gradient (module doc): compare q and v only
            h = got.shape[0] // 3
            got, want = torch.cat([got[:h], got[-h:]]), torch.cat([want[:h], want[-h:]])
        err = (got - want).abs().max().item()
        assert err <= PARAM_ATOL, f"{what}: parameter {name} off by {err:.2e} after {STEPS} steps"


def _check_cp_training(rank: int, tp: int, cp: int, pp: int, sp: bool, zero: int, arch: str,
                       recompute: str = "none", schedule: str = "1f1b", mode: str = "ring",
                       eod: int | None = None) -> dict[str, float]:
    st = layout(tp, pp, sp=sp, cp=cp)
    what = (f"tp={tp} cp={cp} pp={pp} dp={st.dp} sp={sp} zero={zero} {arch} recompute={recompute} {schedule} "
            f"cp_mode={mode} document eod={eod}")
    vpp = 2 if schedule == "zbv" else 1
    cfg = tiny_model_cfg(arch, seq_len=SEQ, recompute=recompute, num_layers=2 * pp)
    data = random_steps(cfg, STEPS, MICRO * M * st.dp)
    if eod is not None:  # documents of random lengths: about one token in five ends one
        data = [torch.where(d % 5 == 0, eod, d) for d in data]
    context = ContextOptions.of(mode, eod)
    ref, ref_results = reference_run(cfg, data, context)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            stages=StagePlan(vpp=vpp, schedule=schedule), context=context)
    chunks = engine.chunks
    model = chunks[0] if vpp == 1 else nn.ModuleList(chunks)
    opt = build_distributed_optimizer(model, st, zero, dtype=torch.float32, optimizer=ADAMW)
    tcfg = tiny_train_cfg(STEPS)
    st.counter.reset()
    results = [train_step(step_context(engine, st, torch.float32, tcfg, schedule), opt,
                          local_batches(d, st), i) for i, d in enumerate(data)]
    counted = st.counter.bytes()
    cp_bytes, dp_bytes = st.counter.exact_bytes("cp"), st.counter.exact_bytes("dp")
    for i, (got, (loss, norm)) in enumerate(zip(results, ref_results)):
        assert abs(got.loss - loss) <= LOSS_ATOL, f"{what}: step {i} loss {got.loss} != single-process {loss}"
        # Adam is nearly blind to a gradient's scale; the norm is not (a wrong average over cp doubles it).
        assert abs(got.grad_norm - norm) <= 1e-5 * norm, f"{what}: step {i} grad norm {got.grad_norm} != {norm}"
    assert_params_match(opt, st, chunks, ref, what)
    # 'cp' is exactly the mode's attention traffic: each layer of this stage, each micro-batch, each step (full
    # recompute runs each block's forward, and so its ring / gather / all-to-all, twice).
    ring = cp_attention_bytes(ContextOptions.of(mode), MICRO, SEQ, cfg.num_heads // tp, cfg.num_kv_heads // tp,
                              cfg.hidden_size // cfg.num_heads, cp, 4)
    per_call = ring.total + (ring.forward if recompute == "full" else 0)
    layers = sum(len(c.layers) for c in chunks)
    # Document masking: each chunk's forward also all-gathers the int64 token ids over cp (the documents of
    # the whole sequence), every micro-batch.
    ids_gather = (cp - 1) * MICRO * (SEQ // cp) * 8 * len(chunks) if eod is not None else 0
    assert cp_bytes == STEPS * M * (layers * per_call + ids_gather), f"{what}: cp bytes {cp_bytes}"
    # 'dp' is exactly the gradient reduction over N = dp x cp (ZeRO shards over N as well).
    n = st.dp * cp
    psi, padded = _padded_size(model, zero if n > 1 else 0, n) if vpp == 1 else (_numel(model), _numel(model))
    expected = expected_dp_bytes(zero if n > 1 else 0, psi, padded, n, 4, M) * STEPS
    assert dp_bytes == expected, f"{what}: dp bytes {dp_bytes} != {expected}"
    if vpp == 1:  # and each rank holds 1/N of the sharded state
        mem = opt.memory_bytes()
        assert mem == expected_memory(zero if n > 1 else 0, psi, padded, n, 4), f"{what}: memory {mem}"
    val = evaluate(engine, local_batches(data[0], st), st, torch.float32)
    want = evaluate(ref, micro_batches(data[0], MICRO), ParallelState(), torch.float32)
    assert abs(val - want) <= LOSS_ATOL, f"{what}: eval loss {val} != {want}"
    return counted


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


CASES = [  # world, tp, cp, pp, sp, zero, arch, recompute
    (2, 1, 2, 1, False, 2, "llama", "none"),      # cp alone; ZeRO-2 shards over the 2 cp ranks (dp = 1)
    (4, 1, 4, 1, False, 0, "gpt2", "none"),       # cp = 4, learned positions, tied embeddings
    (4, 2, 2, 1, True, 0, "llama", "none"),       # cp x tp with sequence parallelism
    (4, 1, 2, 2, False, 0, "gpt2", "none"),       # cp x pp (1F1B), tied embeddings summed over the stages
    (4, 1, 2, 1, False, 1, "gpt2", "none"),       # cp x dp, ZeRO-1 over dp x cp
    (4, 1, 2, 1, False, 3, "llama", "none"),      # cp x dp, ZeRO-3 over dp x cp
    (2, 1, 2, 1, False, 0, "llama", "full"),      # full recompute re-runs the ring
    (2, 1, 2, 1, False, 0, "gpt2", "selective"),  # selective: the ring already saves only q, k, v, out, lse
]


@pytest.mark.parametrize("world,tp,cp,pp,sp,zero,arch,recompute", CASES)
def test_cp_training_matches_single_process(dist_world, world: int, tp: int, cp: int, pp: int, sp: bool,
                                            zero: int, arch: str, recompute: str) -> None:
    counted = dist_world(world).run(_check_cp_training, tp, cp, pp, sp, zero, arch, recompute)
    assert all(c.get("cp", 0) > 0 for c in counted)


# The other cp modes (parallel.cp_mode) at cp = 4, beside tp + sp, beside pp; a2a under both recomputes (its
# selective recompute checkpoints the attention core between the two all-to-alls: no extra cp bytes).
MODE_CASES = [(mode, *case) for mode in ("allgather", "a2a") for case in (
    (4, 1, 4, 1, False, 0, "gpt2", "none"),
    (4, 2, 2, 1, True, 0, "llama", "none"),
    (4, 1, 2, 2, False, 1, "gpt2", "none"),
)] + [("a2a", 2, 1, 2, 1, False, 0, "llama", "full"), ("a2a", 2, 1, 2, 1, False, 0, "llama", "selective")]


@pytest.mark.parametrize("mode,world,tp,cp,pp,sp,zero,arch,recompute", MODE_CASES)
def test_cp_modes_train_like_single_process(dist_world, mode: str, world: int, tp: int, cp: int, pp: int, sp: bool,
                                            zero: int, arch: str, recompute: str) -> None:
    counted = dist_world(world).run(_check_cp_training, tp, cp, pp, sp, zero, arch, recompute, "1f1b", mode)
    assert all(c.get("cp", 0) > 0 for c in counted)


def test_cp_with_zero_bubble_v_schedule(dist_world) -> None:
    """ZB-V (two chunks per rank in a V, backward split into input- and weight-gradient actions) at cp = 2."""
    dist_world(4).run(_check_cp_training, 1, 2, 2, False, 0, "llama", "none", "zbv")


def problems(world: int, *flags: str) -> str:
    """The validation's message for these pretrain flags at `world` ranks ("" when valid)."""
    from megalite.config import parse_args, resolve, validate

    try:
        validate(resolve(parse_args(list(flags)), world), world)
    except ConfigError as e:
        return str(e)
    return ""


def test_validation_accepts_cp_layouts_and_names_bad_splits() -> None:
    """cp composes with tp + sp (no refusal); a sequence that does not split is one clear line."""
    assert problems(4, "--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--model.seq_len", "32") == ""
    assert problems(8, "--parallel.cp", "2", "--parallel.pp", "2", "--parallel.zero", "3", "--model.seq_len", "32",
                    "--train.global_batch_size", "32") == ""
    assert "not divisible by 2 x parallel.cp = 8" in problems(4, "--parallel.cp", "4", "--model.seq_len", "36")
    assert "tokens per cp rank is not divisible by parallel.tp 4" in problems(
        8, "--parallel.cp", "2", "--parallel.tp", "4", "--parallel.sp", "true", "--model.seq_len", "20")


def _check_stop_flag(rank: int) -> bool:
    """A stop signal seen by one cp rank stops every rank (the flag is reduced over mp, then dp x cp)."""
    import signal

    from megalite.training.stop import StopFlag

    st = layout(1, cp=2)  # dp = 2: rank 1 is cp rank 1 of the first ring
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        flag = StopFlag()
        flag.requested = rank == 1
        return flag.agreed(st)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_stop_flag_reaches_every_cp_rank(dist_world) -> None:
    assert dist_world(4).run(_check_stop_flag) == [True] * 4


def test_batches_keep_each_cp_ranks_zigzag_split() -> None:
    """Every cp rank builds its split of the same samples; the splits of inputs and labels put back
    together are the unsplit batch (labels stay aligned with their inputs: next-token targets)."""
    from megalite.context.zigzag import zigzag_merge
    from megalite.data.sampler import make_batch

    samples = [torch.arange(i * 100, i * 100 + SEQ + 1).numpy() for i in range(3)]
    ids, labels = make_batch(samples, [2, 0])
    for cp in (2, 4):
        parts = [make_batch(samples, [2, 0], cp, r) for r in range(cp)]
        assert all(p[0].shape == (2, SEQ // cp) and p[0].is_contiguous() for p in parts)
        assert torch.equal(zigzag_merge([p[0] for p in parts]), ids)
        assert torch.equal(zigzag_merge([p[1] for p in parts]), labels)
        assert all(torch.equal(p[1], p[0] + 1) for p in parts)
