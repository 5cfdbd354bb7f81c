# The two commands a user needs: `make audit` (the main job) and `make test`.
# Each creates .venv on first use and installs everything (torch pinned to the CPU wheel 2.13.0).
PY      := .venv/bin/python
STAMP   := .venv/.installed
BUILD   := build
INJECT  ?=
OPS     ?=
DRILL   ?=

.PHONY: audit test test-fast bench proto clean kernels postgres chromium package-check lint

# The fused CPU digest kernel (agents/kernels/): built here, never inside training. If it cannot
# be built the agent warns once and uses the eager digest.
KERNEL  := agents/kernels/build/libnumaudit_digest.so

$(STAMP): pyproject.toml setup.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,frameworks]'
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0
	touch $(STAMP)

$(KERNEL): $(STAMP) agents/kernels/digest_cpu.cpp agents/kernels/dispatch.cpp agents/kernels/build.py
	$(PY) -m numaudit.agents.kernels.build || echo "make: kernel not built; the agent will use the eager digest"

kernels: $(KERNEL)

# PostgreSQL server binaries for the tests of the PostgreSQL store (tests/pgserver.py starts a
# throwaway server with initdb + pg_ctl; nothing is configured system-wide). Installed from the
# distribution's packages when initdb is missing; the PG tests fail, saying why, when it still
# cannot start (NUMAUDIT_PG=skip skips them explicitly).
PG_INITDB := $(firstword $(wildcard /usr/lib/postgresql/*/bin/initdb) $(shell command -v initdb 2>/dev/null))

postgres:
ifeq ($(PG_INITDB),)
	@bash tests/apt_install.sh postgresql NUMAUDIT_PG "the PostgreSQL tests"
else
	@true
endif

# Headless Chromium for the browser tests of the HTML report (tests/browser.py runs it with
# --dump-dom and --screenshot; nothing is configured system-wide). Installed from the
# distribution's packages when missing; the browser tests fail, saying why, when it still cannot
# start (NUMAUDIT_BROWSER=skip skips them explicitly).
CHROMIUM := $(firstword $(foreach b,chromium chromium-browser google-chrome,$(shell command -v $(b) 2>/dev/null)))

chromium:
ifeq ($(CHROMIUM),)
	@bash tests/apt_install.sh chromium NUMAUDIT_BROWSER "the browser tests"
else
	@true
endif

audit: $(STAMP) $(KERNEL)
	$(PY) -m examples.audit --build $(BUILD) $(if $(INJECT),--inject $(INJECT)) $(if $(OPS),--ops $(OPS)) $(if $(DRILL),--drill)

test: $(STAMP) $(KERNEL) postgres chromium
	$(PY) -m pytest -q --durations=15

test-fast: $(STAMP) $(KERNEL) postgres chromium
	$(PY) -m pytest -q -m "not slow"

# The code's own hygiene (CI, before make test): ruff over the product's packages and over the
# tests, benchmarks and examples that show how to use them, and mypy over the packages typed clean
# so far (MYPY_PACKAGES grows one package at a time). mypy reads them under their import root,
# numaudit.*, through links in a scratch tree.
LINT_DIRS     := agents auditor wire numaudit tests bench examples
MYPY_PACKAGES := -m numaudit -p numaudit.wire -p numaudit.protos -p numaudit.agents -p numaudit.auditor

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_DIRS)
	rm -rf $(BUILD)/typecheck && mkdir -p $(BUILD)/typecheck/numaudit
	ln -s $(CURDIR)/numaudit/__init__.py $(BUILD)/typecheck/numaudit/__init__.py
	for d in agents auditor wire protos; do ln -s $(CURDIR)/$$d $(BUILD)/typecheck/numaudit/$$d; done
	cd $(BUILD)/typecheck && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml $(MYPY_PACKAGES)

# numaudit installed the ordinary way (CI, after make test): sdist and wheel built, the wheel
# installed in a fresh virtual environment outside the checkout, the fused kernel loaded from it,
# a 2-rank job streamed to `auditor serve` and compared (tests/package/check_wheel.sh).
package-check: $(STAMP)
	PY=$(PY) bash tests/package/check_wheel.sh

bench: $(STAMP) $(KERNEL)
	$(PY) -m bench

# The proto is compiled as numaudit/protos/numaudit.proto (a link to protos/ in a scratch tree),
# so the generated code imports itself under the one import root, numaudit.protos.
proto: $(STAMP)
	rm -rf $(BUILD)/proto && mkdir -p $(BUILD)/proto/numaudit && ln -s $(CURDIR)/protos $(BUILD)/proto/numaudit/protos
	cd $(BUILD)/proto && $(CURDIR)/$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. numaudit/protos/numaudit.proto

clean:
	rm -rf $(BUILD) .pytest_cache agents/kernels/build
