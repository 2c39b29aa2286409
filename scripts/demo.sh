#!/usr/bin/env bash
# The main job: install, record the GPT-2 reference workload (baseline and optimized)
# on the best device present, print the diagnoses, and open the dashboard on them.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_env ""
exec "$VENV/bin/gpuprof" demo "$@"
