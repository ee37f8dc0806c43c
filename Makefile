# The two commands of the README, and a few conveniences.
.PHONY: demo serve test test-quick test-loaded lint proto bench

demo:          ## set up, start the stack on the embedded default model, send demo requests, stop
	scripts/setup.sh
	.venv/bin/python -m chunkwise_tools.serve --demo

serve:         ## set up and serve on 127.0.0.1:50051 until Ctrl-C
	scripts/setup.sh
	.venv/bin/python -m chunkwise_tools.serve

# Worker processes for the suite (pytest-xdist; whole files per worker, so a file's module-scoped
# stack starts once). Each worker gets cores / TEST_WORKERS OpenMP threads (tests/conftest.py).
TEST_WORKERS ?= 2

test:          ## set up with test dependencies, lint, and run the whole suite
	scripts/setup.sh test
	scripts/install-test-tools.sh
	$(MAKE) lint
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint:          ## ruff and mypy (both configured in pyproject.toml)
	.venv/bin/python -m ruff check .
	.venv/bin/python -m mypy

test-quick:    ## the unit tier: no service processes, no SmolLM2
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not smollm and not e2e"

test-loaded:   ## the whole suite beside LOAD busy processes (default 2): races show here before CI
	scripts/test-under-load.sh $(or $(LOAD),2)

proto:         ## regenerate chunkwise/v1 from proto/
	.venv/bin/python scripts/gen_proto.py

bench:         ## scheduler microbenchmark
	.venv/bin/python bench/scheduler_bench.py
