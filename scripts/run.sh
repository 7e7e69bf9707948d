#!/usr/bin/env bash
# `make run`: set up and start the relay in embedded mode (no Docker, Postgres or Redis).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh requirements.txt
exec .venv/bin/python -m relay.embedded
