# `make run` serves the API; `make test` runs every test (on SQLite, then the database tests
# on PostgreSQL when one answers); `make test-fast` runs the unit and in-process tests (no
# live server, daemon or model: docs/testing.md); `make screenshots` refreshes
# docs/screenshots/. All set up what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test test-fast setup screenshots

run: $(PY)
	$(PY) scripts/dev.py run

test: $(PY)
	$(PY) scripts/dev.py test $(ARGS)

test-fast: $(PY)
	$(PY) scripts/dev.py test-fast $(ARGS)

screenshots: $(PY)
	$(PY) scripts/dev.py screenshots $(ARGS)

setup: $(PY)
	$(PY) scripts/dev.py setup

$(PY):
	$(PYTHON) -m venv $(VENV)
