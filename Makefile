# The README's two commands: `make example` and `make test`. Both set up .venv on first use, from
# requirements.lock: every package at the version and hash CI tested (torch: the CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: example test lint docs lock clean

$(VENV)/.installed: pyproject.toml requirements.lock
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes --no-deps -r requirements.lock
	# the project alone, built with the locked setuptools; compat: the clone's folder on sys.path
	# (a .pth), so `import gradscope` from the folder that holds the clone finds this package,
	# not the clone itself as an empty namespace package
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
	$(PY) -m pip check
	touch $@

example: $(VENV)/.installed
	$(VENV)/bin/gradscope norms configs/digits.yaml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the documentation site, every link and anchor checked; references generated from the code
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	@# served offline: no page loads a font, script or style from another site
	@! grep -rlE '(src|href)="https?://' site --include='*.html'

# the 15 slowest tests listed at the end, so CI's log shows where the time goes
test: lint docs
	$(PY) -m pytest --durations=15

# Re-resolve requirements.lock from pyproject.toml's ranges (needs pip-tools: pip install
# pip-tools). Indexes come from pip's own configuration, so the lock names none.
lock:
	pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
		--no-emit-find-links --extra test --extra docs -c constraints.txt -o requirements.lock pyproject.toml

clean:
	rm -rf $(VENV) scores.parquet .pytest_cache site
