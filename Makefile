# Tandem quick start:   make run    (serve the OpenAI API with the built-in demo model)
#                       make test   (the whole test suite, with lint and type checks)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup run test lint pytest bench clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

pytest: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test: lint pytest

bench: $(STAMP)
	$(VENV)/bin/python -m bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
