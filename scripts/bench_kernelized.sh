#!/usr/bin/env bash
# The kernelized-attention benchmark: forward and forward+backward time and peak memory against N
# (1K to 16K; batch 1, 8 heads, head dim 64, float32), non-causal and causal, for every mechanism of the
# kernelized family beside exact softmax (SDPA) and the installed peer libraries (./run.sh peers).
# Results (JSON, CSV, PNG, report.md) go to docs/results/kernelized-{noncausal,causal}/.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNZOO=${ATTNZOO:-.venv/bin/attnzoo}
common=(--preset full --mechanisms softmax,performer,linear,rfa,retention,gla --peers
        --heads 8 --head-dim 64 --batch 1 --repeats 3 --time-budget 90 --no-sweep)
"$ATTNZOO" compare "${common[@]}" --lengths 1024,2048,4096,8192,16384 --output docs/results/kernelized-noncausal "$@"
"$ATTNZOO" compare "${common[@]}" --lengths 2048,8192,16384 --causal --output docs/results/kernelized-causal "$@"
