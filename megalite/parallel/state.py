"""ParallelState: the rank grid and the process groups of a (tp, cp, dp, pp) layout.

Rank order (Megatron's): tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the tp ranks of a group are consecutive global ranks and sit inside one node (TP moves the most
bytes, twice per layer per micro-batch, and needs NVLink); cp comes next because its ring moves K/V
(an activation-sized volume) every layer, so it also wants the node's fast links; dp (one gradient
reduction per step) strides by tp*cp, and pipeline stages are the outermost, cheapest-to-separate
dimension (one p2p per micro-batch boundary). With cp = 1 the formula is the (tp, dp, pp) one, so
adding cp moved no existing layout.

The arithmetic is one `RankGrid` (megalite/parallel/grid.py), tested without any process group:
`layout_grid` declares the dimensions in that order, and every group kind is a sub-grid named by its
dimensions (`GROUPS`). Expert parallelism is a second reading of the same dp x cp ranks (`layout_grid`),
so no rank moves.
Sequence parallelism is not a dimension: it is a mode of the tp group (`ParallelState.sp`), on the same ranks.
`ParallelState` is built once in `pretrain.py` and passed to every layer: nothing reads a global.
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast, get_args

import torch
import torch.distributed as dist

from megalite.errors import ConfigError, LaunchError
from megalite.parallel.counter import CommCounter
from megalite.parallel.grid import RankGrid

# The process groups a layout has, a closed set: a typo'd kind is a type error (Literal) and, at run time,
# a ValueError at the first call that names it (`check_group`), even where the group has one rank.
#   tp, dp, pp       ranks that differ only in that coordinate
#   mp               model parallel (tp x pp): ranks with the same dp_rank (the gradient norm's reduction)
#   embedding        first and last pipeline stage of each (tp, dp) column: a tied embedding's two copies
#   pp_act_down,     three more communicators over the pp ranks (pp > 1 only), so that each carries pipeline
#   pp_grad,         messages of one kind in one direction: 'pp' activations to a higher pp_rank, 'pp_act_down'
#   pp_grad_up       activations to a lower one, 'pp_grad' gradients to a lower one, 'pp_grad_up' gradients to a
#                    higher one (`megalite/pipeline/p2p.py`'s `channel`; why: `create_groups`). 'pp' is also the
#                    pipeline's group for collectives (the loss sum).
#   cp               a context-parallel ring (megalite/context): ranks that differ only in cp_rank, in ring order
#   dp_cp            dp x cp: ranks holding the same parameters (same tp_rank and pp_rank). The gradients of
#                    replicated parameters are reduced over it (each cp rank saw other tokens of the same
#                    sequences) and ZeRO shards over it. At cp = 1 it is the dp group itself (same communicator).
#   ep, edp          expert parallelism, a second factorisation of the dp_cp ranks: with i = dp_rank * cp +
#                    cp_rank (the rank's index in its dp_cp group), ep_rank = i % ep and edp_rank = i // ep.
#                    'ep' spans ep_rank (the ranks an expert layer's experts are spread over), 'edp' edp_rank
#                    (the replicas of one expert, which reduce its gradients). At ep = 1 'ep' is one rank
#                    (no communicator) and 'edp' is the dp_cp group itself (same communicator).
GroupKind = Literal["tp", "dp", "pp", "pp_act_down", "pp_grad", "pp_grad_up", "mp", "embedding", "cp", "dp_cp",
                    "ep", "edp"]
GROUP_KINDS: frozenset[str] = frozenset(get_args(GroupKind))
# The communicators over the pipeline ranks (pp_rank is the only coordinate they span).
PP_KINDS: tuple[GroupKind, ...] = ("pp", "pp_act_down", "pp_grad", "pp_grad_up")


class GroupDecl(NamedTuple):
    """A group kind as a sub-grid: the dimensions it spans (every other coordinate is the same across the
    group); `ends` keeps only the first and last rank of each sub-grid (a tied embedding's two copies)."""

    dims: tuple[str, ...]
    ends: bool = False


# Every kind, in the order `create_groups` builds them on every rank (new kinds go at the end: the order of
# `new_group` calls must not change under existing layouts).
GROUPS: dict[GroupKind, GroupDecl] = {
    "tp": GroupDecl(("tp",)), "dp": GroupDecl(("dp",)), "pp": GroupDecl(("pp",)), "mp": GroupDecl(("tp", "pp")),
    "embedding": GroupDecl(("pp",), ends=True), "pp_act_down": GroupDecl(("pp",)), "pp_grad": GroupDecl(("pp",)),
    "pp_grad_up": GroupDecl(("pp",)), "cp": GroupDecl(("cp",)), "dp_cp": GroupDecl(("cp", "dp")),
    "ep": GroupDecl(("ep",)), "edp": GroupDecl(("edp",)),
}
assert set(GROUPS) == GROUP_KINDS


def check_group(kind: str) -> GroupKind:
    """`kind` itself when it names a group kind; a ValueError naming the valid ones otherwise."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown process-group kind {kind!r}; expected one of {sorted(GROUP_KINDS)}")
    return cast(GroupKind, kind)


@functools.lru_cache(maxsize=64)  # pure in its ints; every rank query reads it
def layout_grid(tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1, ep: int = 1) -> RankGrid:
    """The layout's rank grid: (tp, cp, dp, pp) in rank order, and (ep, edp) as a second factorisation of
    the consecutive (cp, dp) digits — i = dp_rank * cp + cp_rank is their value, ep_rank its fast digit."""
    base = RankGrid.of(("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp))
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp}")
    return base.refactor(("cp", "dp"), (("ep", ep), ("edp", dp * cp // ep)))


@dataclass
class ParallelState:
    """Who this rank is in the (tp, cp, dp, pp) grid and the process groups it talks over.

    With world size 1 no process group exists and every collective in `megalite.parallel.comm`
    short-circuits, so single-process code pays nothing for being parallel-ready.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    cp: int = 1
    sp: bool = False  # sequence parallelism: a mode of the tp group (activations sharded over it), no dimension
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[GroupKind, dist.ProcessGroup] = field(default_factory=dict)
    counter: CommCounter = field(default_factory=CommCounter)
    ep: int = 1

    @property
    def grid(self) -> RankGrid:
        return layout_grid(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every dimension of the grid (tp, cp, dp, pp, ep, edp)."""
        return self.grid.coords(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first)."""
        if self.is_first_stage:
            return None
        return self.stage_rank(self.pp_rank - 1)

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last)."""
        if self.is_last_stage:
            return None
        return self.stage_rank(self.pp_rank + 1)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline stage `pp_rank` in this rank's pipeline (same tp, cp and dp coordinates)."""
        return self.ranks("pp")[pp_rank]

    def size(self, kind: GroupKind) -> int:
        """Ranks in this rank's group of `kind` (1: every collective over it is a no-op)."""
        decl = GROUPS[check_group(kind)]
        n = self.grid.size(*decl.dims)
        return min(n, 2) if decl.ends else n

    def rank_in(self, kind: GroupKind) -> int:
        """This rank's position in its group of `kind` (the index in `group_ranks`' sorted list; for the
        embedding kind 0 on the first stage, 1 on every other)."""
        decl = GROUPS[check_group(kind)]
        index = self.grid.index_in(self.rank, *decl.dims)
        return min(index, 1) if decl.ends else index

    def ranks(self, kind: GroupKind) -> list[int]:
        """The global ranks of this rank's group of `kind`, sorted (= index order)."""
        decl = GROUPS[check_group(kind)]
        members = self.grid.group(self.rank, *decl.dims)
        return sorted({members[0], members[-1]}) if decl.ends else members

    def group_ranks(self, kind: GroupKind) -> list[list[int]]:
        """Every group of `kind` in the layout (each rank in at most one), sorted lists of global ranks, sorted.
        The embedding kind holds only each pipeline's first and last stage."""
        decl = GROUPS[check_group(kind)]
        groups = self.grid.groups(*decl.dims)
        return sorted(sorted({g[0], g[-1]}) for g in groups) if decl.ends else groups

    def group(self, kind: GroupKind) -> dist.ProcessGroup | None:
        """The torch process group of `kind` this rank belongs to (None when the world or the group is 1)."""
        return self.groups.get(check_group(kind))


def init_distributed(layout: ParallelState, backend: str = "auto", device: str = "auto",
                     timeout_s: float = 600.0) -> ParallelState:
    """Join the job launched by torchrun/srun (or run alone) and build every process group once; `layout`
    gives the sizes (tp, pp, dp, cp, ep) and sp, the launcher this process's rank and device.

    Reads RANK / WORLD_SIZE / LOCAL_RANK (torchrun) or SLURM_PROCID / SLURM_NTASKS; a partial
    launcher environment is a LaunchError, not a hang.
    """
    tp, pp, dp, cp = layout.tp, layout.pp, layout.dp, layout.cp
    rank, world, local_rank = launcher_env()
    if world != tp * cp * pp * dp:
        raise ConfigError(f"world size {world} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    state = ParallelState(tp=tp, pp=pp, dp=dp, rank=rank, cp=cp, sp=layout.sp, device=dev, ep=layout.ep)
    if world == 1:
        return state
    if not dist.is_initialized():
        if not 0 < timeout_s < 10 ** 7:  # timedelta and the C++ stores overflow beyond ~months
            raise ConfigError(f"parallel.timeout_s={timeout_s} must be a finite number of seconds below 1e7")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, store=_rendezvous_store(rank, world, timeout), rank=rank,
                                    world_size=world, timeout=timeout)
        except (RuntimeError, OSError) as e:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LaunchError(f"rank {rank} of {world} could not join the job at {os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')} within parallel.timeout_s={timeout_s:g} ({first}): "
                              "check that every rank was started and can reach MASTER_ADDR") from e
    create_groups(state)
    return state


def _rendezvous_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The TCP store at MASTER_ADDR:MASTER_PORT, with keys prefixed by the restart attempt.

    Under `torchrun --max-restarts`, the agent's store outlives a failed attempt; without the prefix
    the restarted ranks read the dead ranks' addresses from the previous attempt and fail to connect.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megalite/attempt_{attempt}", store)


def create_groups(state: ParallelState) -> None:
    """Create every process group of the layout (the default group must exist already).

    Every rank must call `new_group` for every group, in the same order, even for groups it is not
    in: that is torch.distributed's contract, and breaking it hangs the job.

    The pipeline's point-to-point messages get four communicators over the same pp ranks (pp > 1 only),
    one per (activations or gradients, to a higher or a lower pp_rank), because NCCL ignores tags: it
    matches a pair's messages by posting order per communicator, and runs a lone isend/irecv on one
    stream per (communicator, pair of ranks), in posting order. Split by kind, each communicator's
    messages are posted in the same order on both sides (in the interleaved schedule a rank pair carries
    both kinds the same way); split by direction, no send can wait in front of a receive from the same
    peer on one stream (the interleaved schedule at pp = 2 and ZB-V send activations both ways between
    one pair). They are created for every schedule, though 1F1B, GPipe and ZB-H1 use only 'pp' and
    'pp_grad': the schedule is not known here, gloo's cost is a few sockets, and NCCL builds a
    communicator only for a pair that actually talks on the group (torch creates them lazily, at the
    first send or receive between the two ranks), so an unused group costs no GPU memory.
    """
    for kind in GROUPS:
        if kind in PP_KINDS and kind != "pp" and state.pp == 1:
            continue
        if kind == "dp_cp" and state.cp == 1:  # the same ranks as dp: share its communicator
            state.groups["dp_cp"] = state.groups["dp"]
            continue
        if kind in ("ep", "edp") and state.ep == 1:  # 'ep' is one rank, 'edp' the dp_cp ranks: share theirs
            if kind == "edp":
                state.groups["edp"] = state.groups["dp_cp"]
            continue
        for ranks in state.group_ranks(kind):
            pg = dist.new_group(ranks)
            if state.rank in ranks:
                state.groups[kind] = pg


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or Slurm's environment; (0, 1, 0) when alone."""
    env = os.environ
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise LaunchError(f"launcher environment incomplete: {', '.join(missing)} not set "
                              "(launch with torchrun, or unset RANK/WORLD_SIZE to run one process)")
        return _checked_env("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if "SLURM_PROCID" in env and _env_int("SLURM_NTASKS", "1") > 1:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise LaunchError("running under srun with several tasks but MASTER_ADDR/MASTER_PORT are not "
                              "set: use launch/slurm.sbatch, which exports them")
        return _checked_env("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    return 0, 1, 0


def _env_int(name: str, default: str | None = None) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(str(raw).strip())
    except ValueError:
        raise LaunchError(f"launcher variable {name}={raw!r} is not an integer: launch with torchrun/srun, "
                          f"or unset it to run one process") from None


def _checked_env(rank_var: str, world_var: str, local_var: str) -> tuple[int, int, int]:
    """(rank, world, local rank) from the named variables, which must add up."""
    rank, world, local = _env_int(rank_var), _env_int(world_var), _env_int(local_var, "0")
    if world < 1:
        raise LaunchError(f"{world_var}={world} must be >= 1")
    if not 0 <= rank < world:
        raise LaunchError(f"{rank_var}={rank} is outside 0..{world - 1} ({world_var}={world}): each process needs "
                          f"its own rank below the world size")
    if local < 0:
        raise LaunchError(f"{local_var}={local} must be >= 0")
    if "MASTER_PORT" in os.environ and not 0 < _env_int("MASTER_PORT") < 65536:
        raise LaunchError(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a TCP port (1..65535)")
    return rank, world, local
