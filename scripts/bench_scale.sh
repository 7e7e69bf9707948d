#!/usr/bin/env bash
# `make bench-scale`: bench/scale.py — the claim, finish, sweeper, /metrics and admin at 2,000 and at
# 1,000,000 rows (BENCH_SCALE_SIZES). Its own database (relay_bench_scale, dropped and recreated, dropped at
# the end unless BENCH_KEEP_DB=1) and Redis db (BENCH_REDIS_DB_SCALE, 13: flushed at start and end).
# Then bench/scale_drain.py — a real drain by worker replicas through PgBouncer with the s3 store (moto),
# on a small and a large history (relay_bench_scale_drain, Redis db BENCH_REDIS_DB_SCALE_DRAIN, 7);
# BENCH_SCALE_REAL_DRAIN=0 skips it. About 12 minutes at the defaults on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh requirements-dev.txt
bash scripts/services.sh
PG=${BENCH_PG_URL:-postgres://postgres:postgres@127.0.0.1:5432}
DB=${BENCH_DB_PREFIX:-relay_bench}_scale
REDIS_DB=${BENCH_REDIS_DB_SCALE:-13}
export DATABASE_URL="$PG/$DB" REDIS_URL="${BENCH_REDIS_URL:-redis://127.0.0.1:6379}/$REDIS_DB"
export SECRET_KEY=bench-secret-key RELAY_MASTER_KEY=bench-master-key RELAY_ADMIN_TOKEN=bench-admin-token DEBUG=0
RELAY_BATCH_PAYLOAD_DIR=$(mktemp -d "${TMPDIR:-/tmp}/relay-bench-scale.XXXXXX")
export RELAY_BATCH_PAYLOAD_DIR
cleanup() {
  rm -rf "$RELAY_BATCH_PAYLOAD_DIR"
  .venv/bin/python -c "import redis,os; redis.Redis.from_url(os.environ['REDIS_URL']).flushdb()" || true
  [ "${BENCH_KEEP_DB:-0}" = 1 ] || psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null || true
}
trap cleanup EXIT
psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null
psql "$PG/postgres" -qc "CREATE DATABASE $DB" >/dev/null
.venv/bin/python -c "import redis,os; redis.Redis.from_url(os.environ['REDIS_URL']).flushdb()"
.venv/bin/python manage.py migrate -v 0
.venv/bin/python -m bench.scale
if [ "${BENCH_SCALE_REAL_DRAIN:-1}" != 0 ]; then
  (unset DATABASE_URL REDIS_URL RELAY_BATCH_PAYLOAD_DIR; .venv/bin/python -m bench.scale_drain)
fi
