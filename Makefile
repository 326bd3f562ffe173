# The two commands a newcomer needs: `make demo` and `make test`. Both set everything up themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit rules rules-engines manifests setup tools control-plane clean bench lock

demo: setup
	$(BIN)/python -m examples.demo

# Every promtool test on VictoriaMetrics too (`make rules-engines`) runs inside `unit`, one pytest test
# per file (tests/test_rules_engines.py), beside the suite's other work. The control plane (built
# once, ~11 min) and the image are built while lint, mypy and promtool run (each target's output
# printed whole when it ends); the tools that need apt are installed first, one after the other, as
# apt takes one install at a time.
test: setup image-tools
	$(MAKE) --no-print-directory --output-sync=target -j lint typecheck rules control-plane image
	$(MAKE) --no-print-directory unit

setup: $(STAMP) tools

# uv.lock is the one lock file: every dependency (the `checks` and `test` extras included) at one
# version, with the hashes of its files. The virtualenv, the image (scripts/image/build.sh) and the
# README's install take their versions from it through `uv export`, and pip refuses a file whose hash
# differs. `make lock` updates it (the one command for that); commit the result.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
EXPORT := $(UV) export --quiet --frozen --no-emit-project --no-header --no-annotate --format requirements-txt

# pip installs only uv; uv installs the rest (with the hashes, from its cache in ~/.cache/uv when it
# has them: seconds instead of pip's minute and a half on a second checkout).
$(STAMP): pyproject.toml uv.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(EXPORT) --all-extras --output-file $(VENV)/requirements.txt
	$(UV) pip install --quiet --python $(BIN)/python --require-hashes --requirement $(VENV)/requirements.txt
	$(UV) pip install --quiet --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

# Resolves every dependency again at its newest allowed version and rewrites uv.lock.
lock: $(STAMP)
	$(UV) lock --upgrade

# Prometheus, promtool, Alertmanager, amtool (and kubectl, for the manifests) from Debian, installed
# only when missing; VictoriaMetrics and Prometheus 2.53 (pinned, from Debian trixie) into a cache.
tools:
	@bash scripts/install-tools.sh

# A real kube-apiserver and kube-controller-manager for tests/kube, built once from Debian's source
# package (~11 min on 2 cores) and cached in ~/.cache/accel-health/kube/; KUBEBUILDER_ASSETS=DIR uses
# yours instead (etcd, kube-apiserver, kube-controller-manager).
control-plane:
	@bash scripts/build-control-plane.sh >/dev/null

lint: $(STAMP)
	$(UV) lock --locked
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy's cache lives beside the other caches, so a new checkout of unchanged files checks in seconds
# (mypy compares a file's hash when its time differs); MYPY_CACHE_DIR=... puts it elsewhere.
MYPY_CACHE_DIR ?= $(HOME)/.cache/accel-health/mypy
typecheck: $(STAMP)
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(BIN)/mypy

# Every rule file and promtool test on both Prometheus releases `make test` covers: bookworm's 2.42
# (promtool on PATH) and 2.53, the LTS (scripts/install-prometheus-lts.sh, pinned, from trixie).
rules: tools
	promtool --version | head -n1
	promtool check rules alerts/*.yaml
	promtool test rules alerts/tests/*.yaml
	lts="$$(bash scripts/install-prometheus-lts.sh)" && "$$lts/promtool" --version | head -n1 \
		&& "$$lts/promtool" check rules alerts/*.yaml && "$$lts/promtool" test rules alerts/tests/*.yaml
	amtool check-config examples/alertmanager.yaml

# Every promtool test group through promtool and VictoriaMetrics' vmalert-tool (pinned in
# scripts/install-victoria-metrics.sh): fails on a verdict that differs and is not listed, with its
# reason, in alerts/README.md ("Prometheus, Thanos, Mimir and VictoriaMetrics").
rules-engines: setup
	$(BIN)/python -m scripts.compare_rule_engines

# The suite waits on servers more than it computes: two workers (pytest-xdist, each module on one
# worker, in order) take it from 12 to about 7.5 minutes on 2 cores. PYTEST_WORKERS=0 runs it in
# this process.
PYTEST_WORKERS ?= 2
unit: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

# Rewrites the objects in deploy/ rendered from alerts/*.yaml, examples/alertmanager.yaml,
# dashboards/*.json and remediator/default_policy.yaml. `make test` fails while they are stale
# (tests/deploy), renders every overlay with `kubectl kustomize` and validates what it renders.
manifests: $(STAMP)
	$(BIN)/python -m scripts.render_manifests

bench: setup
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# -- the container image (Containerfile) ------------------------------------------------------------
# `make image` builds ghcr.io/accel-health/accel-health:VERSION (pyproject.toml) offline with buildah
# (its downloads cached in ~/.cache/accel-health/image, like the control plane); `make image-test`
# builds it and runs it (tests/image: umoci + runc). `make test` builds it too: tests/image and the
# as-deployed scenarios in tests/kube run the project's containers from it.
.PHONY: image image-test image-tools

image-tools:
	@bash scripts/install-image-tools.sh

image: image-tools $(STAMP)
	bash scripts/image/build.sh

image-test: image $(STAMP)
	ACCEL_HEALTH_IMAGE_TEST=require $(BIN)/pytest tests/image
