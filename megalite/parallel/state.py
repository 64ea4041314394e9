"""ParallelState: the rank grid and the process groups of a (tp, cp, dp, pp) layout.

Rank order (Megatron's): tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the tp ranks of a group are consecutive global ranks and sit inside one node (TP moves the most
bytes, twice per layer per micro-batch, and needs NVLink); cp comes next because its ring moves K/V
(an activation-sized volume) every layer, so it also wants the node's fast links; dp (one gradient
reduction per step) strides by tp*cp, and pipeline stages are the outermost, cheapest-to-separate
dimension (one p2p per micro-batch boundary). With cp = 1 the formula is the (tp, dp, pp) one, so
adding cp moved no existing layout.

The arithmetic is in pure functions (`rank_coords`, `group_ranks`) tested without any process group.
`ParallelState` is built once in `pretrain.py` and passed to every layer: nothing reads a global.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast, get_args

import torch
import torch.distributed as dist

from megalite.errors import ConfigError, LaunchError
from megalite.parallel.counter import CommCounter

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
#   ep, edp          expert parallelism, taken from the dp x cp ranks: with i = dp_rank * cp + cp_rank (the index
#                    in dp_cp), ep_rank = i % ep and edp_rank = i // ep. 'ep' is the ranks with the same tp_rank,
#                    pp_rank and edp_rank (the MoE all-to-all), 'edp' the ranks with the same tp_rank, pp_rank and
#                    ep_rank (expert weights' gradient reduction). At ep = 1, 'edp' is 'dp_cp' (same communicator).
GroupKind = Literal["tp", "dp", "pp", "pp_act_down", "pp_grad", "pp_grad_up", "mp", "embedding", "cp", "dp_cp",
                    "ep", "edp"]
GROUP_KINDS: frozenset[str] = frozenset(get_args(GroupKind))
# The communicators over the pipeline ranks (pp_rank is the only coordinate they span).
PP_KINDS: tuple[GroupKind, ...] = ("pp", "pp_act_down", "pp_grad", "pp_grad_up")
# The kinds `create_groups` builds one family of groups for, in the order every rank creates them.
_CREATION_ORDER: tuple[GroupKind, ...] = ("tp", "dp", "pp", "mp", "embedding", "pp_act_down", "pp_grad",
                                          "pp_grad_up", "cp", "dp_cp", "ep", "edp")


class Coords(NamedTuple):
    """A rank's position in the grid, one coordinate per dimension."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


def check_group(kind: str) -> GroupKind:
    """`kind` itself when it names a group kind; a ValueError naming the valid ones otherwise."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown process-group kind {kind!r}; expected one of {sorted(GROUP_KINDS)}")
    return cast(GroupKind, kind)


def rank_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> Coords:
    """(tp_rank, dp_rank, pp_rank, cp_rank) of a global rank."""
    if not 0 <= rank < tp * cp * pp * dp:
        raise ValueError(f"rank {rank} outside world of size {tp * cp * pp * dp}")
    return Coords(rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp)


def coords_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """Inverse of `rank_coords`."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def group_ranks(kind: GroupKind, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> list[list[int]]:
    """Every group of one kind, as sorted lists of global ranks (each rank in exactly one group).

    A group is the ranks that agree on every coordinate the kind does not span: tp spans tp_rank, cp
    cp_rank (sorted = ring order), dp dp_rank, dp_cp both dp_rank and cp_rank, the four pp kinds pp_rank,
    mp (model parallel, tp x pp: the gradient norm's reduction) tp_rank and pp_rank; embedding is the first
    and last pipeline stage of each (tp, cp, dp) column — the ranks holding the two copies of a tied embedding.
    """
    spans: dict[GroupKind, tuple[str, ...]] = {
        "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp_cp": ("dp", "cp"), "mp": ("tp", "pp"), "embedding": ("pp",),
        **{pp_kind: ("pp",) for pp_kind in PP_KINDS}}
    groups: dict[tuple[int, ...], list[int]] = {}
    if kind in ("ep", "edp"):  # from the dp x cp index i: ep_rank = i % ep, edp_rank = i // ep
        for r in range(tp * cp * pp * dp):
            c = rank_coords(r, tp, pp, dp, cp)
            i = c.dp * cp + c.cp
            groups.setdefault((c.tp, c.pp, i // ep if kind == "ep" else i % ep), []).append(r)
        return sorted(sorted(g) for g in groups.values())
    spanned = spans[check_group(kind)]
    for r in range(tp * cp * pp * dp):
        c = rank_coords(r, tp, pp, dp, cp)
        key = tuple(v for name, v in c._asdict().items() if name not in spanned)
        groups.setdefault(key, []).append(r)
    result = [sorted(g) for g in groups.values()]
    if kind == "embedding":
        result = [sorted({g[0], g[-1]}) for g in result]
    return sorted(result)


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
    sp: bool = False
    ep: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[GroupKind, dist.ProcessGroup] = field(default_factory=dict)
    counter: CommCounter = field(default_factory=CommCounter)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def coords(self) -> Coords:
        return rank_coords(self.rank, self.tp, self.pp, self.dp, self.cp)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def ep_rank(self) -> int:
        return (self.dp_rank * self.cp + self.cp_rank) % self.ep

    @property
    def edp_rank(self) -> int:
        return (self.dp_rank * self.cp + self.cp_rank) // self.ep

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
        return coords_rank(self.tp_rank, self.dp_rank, pp_rank, self.tp, self.dp, self.cp_rank, self.cp)

    def size(self, kind: GroupKind) -> int:
        """Ranks in this rank's group of `kind` (1: every collective over it is a no-op)."""
        kind = check_group(kind)
        if kind in PP_KINDS:
            return self.pp
        return {"tp": self.tp, "dp": self.dp, "mp": self.tp * self.pp, "embedding": 1 if self.pp == 1 else 2,
                "cp": self.cp, "dp_cp": self.dp * self.cp, "ep": self.ep, "edp": self.dp * self.cp // self.ep}[kind]

    def rank_in(self, kind: GroupKind) -> int:
        """This rank's position in its group of `kind` (the index in `group_ranks`' sorted list)."""
        kind = check_group(kind)
        if kind in PP_KINDS:
            return self.pp_rank
        return {"tp": self.tp_rank, "dp": self.dp_rank, "mp": self.pp_rank * self.tp + self.tp_rank,
                "embedding": 0 if self.is_first_stage else 1, "cp": self.cp_rank,
                "dp_cp": self.dp_rank * self.cp + self.cp_rank, "ep": self.ep_rank, "edp": self.edp_rank}[kind]

    def group(self, kind: GroupKind) -> dist.ProcessGroup | None:
        """The torch process group of `kind` this rank belongs to (None when the world is 1)."""
        return self.groups.get(check_group(kind))


def init_distributed(tp: int, pp: int, dp: int, sp: bool = False, backend: str = "auto",
                     device: str = "auto", timeout_s: float = 600.0, cp: int = 1, ep: int = 1) -> ParallelState:
    """Join the job launched by torchrun/srun (or run alone) and build every process group once.

    Reads RANK / WORLD_SIZE / LOCAL_RANK (torchrun) or SLURM_PROCID / SLURM_NTASKS; a partial
    launcher environment is a LaunchError, not a hang.
    """
    rank, world, local_rank = launcher_env()
    if world != tp * cp * pp * dp:
        raise ConfigError(f"world size {world} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp}")
    if ep < 1 or (dp * cp) % ep:
        raise ConfigError(f"parallel.ep={ep} must divide dp x cp = {dp * cp} (experts are split over dp x cp ranks)")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    state = ParallelState(tp=tp, pp=pp, dp=dp, rank=rank, cp=cp, sp=sp, ep=ep, device=dev)
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
    for kind in _CREATION_ORDER:
        if kind in PP_KINDS and kind != "pp" and state.pp == 1:
            continue
        if kind == "dp_cp" and state.cp == 1:  # the same ranks as dp: share its communicator
            state.groups["dp_cp"] = state.groups["dp"]
            continue
        if kind == "ep" and state.ep == 1:  # one rank each: no collective ever runs over it
            continue
        if kind == "edp" and state.ep == 1:  # the same ranks as dp_cp: share its communicator
            state.groups["edp"] = state.groups["dp_cp"]
            continue
        for ranks in group_ranks(kind, state.tp, state.pp, state.dp, state.cp, state.ep):
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
