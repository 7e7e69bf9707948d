#!/usr/bin/env bash
# `make test`: set up everything and run lint plus the whole suite against the
# machine's real PostgreSQL and Redis. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh requirements-dev.txt
bash scripts/services.sh
export DATABASE_URL=${TEST_DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/relay}
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}
# Test-only secrets: the suite runs with DEBUG off, like production.
export SECRET_KEY=test-secret-key RELAY_MASTER_KEY=test-master-key RELAY_ADMIN_TOKEN=test-admin-token DEBUG=0
# Payloads the suite writes (and its worker processes, which inherit this) go to a
# temporary directory removed at the end, never into the checkout.
if [ -z "${RELAY_BATCH_PAYLOAD_DIR:-}" ]; then
  RELAY_BATCH_PAYLOAD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/relay-test-payloads.XXXXXX")
  export RELAY_BATCH_PAYLOAD_DIR
  trap 'rm -rf "$RELAY_BATCH_PAYLOAD_DIR"' EXIT
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
