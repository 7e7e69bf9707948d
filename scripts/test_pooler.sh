#!/usr/bin/env bash
# `make test-pooler`: the durability, query-count and pooler suites through PgBouncer in transaction mode
# (docs/pooler.md), as a deployment behind a pooler runs: DATABASE_POOLER=transaction, migrations direct.
# Starts a throwaway PgBouncer (scripts/pgbouncer.sh; Debian's package, installed when missing) and
# stops it at the end. Its own databases and Redis db (TEST_POOLER_REDIS_DB, 4), serial (no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh requirements-dev.txt
bash scripts/services.sh
started=0
if ! bash scripts/pgbouncer.sh status >/dev/null 2>&1; then started=1; fi
eval "$(bash scripts/pgbouncer.sh start)"
[ "$started" = 1 ] && trap 'bash scripts/pgbouncer.sh stop >/dev/null 2>&1 || true' EXIT
export DATABASE_URL="postgres://postgres:postgres@127.0.0.1:$PGBOUNCER_PORT/relay_pooler"
export DATABASE_DIRECT_URL="postgres://postgres:postgres@127.0.0.1:5432/relay_pooler"
export DATABASE_POOLER=transaction
export REDIS_URL="redis://127.0.0.1:6379/${TEST_POOLER_REDIS_DB:-4}"
export SECRET_KEY=test-secret-key RELAY_MASTER_KEY=test-master-key RELAY_ADMIN_TOKEN=test-admin-token DEBUG=0
RELAY_BATCH_PAYLOAD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/relay-test-pooler.XXXXXX")
export RELAY_BATCH_PAYLOAD_DIR
trap 'rm -rf "$RELAY_BATCH_PAYLOAD_DIR"; [ "$started" = 1 ] && bash scripts/pgbouncer.sh stop >/dev/null 2>&1 || true' EXIT
.venv/bin/python -m pytest -p no:xdist -q tests/test_query_counts.py tests/test_batch_durability.py tests/test_pooler.py "$@"
