#!/usr/bin/env bash
# `make bench`: the benchmark suite (bench/README.md). It prints figures; it never asserts timings.
# Sets up .venv, makes sure PostgreSQL and Redis answer on localhost, then runs
#   bench/live_overhead.py  — issue 3: relay overhead per live request vs a direct call
#   bench/batch.py          — issue 4: 50,000-item submit, batch throughput, 50,000-result fetch
# Each benchmark uses its own PostgreSQL database (relay_bench, relay_bench_batch: dropped and
# recreated each run, dropped at the end) and Redis db (9, 10: flushed at start and end), and stops
# every process it started, also on Ctrl-C. About 7-8 minutes at the defaults on a 2-core machine.
#
# Quick mode (a few minutes; every figure, on smaller batches; no 50,000-item drain):
#   BENCH_QUICK=1 make bench        (= make bench-quick)
#
# Knobs (environment; defaults in brackets; BENCH_QUICK=1 changes only the defaults):
#   BENCH_ONLY                [live,batch] run one of them only: BENCH_ONLY=batch
#   BENCH_ITEMS               [50000] items of the native submission, the results fetch and the JSONL upload
#   BENCH_ITEM_BYTES          [650]   size of one request (50,000 x 650 B = a 31 MiB body)
#   BENCH_THROUGHPUT_ITEMS    [2000]  items of the throughput batch, at BENCH_LATENCY_MS
#   BENCH_LATENCY_MS          [100]   fake-upstream latency of the throughput batch
#   BENCH_CEILING_ITEMS       [1000]  items of the 0 ms batch (the worker's own ceiling); 0 skips it
#   BENCH_DRAIN_LARGE_ITEMS   [50000] items of the large drain at BENCH_LATENCY_MS (~10-20 min); 0 skips it
#   BENCH_SCALE_ITEMS         [400]   items of each scale-out batch, at BENCH_SCALE_LATENCY_MS [1000]
#   BENCH_SCALE_WORKERS       [1,2,3] worker processes of the scale-out runs
#   BENCH_RL_ITEMS            [200]   items against the rate-limited provider (2 keys x BENCH_RL_KEY_RPS [5] req/s)
#   BENCH_RL_LIMIT_HEADERS    [1]     0: that provider sends no x-ratelimit-* headers (only 429 + Retry-After)
#   BENCH_PEER                [1]     0 skips the LiteLLM peer of the live benchmark (and its install)
#   BENCH_DB_PREFIX           [relay_bench] database names: <prefix>, <prefix>_batch
#   BENCH_SKIP_OPENAI_UPLOAD  [0]     1 skips the OpenAI-compatible JSONL upload + create figure
#   BENCH_ONLY_IO             [0]     1 runs only the batch benchmark's submit, results and upload parts (a, c, d)
#   BENCH_PYSPY               []      a directory: py-spy profiles of the web workers during a, c, d and of the
#                                     item worker during b (wall time; BENCH_PYSPY_IDLE=0: CPU only; py-spy installed)
#   BENCH_PYSPY_GIL           [0]     1: py-spy records only the thread holding the GIL (--gil): the interpreter's CPU
#   BENCH_RESULTS_VIA_WORKER  [0]     1 runs the 50,000 items through the worker (0 ms) instead of
#                                     completing them in the database before the results fetch (slow)
#   BENCH_KEEP_DB             [0]     1 keeps relay_bench_batch after the run, for inspection
#   BENCH_LIVE_N              [500]   sequential request pairs (relay, direct) of the live benchmark
#   BENCH_LIVE_WARMUP         [50]    warm-up pairs
#   BENCH_LIVE_CONCURRENCY    [8]     client threads of the requests/s figure
#   BENCH_LIVE_SECONDS        [5]     duration of the requests/s figure, per target
#   BENCH_LIVE_UPSTREAM_DELAY_MS [0]  fake-upstream latency of the live benchmark
#   BENCH_PG_URL              [postgres://postgres:postgres@127.0.0.1:5432]
#   BENCH_REDIS_URL           [redis://127.0.0.1:6379]
#   BENCH_REDIS_DB_LIVE       [9]     Redis dbs of the two benchmarks; a db holding someone else's keys
#   BENCH_REDIS_DB_BATCH      [10]    (e.g. a test run) is refused, never flushed
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${BENCH_QUICK:-0} == 1 ]]; then
  export BENCH_ITEMS=${BENCH_ITEMS:-5000} BENCH_THROUGHPUT_ITEMS=${BENCH_THROUGHPUT_ITEMS:-500}
  export BENCH_CEILING_ITEMS=${BENCH_CEILING_ITEMS:-200} BENCH_DRAIN_LARGE_ITEMS=${BENCH_DRAIN_LARGE_ITEMS:-0}
  export BENCH_SCALE_ITEMS=${BENCH_SCALE_ITEMS:-96} BENCH_RL_ITEMS=${BENCH_RL_ITEMS:-60}
  export BENCH_LIVE_N=${BENCH_LIVE_N:-200} BENCH_LIVE_WARMUP=${BENCH_LIVE_WARMUP:-30} BENCH_LIVE_SECONDS=${BENCH_LIVE_SECONDS:-3}
fi
bash scripts/venv.sh requirements-dev.txt
bash scripts/services.sh
echo "make bench: load before the run: $(uptime)"

only=",${BENCH_ONLY:-live,batch},"
start=$SECONDS
failed=()
if [[ $only == *,live,* ]]; then
  if [[ ${BENCH_PEER:-1} != 0 ]]; then
    bash scripts/bench-litellm-venv.sh || echo "make bench: the LiteLLM peer could not be installed; its figures will be skipped"
  fi
  .venv/bin/python -m bench.live_overhead || failed+=(live_overhead)
fi
if [[ $only == *,batch,* ]]; then
  .venv/bin/python -m bench.batch || failed+=(batch)
fi
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "make bench: $((SECONDS - start)) s in all, at commit $commit; load after the run: $(uptime)"
if ((${#failed[@]})); then
  echo "make bench: failed: ${failed[*]}" >&2
  exit 1
fi
