#!/usr/bin/env bash
# `make test`: set up everything and run lint plus every tier of the suite (unit, integration, e2e;
# pyproject.toml) against the machine's real PostgreSQL and Redis, in parallel: pytest-xdist workers,
# each with its own test database, Redis database and payload directory (tests/conftest.py).
# `make test-fast` (--fast): the unit tier only: no services, no lint, nothing in parallel.
# Extra arguments go to pytest. TEST_WORKERS sets the number of xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/venv.sh requirements-dev.txt
[ "$fast" = 1 ] || bash scripts/services.sh
# Headless Chromium for the browser test (tests/test_pages_browser.py): Debian's package, once.
[ "$fast" = 1 ] || bash scripts/browser.sh
export DATABASE_URL=${TEST_DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/relay}
# The first Redis database of the run: xdist worker N uses this number + N.
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/1}
# Test-only secrets: the suite runs with DEBUG off, like production.
export SECRET_KEY=test-secret-key RELAY_MASTER_KEY=test-master-key RELAY_ADMIN_TOKEN=test-admin-token DEBUG=0
# Payloads the suite writes (and its worker processes, which inherit this) go to a
# temporary directory removed at the end, never into the checkout.
if [ -z "${RELAY_BATCH_PAYLOAD_DIR:-}" ]; then
  RELAY_BATCH_PAYLOAD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/relay-test-payloads.XXXXXX")
  export RELAY_BATCH_PAYLOAD_DIR
  trap 'rm -rf "$RELAY_BATCH_PAYLOAD_DIR"' EXIT
fi
if [ "$fast" = 1 ]; then
  .venv/bin/python -m pytest -m unit "$@"
  exit
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Whole modules go to one worker (their worker fleets are started once), in the order tests/conftest.py
# gives them: the longest first. 3 workers: with fleets forked warm and frozen rather than stopped, the
# suite no longer keeps both cores busy with 2 (2026-12-08: 2 workers 4 min 53 s, 3 workers 4 min 1 s,
# 4 workers 4 min 57 s with the cores saturated and a timing test failing for want of CPU).
.venv/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder "$@"
