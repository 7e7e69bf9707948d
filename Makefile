# The two commands of the README. Each does its own set-up.
.PHONY: run test test-fast test-pooler lint bench bench-single bench-quick bench-scale bench-webhooks bench-kinds drill noisy-drill manage flower docs

run:
	@bash scripts/run.sh

test:
	@bash scripts/test.sh

# The unit tier alone (no services, no database): seconds.
test-fast:
	@bash scripts/test.sh --fast

# The durability, query-count and pooler suites through PgBouncer in transaction mode (docs/pooler.md).
test-pooler:
	@bash scripts/test_pooler.sh

lint:
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .

# This tree beside the previous release (bench/BASELINE), every hot-path figure measured alternately, with its
# target (bench/README.md, "Side by side with the previous release"). BENCH_ONLY=live,batch,… runs the single-tree reports.
bench:
	@bash scripts/bench.sh

# The single-tree reports of this checkout, as `make bench` ran them before the side by side.
bench-single:
	@BENCH_ONLY=$${BENCH_ONLY:-live,batch,streaming,provider,webhooks,capacity} bash scripts/bench.sh

# The multi-host drill (docs/many-hosts.md): three network namespaces, its own PostgreSQL and Redis, a
# few minutes; needs root (prints "drill: skipped: <reason>" and exits 0 without).
drill:
	@bash scripts/drill.sh

# The noisy-neighbour drill (docs/operations.md, bench/noisy.py): tenant B alone, then with tenant A doing its
# worst on the same relay; one line per attack, exit 1 when one is not contained. About 1-2 minutes.
noisy-drill:
	@bash scripts/venv.sh requirements-dev.txt && bash scripts/services.sh && .venv/bin/python -m bench.noisy

# Any manage.py command against the embedded relay: make manage ARGS="relay key create …"
manage:
	@bash scripts/embedded.sh manage.py $(ARGS)

# Flower for the embedded relay, on 127.0.0.1:5555 only.
flower:
	@bash scripts/embedded.sh celery -A relay flower --address=127.0.0.1 --port=5555

bench-quick:
	@BENCH_QUICK=1 bash scripts/bench.sh

# The claim, finish, sweeper, /metrics and admin at 2,000 and 1,000,000 rows (bench/scale.py), then a real
# drain by worker replicas through PgBouncer with the s3 store on both sizes (bench/scale_drain.py).
bench-scale:
	@bash scripts/bench_scale.sh

# Webhook delivery with 10 of 100 tenants' endpoints never answering (bench/webhooks.py): events/s and p99.
bench-webhooks:
	@bash scripts/venv.sh requirements-dev.txt && bash scripts/services.sh && .venv/bin/python -m bench.webhooks

# Per host kind (bench/kinds.py): live overhead against a direct call to the fake in the kind's own wire, and
# the same batch in provider mode and in relay mode: CPU per record, polls per job per minute, cost. BENCH_QUICK=1: 2,000 records.
bench-kinds:
	@bash scripts/venv.sh requirements-dev.txt && bash scripts/services.sh && .venv/bin/python -m bench.kinds

# A million records (bench/scale_million.py): 20 × 50,000 provider-mode records from 5 tenants through the API, PgBouncer and the s3 store, then the size measurements at 2k and at 1M rows (~20 min on 2 cores).
bench-million:
	@bash scripts/venv.sh requirements-dev.txt && bash scripts/services.sh && .venv/bin/python -m bench.scale_million

# The docs site (MkDocs + Material), strict: any warning fails. Output in site/ (git-ignored).
docs:
	@bash scripts/venv.sh requirements-dev.txt
	@NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
