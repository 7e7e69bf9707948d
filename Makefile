# The two commands of the README. Each does its own set-up.
.PHONY: run test lint bench

run:
	@bash scripts/run.sh

test:
	@bash scripts/test.sh

lint:
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .

bench:
	@bash scripts/bench.sh
