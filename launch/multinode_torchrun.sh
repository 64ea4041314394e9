#!/usr/bin/env bash
# Multi-node megalite training with torchrun, without a scheduler: run this same line on every node.
#
#   # on each of 4 nodes (node0 hosts the rendezvous; any node may be started first):
#   NNODES=4 NPROC=8 MASTER_ADDR=node0 launch/multinode_torchrun.sh --config configs/llama-7b.toml --parallel.tp 8
#
# The agents meet in a c10d rendezvous (a TCP store on MASTER_ADDR:MASTER_PORT, hosted by the agent
# running there); it assigns node ranks, so no NODE_RANK is needed and the command line is the same
# everywhere. Every argument is passed through to pretrain.py unchanged.
#
# Knobs (environment variables):
#   NNODES        nodes taking part (required; "MIN:MAX" for an elastic range).
#   NPROC         processes per node (default: visible GPUs, else 1).
#   MASTER_ADDR   host of the rendezvous (required; one of the nodes).
#   MASTER_PORT   its TCP port (default 29500); must be open between the nodes.
#   RDZV_ID       a name shared by the nodes of one run, different for concurrent runs (default megalite).
#   LOCAL_ADDR    this node's address as the others should reach it (default: torchrun's lookup of the
#                 hostname); set it when the hostname resolves to the wrong interface.
#   MAX_RESTARTS  times torchrun restarts all workers after a failure (default 0); pretrain.py resumes
#                 from the latest checkpoint in checkpoint.dir.
#   RDZV_TIMEOUT  seconds the agents wait for each other at start (default 900).
#   PYTHON        interpreter (default python), run as `$PYTHON -m torch.distributed.run`.
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NPROC, at least 1).
#   NCCL_SOCKET_IFNAME / NCCL_IB_HCA  pin NCCL to the right network if it picks the wrong one.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"

if [[ -z "${NNODES:-}" || -z "${MASTER_ADDR:-}" ]]; then
    echo "error: set NNODES and MASTER_ADDR (e.g. NNODES=2 MASTER_ADDR=node0 $0 ...);" \
         "for one node use launch/torchrun.sh" >&2
    exit 2
fi
if [[ -z "${NPROC:-}" ]]; then
    NPROC="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')"
fi
MASTER_PORT="${MASTER_PORT:-29500}"

CORES="$(nproc 2>/dev/null || echo 1)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"
# A collective that hangs (a rank died or diverged) raises after the timeout instead of hanging forever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# One CUDA work queue: keeps the TP/SP communication kernels in issue order (as Megatron-LM requires).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export PYTHONUNBUFFERED=1

EXTRA=()
if [[ -n "${LOCAL_ADDR:-}" ]]; then
    EXTRA=(--local-addr "$LOCAL_ADDR")
fi

# torchrun forwards SIGTERM/SIGINT to the workers once; pretrain.py finishes its step, saves a checkpoint
# and exits on them. torchrun SIGKILLs workers still running after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
# (its default 30 s is shorter than one step of a large model): give the save time.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megalite}" \
    --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-900}" --max-restarts "${MAX_RESTARTS:-0}" \
    ${EXTRA[@]+"${EXTRA[@]}"} "$REPO_DIR/pretrain.py" "$@"
