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
exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -rs "$@"
