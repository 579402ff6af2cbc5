# One command each: `make train` (installs, then trains the default run) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, so that no other requirement pulls a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

.PHONY: install train test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

train: install
	$(PY) train.py $(ARGS)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs/runs outputs/multirun
