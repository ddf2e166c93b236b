#!/usr/bin/env bash
# The sparse and hashed attention benchmark (docs/benchmarks.md): forward and forward+backward time and peak
# memory, batch 1, 4 heads, head dim 64, float32, beside SDPA and the installed peers (./run.sh peers) at equal
# settings: local (window 256) against local-attention, reformer (bucket 64, 4 hashes) against
# reformer-pytorch's LSH attention, causal up to N=16384; then bigbird and longformer non-causal at N=8192.
# Results (JSON, CSV, PNG, report.md) go to docs/results/sparse-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNZOO=${ATTNZOO:-.venv/bin/attnzoo}
common=(--heads 4 --head-dim 64 --batch 1 --repeats 3 --time-budget 60 --no-sweep --quiet)
"$ATTNZOO" compare "${common[@]}" --mechanisms local,reformer --set local.window=256 \
    --set reformer.bucket_size=64 --set reformer.n_hashes=4 --peers --causal --lengths 4096,8192,16384 \
    --output docs/results/sparse-causal "$@"
"$ATTNZOO" compare "${common[@]}" --mechanisms bigbird,longformer,strided,clustered --lengths 4096,8192 \
    --output docs/results/sparse-noncausal "$@"
