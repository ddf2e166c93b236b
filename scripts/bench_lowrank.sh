#!/usr/bin/env bash
# The low-rank / landmark / attention-free benchmark (docs/benchmarks.md): forward and forward+backward time
# and peak memory of linformer (rank 256) and nystrom (256 landmarks) beside SDPA and the installed peers at
# the same rank and landmarks (linformer, nystrom-attention; ./run.sh peers), up to N=8192; then aft (simple)
# and efficient beside SDPA up to N=16384, non-causal and causal. Batch 1, 4 heads, head dim 64, float32.
# Results (JSON, CSV, PNG, report.md) go to docs/results/lowrank-*/ and docs/results/linear-time-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNZOO=${ATTNZOO:-.venv/bin/attnzoo}
common=(--heads 4 --head-dim 64 --batch 1 --repeats 5 --time-budget 60 --no-sweep --quiet)
"$ATTNZOO" compare "${common[@]}" --mechanisms linformer,nystrom --set linformer.rank=256 \
    --set nystrom.landmarks=256 --peers --lengths 2048,4096,8192 --output docs/results/lowrank-noncausal "$@"
"$ATTNZOO" compare "${common[@]}" --mechanisms aft,efficient --lengths 4096,16384 \
    --output docs/results/linear-time-noncausal "$@"
"$ATTNZOO" compare "${common[@]}" --mechanisms aft,efficient --lengths 4096,16384 --causal \
    --output docs/results/linear-time-causal "$@"
