# Tether developer entry points. Needs only python3 and make on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -q -p no:cacheprovider

.PHONY: venv test test-unit up down env schemas lint clean demo

venv: $(VENV)/.installed

# Reinstalls only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Integration/e2e tests: throwaway NATS + Postgres around the whole pytest run.
test: venv
	$(PY) scripts/devstack.py test -- $(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# Persistent dev servers (data in .tether/). `make down PURGE=1` also deletes the data.
up: venv
	$(PY) scripts/devstack.py up

down:
	$(PYTHON) scripts/devstack.py down $(if $(PURGE),--purge)

env:
	@$(PYTHON) scripts/devstack.py env

schemas: venv
	$(PY) -m tether.contract.schemas --write

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info libs/*.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Until the services of the runs issue land, the demo tours the log and the projections.
demo: venv
	$(PY) scripts/devstack.py test -- $(PY) examples/log_and_projections.py
