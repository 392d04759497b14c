# `make run` serves the API; `make test` runs every test. Both set up what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test setup

run: $(PY)
	$(PY) scripts/dev.py run

test: $(PY)
	$(PY) scripts/dev.py test $(ARGS)

setup: $(PY)
	$(PY) scripts/dev.py setup

$(PY):
	$(PYTHON) -m venv $(VENV)
