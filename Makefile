# All set-up happens on demand: `make demo` and `make test` work on a fresh machine.
VENV ?= $(HOME)/.cache/xla_magic/venv
PY := $(VENV)/bin/python
# `make test STACKS=kaggle` runs one stack (scripts/stacks/).
STACKS ?= current colab kaggle

.PHONY: setup demo test bench docs notebooks dist
setup:
	@scripts/setup-venv --stack current "$(VENV)"

demo: setup
	$(PY) scripts/demo.py

# The whole suite on the current stack, and what differs on Colab's and Kaggle's;
# first Debian's chromium for the browser test, when missing (scripts/install-browser).
test:
	@scripts/install-browser
	XLA_MAGIC_VENV="$(VENV)" scripts/test-stacks $(STACKS)

bench: setup
	$(PY) benchmarks/run.py

# The documentation site (mkdocs.yml), strict: a broken link, a missing page or a
# stale generated page fails. Into build/site (git-ignored); `mkdocs serve` to browse.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

# Each notebook written from its jupytext script (notebooks/*.py), the quickstart run to keep its outputs.
notebooks: setup
	$(PY) notebooks/sync.py

# The release's files, as PyPI would take them: dist/xla_magic-VERSION.tar.gz and the wheel built from it.
dist: setup
	$(PY) -m build -o dist .
	$(PY) -m twine check --strict dist/*
