#!/usr/bin/env bash
# The whole test suite: install the project with its test extras, then run pytest.
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
exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -rs "$@"
