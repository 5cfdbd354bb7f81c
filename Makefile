# The two commands a user needs: `make audit` (the main job) and `make test`.
# Each creates .venv on first use and installs everything (torch pinned to the CPU wheel 2.13.0).
PY      := .venv/bin/python
STAMP   := .venv/.installed
BUILD   := build
INJECT  ?=

.PHONY: audit test test-fast bench proto clean kernels

# The fused CPU digest kernel (agents/kernels/): built here, never inside training. If it cannot
# be built the agent warns once and uses the eager digest.
KERNEL  := agents/kernels/build/libnumaudit_digest.so

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(KERNEL): $(STAMP) agents/kernels/digest_cpu.cpp agents/kernels/dispatch.cpp agents/kernels/build.py
	$(PY) -m agents.kernels.build || echo "make: kernel not built; the agent will use the eager digest"

kernels: $(KERNEL)

audit: $(STAMP) $(KERNEL)
	$(PY) -m examples.audit --build $(BUILD) $(if $(INJECT),--inject $(INJECT))

test: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q

test-fast: $(STAMP) $(KERNEL)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP) $(KERNEL)
	$(PY) -m bench

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/numaudit.proto

clean:
	rm -rf $(BUILD) .pytest_cache agents/kernels/build
