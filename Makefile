# `make run` serves the API; `make test` runs every test (on SQLite, then the database tests
# on PostgreSQL when one answers); `make screenshots` refreshes docs/screenshots/. All set up
# what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test setup screenshots

run: $(PY)
	$(PY) scripts/dev.py run

test: $(PY)
	$(PY) scripts/dev.py test $(ARGS)

screenshots: $(PY)
	$(PY) scripts/dev.py screenshots $(ARGS)

setup: $(PY)
	$(PY) scripts/dev.py setup

$(PY):
	$(PYTHON) -m venv $(VENV)
