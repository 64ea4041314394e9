#!/usr/bin/env bash
# One prepared GPU benchmark for a single H200 (under 7 minutes: 4 min 30 s of sections + 90 s + 60 s, so a 15-minute device lease that also pays
# the machine's start can run it twice). What it measures:
#   1. MFU, tokens/s and peak memory of the llama-1b preset (bf16, seq 2048, megalite's real
#      train_step) with model.kernels=torch, model.kernels=triton and torch.compile;
#   2. the kernel table of bench/kernels_gpu.py (each Triton kernel vs eager / compiled torch);
#   3. Triton flash attention vs scaled_dot_product_attention at the 1B model's shapes;
#   4. overlapped vs non-overlapped DP communication (bench/overlap_compare.py: bucket sizes, the
#      ZeRO-1/2 parameter-gather overlap, ZeRO-3 prefetch 0/1/2) with 2 ranks: NCCL on 2 GPUs, gloo
#      when both share the one GPU (NCCL refuses two ranks on one device). At most 90 more seconds;
#   5. long-sequence attention (bench/long_seq_gpu.py: SDPA, Triton flash and document-masked SDPA at
#      S = 8K-32K, ms and peak memory of forward + backward). At most 60 more seconds.
# Results: one gpu_bench.json + gpu_bench.md (+ overlap_compare_cuda.{json,md}) in $OUT (the device runner's output folder) or
# runs/bench/, plus env.txt (nvidia-smi, versions) and gpu_bench.log.
#
#   bash bench/gpu.sh            # on the GPU machine
#   bash bench/gpu.sh --smoke    # anywhere: CPU, tiny shapes, seconds (tests/test_bench_smoke.py)
# Extra arguments go to bench/gpu_bench.py (e.g. --micro-batch 8, --variants torch triton).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-runs/bench}"  # untracked; OUT=bench/results updates the published figures
mkdir -p "$OUT_DIR"
{
  date -u
  python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found (CPU machine)"; fi
} > "$OUT_DIR/env.txt" 2>&1
# Hard stop at 4.5 minutes; gpu_bench.py itself skips sections past its budget (4 min) and rewrites the
# JSON/markdown after every section, so a stop still leaves the finished ones.
timeout 270 python bench/gpu_bench.py --budget-s 240 --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
status="${PIPESTATUS[0]}"
# 4. The overlap comparison, on a port nobody uses; its failure is logged, not fatal to the figures above.
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
OVERLAP_ARGS=(--device cuda)
for arg in "$@"; do [ "$arg" = "--smoke" ] && OVERLAP_ARGS=(--smoke); done
timeout 90 python bench/overlap_compare.py "${OVERLAP_ARGS[@]}" --out "$OUT_DIR" --port "$PORT" \
  > "$OUT_DIR/overlap_compare.log" 2>&1 || echo "overlap_compare: failed or timed out, see overlap_compare.log"
# 5. Long sequences (one process); like 4, its failure is logged, not fatal.
LONG_ARGS=(--budget-s 40)
for arg in "$@"; do [ "$arg" = "--smoke" ] && LONG_ARGS=(--smoke); done
timeout 60 python bench/long_seq_gpu.py "${LONG_ARGS[@]}" --out "$OUT_DIR" \
  > "$OUT_DIR/long_seq.log" 2>&1 || echo "long_seq_gpu: failed or timed out, see long_seq.log"
exit "$status"
