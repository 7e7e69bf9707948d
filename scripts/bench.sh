#!/usr/bin/env bash
# `make bench`: the benchmark suite (bench/README.md). It prints figures; it never asserts timings.
# Sets up .venv, makes sure PostgreSQL and Redis answer on localhost, then runs by default
#   bench/sidebyside.py     — every hot-path figure of this tree beside the previous release's (the git ref in
#                             bench/BASELINE, checked out into .bench/baseline), measured alternately in pairs,
#                             with the target and whether it is met (relay_bench_sbs_*, Redis dbs 11 and 12;
#                             ~30 min, BENCH_QUICK=1 ~12 min; its knobs: the docstring of bench/sidebyside.py)
# and, when named in BENCH_ONLY, the single-tree reports of this checkout:
#   bench/live_overhead.py  — relay overhead per live request vs a direct call
#   bench/batch.py          — 50,000-item submit, batch throughput, 50,000-result fetch
#   bench/streaming.py      — streamed calls: time to first byte and chunk throughput vs direct
#   bench/webhooks.py       — batch-end webhooks: 10,000 events' delivered rate and p99, a receiver outage
#   bench/capacity.py       — live p50/p99 and 429s alone vs with a batch draining on the same key;
#                             a token-limited provider's 429 rate and drain (relay_bench_capacity, Redis db 12)
#   bench/provider_batch.py — a 50,000-record batch in provider mode: relay CPU, memory, polls, cost
#                             (relay_bench_provider, Redis db 8; ~7 minutes, most of it the fake's 120 s job)
# Each benchmark uses its own PostgreSQL database (relay_bench, relay_bench_batch, relay_bench_stream: dropped and
# recreated each run, dropped at the end) and Redis db (9, 10, 11: flushed at start and end), and stops
# every process it started, also on Ctrl-C. About 7-8 minutes at the defaults on a 2-core machine.
#
# Quick mode (a few minutes; every figure, on smaller batches; no 50,000-item drain):
#   BENCH_QUICK=1 make bench        (= make bench-quick)
#
# Knobs (environment; defaults in brackets; BENCH_QUICK=1 changes only the defaults):
#   BENCH_ONLY                [sidebyside] what to run, of sidebyside,live,batch,streaming,provider,webhooks,capacity:
#                             BENCH_ONLY=batch; the single-tree suite: BENCH_ONLY=live,batch,streaming,provider,webhooks,capacity
#   BENCH_TREE                [this checkout] the tree the side by side measures beside the previous release
#   BENCH_BASELINE            [bench/BASELINE] the previous release's git ref, for one run
#   BENCH_SBS_PAIRS           [3]     pairs of runs (previous, this) of each side-by-side figure
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
#   BENCH_STREAM_N            [200]   first-byte pairs (relay, direct) of the streaming benchmark
#   BENCH_STREAM_SECONDS      [3]     duration of each of its throughput cells (1 and 50 streams, unpaced and paced)
#   BENCH_STREAM_EVENT_MS     [10]    pace of its paced cells (ms between two events, a fast model's pace)
#   BENCH_STREAM_OPEN         [200]   streams held open while /healthz and whole answers are timed
#   BENCH_HOOKS_EVENTS        [10000] webhook events (bench/webhooks.py) to BENCH_HOOKS_ENDPOINTS [100] tenants' endpoints,
#                                     BENCH_HOOKS_SILENT [10] of them never answering, raised at BENCH_HOOKS_RATE [300]/s
#                                     from BENCH_HOOKS_RAISERS [3] processes
#   BENCH_REDIS_DB_HOOKS      [14]    the webhook benchmark's Redis db (PostgreSQL: relay_bench_hooks)
#   BENCH_PROVIDER_ITEMS      [50000] records of the provider-mode batch (OpenAI surface, binding batch_mode provider)
#   BENCH_PROVIDER_JOB_SECONDS [120]  how long the fake provider runs that job (the relay polls at its defaults)
#   BENCH_PROVIDER_WARMUP     [2000]  records of a small provider-mode batch first (a 5 s job); 0 skips it
#   BENCH_PROVIDER_RELAY_SAMPLE [2000] records run by the relay's worker (relay mode) for the cost table; 0 skips it
#   BENCH_REDIS_DB_PROVIDER   [8]     Redis db of the provider benchmark
#   BENCH_REDIS_DB_CAPACITY   [12]    Redis db of the capacity benchmark (PostgreSQL: relay_bench_capacity)
#   make bench-kinds (bench/kinds.py, run on its own, not by this script; BENCH_QUICK=1 lowers its defaults too):
#   BENCH_KINDS_ITEMS         [10000] records of each kind's provider-mode and relay-mode batch (quick: 2000)
#   BENCH_KINDS_JOB_SECONDS   [60]    how long the fake runs each provider job (quick: 30); the relay polls at its defaults
#   BENCH_KINDS_LIVE_N        [500]   live rounds (relay, direct) per kind (quick: 200); BENCH_KINDS_LIVE_WARMUP [50] (quick: 30)
#   BENCH_KINDS               [all]   the kinds, of openai,anthropic,azure_openai,openai_compatible,bedrock,vertex,gemini
#   BENCH_KINDS_SKIP          []      figures to leave out, of live,provider,relay,warmup
#   BENCH_REDIS_DB_KINDS      [13]    its Redis db (PostgreSQL: relay_bench_kinds)
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
  export BENCH_STREAM_N=${BENCH_STREAM_N:-100} BENCH_STREAM_SECONDS=${BENCH_STREAM_SECONDS:-2}
  export BENCH_HOOKS_EVENTS=${BENCH_HOOKS_EVENTS:-2000}
  export BENCH_PROVIDER_ITEMS=${BENCH_PROVIDER_ITEMS:-5000} BENCH_PROVIDER_JOB_SECONDS=${BENCH_PROVIDER_JOB_SECONDS:-30}
fi
bash scripts/venv.sh requirements-dev.txt
bash scripts/services.sh
echo "make bench: load before the run: $(uptime)"
# The side by side keeps both trees' stacks up for the whole run: about 100 PostgreSQL connections at its
# peak (scale-out), PostgreSQL's default limit. Said before a run that would fail for it half way.
pg_max=$(PGPASSWORD=postgres psql -h 127.0.0.1 -U postgres -Atc 'SHOW max_connections' 2>/dev/null || echo "")
if [[ -n $pg_max && $pg_max -lt 150 && ",${BENCH_ONLY:-sidebyside}," == *,sidebyside,* ]]; then
  echo "make bench: warning: PostgreSQL's max_connections is $pg_max; the side by side holds about 100 connections" \
    "(both trees' stacks). Raise it (ALTER SYSTEM SET max_connections = 200, then restart PostgreSQL)," \
    "or run one tree: make bench-single" >&2
fi

only=",${BENCH_ONLY:-sidebyside},"
start=$SECONDS
failed=()
if [[ $only == *,live,* || $only == *,streaming,* ]] && [[ ${BENCH_PEER:-1} != 0 ]]; then
  bash scripts/bench-litellm-venv.sh || echo "make bench: the LiteLLM peer could not be installed; its figures will be skipped"
fi
if [[ $only == *,sidebyside,* ]]; then
  .venv/bin/python -m bench.sidebyside || failed+=(sidebyside)
fi
if [[ $only == *,live,* ]]; then
  .venv/bin/python -m bench.live_overhead || failed+=(live_overhead)
fi
if [[ $only == *,batch,* ]]; then
  .venv/bin/python -m bench.batch || failed+=(batch)
fi
if [[ $only == *,streaming,* ]]; then
  .venv/bin/python -m bench.streaming || failed+=(streaming)
fi
if [[ $only == *,webhooks,* ]]; then
  .venv/bin/python -m bench.webhooks || failed+=(webhooks)
fi
if [[ $only == *,provider,* ]]; then
  .venv/bin/python -m bench.provider_batch || failed+=(provider_batch)
fi
if [[ $only == *,capacity,* ]]; then
  .venv/bin/python -m bench.capacity || failed+=(capacity)
fi
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "make bench: $((SECONDS - start)) s in all, at commit $commit; load after the run: $(uptime)"
if ((${#failed[@]})); then
  echo "make bench: failed: ${failed[*]}" >&2
  exit 1
fi
