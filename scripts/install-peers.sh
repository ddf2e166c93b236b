#!/usr/bin/env bash
# Installs the peer libraries that `attnzoo compare --peers` measures against, into the
# environment of the python given as $1 (default: .venv/bin/python).
#
# torch stays pinned by constraints.txt so that no peer can pull a different (CUDA) build.
# pytorch-fast-transformers ships only C++/CUDA sources: it is compiled here (about six
# minutes on two cores) against the installed torch, CPU kernels only. Its setup.py builds
# the CUDA kernels whenever an `nvcc` is on PATH, so every PATH entry holding one is dropped
# for that build. A failure of that one build is reported but does not fail the script:
# `attnzoo compare --peers` lists missing peers instead of stopping.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "install-peers: no python at '$PY' (usage: scripts/install-peers.sh PATH/TO/python)" >&2
    exit 2
fi
PIP=("$PY" -m pip install --disable-pip-version-check -c constraints.txt)

echo "install-peers: pure-python peers"
"${PIP[@]}" performer-pytorch linformer nystrom-attention local-attention reformer-pytorch x-transformers

# flash-linear-attention: its pure-PyTorch references (fla.ops.<name>.naive) are what tests/mechanisms/test_fla_reference.py
# and the fla-* peers of `attnzoo compare --peers` run. fla-core requires only einops (torch and triton are
# optional extras of it, never asked for here, so the pinned CPU torch stays); importing fla needs triton and
# packaging even on a CPU machine, where it warns that Triton is unsupported and falls back to the CPU.
echo "install-peers: flash-linear-attention references (fla-core, triton, packaging)"
"${PIP[@]}" fla-core triton packaging einops

echo "install-peers: pytorch-fast-transformers (compiles C++, several minutes)"
cpu_path=""
IFS=':' read -r -a entries <<< "$PATH"
for dir in "${entries[@]}"; do
    [ -n "$dir" ] || continue
    [ -x "$dir/nvcc" ] && continue
    cpu_path="${cpu_path:+$cpu_path:}$dir"
done
# Torch must already be importable by setup.py, hence no build isolation; MAX_JOBS keeps
# the compiler within the machine's cores.
if env PATH="$cpu_path" CUDA_HOME= MAX_JOBS="${MAX_JOBS:-2}" \
        "${PIP[@]}" --no-build-isolation pytorch-fast-transformers; then
    echo "install-peers: pytorch-fast-transformers installed"
else
    echo "install-peers: pytorch-fast-transformers did not build; --peers will list it as missing" >&2
fi

"$PY" -c 'import torch; print("install-peers: torch", torch.__version__)'
