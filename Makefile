# The two commands of the README. Each does its own set-up.
.PHONY: run test lint bench bench-quick

run:
	@bash scripts/run.sh

test:
	@bash scripts/test.sh

lint:
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .

bench:
	@bash scripts/bench.sh

bench-quick:
	@BENCH_QUICK=1 bash scripts/bench.sh
