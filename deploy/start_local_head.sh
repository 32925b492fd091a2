#!/usr/bin/env bash
# Start a local Ray head for trying fusedserve with `ray job submit` (run from the repo root).
# The job's `python` is the one on the PATH of `ray start`, so start it from the venv.
#
# Loopback only, with Ray's token auth: every server of the head listens on 127.0.0.1
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's single-node mode, which binds the node's address),
# and the Jobs API runs only the code of a client holding the token (`ray get-auth-token
# --generate` writes ~/.ray/auth_token, which clients on this machine read with
# RAY_AUTH_MODE=token). Never expose a head without auth: its Jobs API runs anyone's code.
set -euo pipefail
export PATH="$(pwd)/.venv/bin:$PATH"
export RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
ray get-auth-token --generate >/dev/null
ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --dashboard-port=8265 "$@"
echo "submit with: RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- exec python -m fusedserve.deploy.serve --model default --workers auto"
