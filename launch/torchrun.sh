#!/usr/bin/env bash
# Launch megalite's pretrain.py on one machine with torchrun (one process per GPU, or per CPU slot).
#
#   launch/torchrun.sh                                     # all local GPUs, demo model
#   NPROC=8 launch/torchrun.sh --config configs/llama-1b.toml --parallel.tp 2
#   NPROC=4 NNODES=2 MASTER_ADDR=node0 launch/torchrun.sh ...   # run the same line on each node
#
# Every argument is passed through to pretrain.py unchanged.
#
# Knobs (environment variables):
#   NPROC        processes on this machine (default: the number of visible GPUs, else 1).
#   NNODES       machines taking part (default 1). With >1 this hands over to
#                launch/multinode_torchrun.sh (c10d rendezvous at MASTER_ADDR:MASTER_PORT; node ranks
#                are assigned by it; see that script for its other knobs).
#   MASTER_ADDR  host of the rendezvous (multi-node only; default localhost).
#   MASTER_PORT  its TCP port (default 29500).
#   RDZV_ID      a job id shared by all nodes of one run (default megalite).
#   PYTHON       interpreter to use (default python): torchrun runs as `$PYTHON -m torch.distributed.run`
#                so the active virtual environment is the one used, whatever is first on PATH.
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NPROC, at least 1) so processes do
#                not oversubscribe the cores (torchrun would otherwise set it to 1, with a warning).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"

if [[ -z "${NPROC:-}" ]]; then
    NPROC="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')"
fi
NNODES="${NNODES:-1}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"

CORES="$(nproc 2>/dev/null || echo 1)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"
# A collective that hangs (a rank died or diverged) raises after the timeout instead of hanging forever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# One CUDA work queue: keeps the TP/SP communication kernels in issue order (as Megatron-LM requires).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export PYTHONUNBUFFERED=1

# One process checks the config (and the predicted memory) first: a bad flag is one line here instead
# of one per worker followed by torchrun's traceback of the failed children.
for arg in "$@"; do
    if [[ "$arg" == --help || "$arg" == -h ]]; then exec "$PYTHON" "$REPO_DIR/pretrain.py" --help; fi
done
"$PYTHON" "$REPO_DIR/pretrain.py" --check-config --world-size $(( NPROC * NNODES )) --local-processes "$NPROC" "$@" \
    || exit $?

if [[ "$NNODES" != 1 ]]; then
    # Several machines: the multi-node script (c10d rendezvous at MASTER_ADDR:MASTER_PORT) does it.
    export NNODES NPROC MASTER_ADDR MASTER_PORT
    exec bash "$REPO_DIR/launch/multinode_torchrun.sh" "$@"
fi
RDZV=(--standalone --nnodes 1)

# Ctrl-C / SIGTERM: every worker gets the signal exactly once, from this script, and pretrain.py finishes
# its step, saves and exits 0 (a second one stops it at once, exit 130). torchrun is not the one to
# forward it: on a signal it re-sends it, SIGKILLs workers still saving after 30 s and exits with a
# traceback. So torchrun runs in its own process group (set -m: a terminal's Ctrl-C reaches this script
# only) and the script signals torchrun's children, the workers, itself; torchrun then sees them end.
set -m
"$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NPROC" "$REPO_DIR/pretrain.py" "$@" &
TORCHRUN_PID=$!
signalled=0
forward() {
    signalled=1
    local workers
    workers="$(pgrep -P "$TORCHRUN_PID" 2>/dev/null || true)"
    # shellcheck disable=SC2086  # one pid per word
    kill -s "$1" ${workers:-$TORCHRUN_PID} 2>/dev/null || true  # no workers yet: torchrun forwards it
}
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while :; do
    signalled=0
    wait "$TORCHRUN_PID" && status=0 || status=$?
    [[ "$signalled" == 1 ]] || break  # a trapped signal only interrupted the wait: torchrun still runs
done
exit "$status"
