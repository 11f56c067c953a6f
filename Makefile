# The README's two commands: `make example` and `make test`. Both set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build; set TORCH="torch==2.13.0 --index-url ..." (or install torch first) for CUDA.
TORCH ?= torch==2.13.0

.PHONY: example test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	# pin the torch just installed, so the test extra (transformers) cannot swap in another build
	$(PY) -m pip freeze | grep '^torch==' > $(VENV)/torch-pin.txt
	# compat: the clone's folder on sys.path (a .pth), so `import gradscope` from the folder that
	# holds the clone finds this package, not the clone itself as an empty namespace package
	$(PY) -m pip install -q -c $(VENV)/torch-pin.txt -e '.[test]' --config-settings editable_mode=compat
	touch $@

example: $(VENV)/.installed
	$(VENV)/bin/gradscope norms configs/digits.yaml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) scores.parquet .pytest_cache
