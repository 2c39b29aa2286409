#!/usr/bin/env bash
# The whole test suite on the pinned torch (GPUPROF_TORCH, default torch==2.13.0: the oldest tested), then the
# tests marked `newest_torch` (capture on real tiny loops, NaN forensics, real scripts, DDP on gloo) again on the
# newest torch tested, in a virtual environment of its own (GPUPROF_NEWEST_TORCH, default torch==2.14.1; set it
# empty to skip that pass). Arguments go to the first pass, and then the second is skipped.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_env "[test]"
# The real-browser dashboard test needs Chromium; install it where we can, else that test skips.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "could not install chromium: the browser test will skip" >&2
fi
cd "$ROOT"
# The real public scripts the tests run live in a cache outside the repository: fill what is missing (online
# where GitHub is reachable) and stop here, saying how to get them, when a pinned one is still missing.
"$VENV/bin/python" scripts/get_corpus.py
PYTEST=(-m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -rs)
"$VENV/bin/python" "${PYTEST[@]}" "$@"
NEWEST_TORCH=${GPUPROF_NEWEST_TORCH-torch==2.14.1}
if [ $# -eq 0 ] && [ -n "$NEWEST_TORCH" ]; then
  VENV=$ROOT/.venv-${NEWEST_TORCH//[^A-Za-z0-9.]/}  # e.g. .venv-torch2.14.1
  GPUPROF_TORCH=$NEWEST_TORCH ensure_env "[test]"
  echo "the tests marked newest_torch, on $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
  "$VENV/bin/python" "${PYTEST[@]}" -m newest_torch
fi
