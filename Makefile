# All set-up happens on demand: `make demo` and `make test` work on a fresh machine.
VENV ?= $(HOME)/.cache/xla_magic/venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench
setup:
	@scripts/setup-venv "$(VENV)"

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/run.py
