# Two commands for a newcomer: `make serve` and `make test`. Both set up .venv first (once).
PY := .venv/bin/python

.PHONY: setup serve test bench
setup:
	@bash scripts/setup.sh

serve: setup
	$(PY) -m minicore serve $(ARGS)

test: setup
	$(PY) -m ruff check minicore tests benchmarks examples
	$(PY) -m pytest -n 2 --dist worksteal --durations=15 $(ARGS)

bench: setup
	$(PY) benchmarks/bench_scheduler.py
