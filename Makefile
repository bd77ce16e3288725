# GPU Brrr: the two commands are `make book` and `make test` (see README.md).
#
#   make venv           .venv with the pinned requirements (CPU torch) and kernels/ installed editable
#   make book           vendor MathJax, build the site from the committed notebook outputs, -W -n
#   make test           lint, unit + book-structure tests, the book, the browser test, nbval
#   make lint           ruff check + ruff format --check
#   make bench          python -m kernels.bench on this machine (appends results/<gpu>.jsonl)
#   make gpu-notebooks  on a GPU machine: execute every notebook in place, then the benchmarks
#   make gpu-test       on a GPU machine: the whole pytest suite (its GPU-only cases included, in
#                       debug mode), then compute-sanitizer memcheck over scripts/gpu/sanitize_all.py
#                       (every kernel once at small odd shapes); writes a short dated log to
#                       results/gpu-test/<date>-<gpu-slug>.log (scripts/gpu_test.sh). Run it before
#                       submitting a kernel change; ARGS go to pytest (e.g. ARGS="tests/test_quant.py").
#   make gpu-forced-caps  on a GPU machine: every notebook with bf16, TMA and fp8 forced off (a T4's
#                       flags, GPU_BRRR_FORCE_CAPS): each must run its fallbacks to the end; writes
#                       results/gpu-test/<date>-<gpu-slug>-forced-caps-<HHMM>.log (scripts/run_forced_caps.sh)
#
# `bench`, `gpu-notebooks`, `gpu-test` and `gpu-forced-caps` run with $(PYTHON) (default python3:
# the interpreter that has your GPU's torch), not .venv, whose torch is the CPU build.

SHELL := /bin/bash
# The stages share _build/ and .venv/: run them one at a time even under make -j.
.NOTPARALLEL:
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gpu-brrr-stamp
CHROMIUM ?= /usr/bin/chromium
STAGE := tools/stage.sh
# --all: a fresh Sphinx environment every time, so a warning cannot hide in an incremental build.
JB_FLAGS ?= -W -n --keep-going --all
LINT_PATHS := $(wildcard kernels tests notebooks scripts tools/*.py)
# Each pytest stage also writes a JUnit report; .ci/run adds them up into one closing line.
REPORTS := _build/reports
PYTEST = $(BIN)/python -m pytest --junitxml=$(REPORTS)/$@.xml
# The unit tests run in one process per core (at most 4), each test file whole in one process: on
# CI's 2 cores 454 -> 343 s. JOBS=1: one process. Not the notebooks: Jupyter kernels started by two
# processes at once raced ("Kernel died before replying to kernel_info", 04b, 2026-11-27).
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PARALLEL = $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist loadfile)
NOTEBOOKS ?=
ARGS ?=

.PHONY: venv book mathjax chromium npm test test-unit test-nbval test-browser lint bench \
	gpu-notebooks gpu-test gpu-forced-caps clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install --disable-pip-version-check -e . --no-deps
	touch $@

# npm: tools/vendor_mathjax.sh needs it; Debian's package when missing and we are root.
npm:
	@if command -v npm >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "npm not found: installing Debian's npm"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; \
	else \
		echo "error: npm is needed to vendor MathJax (Debian: sudo apt-get install npm)"; exit 1; \
	fi

mathjax: npm
	@tools/vendor_mathjax.sh

book: venv mathjax
	rm -rf _build/html _build/jupyter_execute
	$(STAGE) book $(BIN)/jupyter-book build . $(JB_FLAGS)

# Debian's Chromium for the browser test (Playwright drives it; it never downloads a browser).
chromium:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ -n "$${GPU_BRRR_SKIP_BROWSER:-}" ]; then echo "GPU_BRRR_SKIP_BROWSER set: no browser test"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "$(CHROMIUM) not found: installing Debian's chromium"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "error: the browser test needs Chromium at $(CHROMIUM): sudo apt-get install chromium,"; \
		echo "       or CHROMIUM=/path/to/chromium make test (GPU_BRRR_SKIP_BROWSER=1 skips it)"; \
		exit 1; \
	fi

lint: venv
	$(STAGE) ruff-check $(BIN)/ruff check $(LINT_PATHS)
	$(STAGE) ruff-format $(BIN)/ruff format --check $(LINT_PATHS)

# Kernel tests (Triton interpreter mode on a CPU), bibliography, book structure; no browser.
test-unit: venv
	$(STAGE) pytest $(PYTEST) $(PARALLEL) tests -m "not browser"

# Every notebook re-executed on this machine (interpreter mode without a GPU); outputs are only
# compared in cells marked # NBVAL_CHECK_OUTPUT.
test-nbval: venv
	$(STAGE) nbval $(PYTEST) --nbval-lax --nbval-current-env notebooks

test-browser: venv chromium
	$(STAGE) browser env GPU_BRRR_CHROMIUM=$(CHROMIUM) $(PYTEST) tests/test_site.py -m browser

# pytest exits non-zero (5) when it collects no test, so an empty stage fails too.
test: venv chromium lint test-unit book test-browser test-nbval

bench:
	$(PYTHON) -m kernels.bench $(ARGS)

gpu-notebooks:
	$(PYTHON) scripts/run_gpu_notebooks.py $(NOTEBOOKS) $(ARGS)

gpu-test:
	PYTHON=$(PYTHON) scripts/gpu_test.sh $(ARGS)

gpu-forced-caps:
	PYTHON=$(PYTHON) scripts/run_forced_caps.sh $(NOTEBOOKS)

clean:
	rm -rf _build _vendor
