#!/usr/bin/env bash
# Start a local Ray head for trying fusedserve with `ray job submit` (run from the repo root).
# The job's `python` is the one on the PATH of `ray start`, so start it from the venv.
set -euo pipefail
export PATH="$(pwd)/.venv/bin:$PATH"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"   # or keep token auth and export it to clients too
ray start --head --dashboard-host=127.0.0.1 --dashboard-port=8265 "$@"
echo "submit with: ray job submit --address http://127.0.0.1:8265 --working-dir . -- exec python -m deploy.serve --model default --workers auto"
