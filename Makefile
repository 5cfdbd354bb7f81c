# The two commands a user needs: `make audit` (the main job) and `make test`.
# Each creates .venv on first use and installs everything (torch pinned to the CPU wheel 2.13.0).
PY      := .venv/bin/python
STAMP   := .venv/.installed
BUILD   := build
INJECT  ?=

.PHONY: audit test test-fast bench proto clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

audit: $(STAMP)
	$(PY) -m examples.audit --build $(BUILD) $(if $(INJECT),--inject $(INJECT))

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) -m bench

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/numaudit.proto

clean:
	rm -rf $(BUILD) .pytest_cache
