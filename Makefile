# Tether developer entry points. Needs only python3 and make on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -q -p no:cacheprovider
# `make test` leaves the long chaos scenarios to `make test-chaos`.
TEST_MARKERS ?= not long
# The server tiers run two test files at a time (pytest-xdist, each file whole on one
# worker): most of their time is spent waiting on servers and child processes, not on
# the cores. `TEST_WORKERS=0` runs them one after another.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

.PHONY: venv test-deps test test-plain-nats test-unit test-integration test-e2e test-chaos up down env schemas lint clean demo dev-secrets

venv: $(VENV)/.installed

# Reinstalls only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The client and service tests run a second time on nats-py's own client, without the
# services' fast path (libs/tether/adapters/nats_fastpath.py); a reconciler fed by its
# process's projector reads nothing from NATS itself, so its runs (`fed`) are left out there.
PLAIN_NATS_TESTS := $(addprefix tests/integration/,test_client_feed.py test_client_timeline.py \
	test_client_runs.py test_client_hooks.py test_event_log.py test_pull.py test_parent.py \
	test_child_runner.py test_access_control.py test_reconciler.py test_registered_hooks.py)

# Chromium, redis-server and faketime, installed where missing (scripts/test-deps.sh).
test-deps:
	scripts/test-deps.sh

# Integration/e2e tests: throwaway NATS + Postgres around the whole pytest run.
test: venv test-deps $(VENV)/.restate-installed
	$(PY) scripts/devstack.py test -- $(PY) -m pytest -m "$(TEST_MARKERS)" $(PARALLEL) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-plain-nats

test-plain-nats: venv
	TETHER_NATS_FAST_PATH=false $(PY) scripts/devstack.py test -- \
		$(PY) -m pytest -m "($(TEST_MARKERS)) and not fed" $(PARALLEL) $(PYTEST_ARGS) \
		$(PLAIN_NATS_TESTS)

# Every chaos scenario (tests/chaos): each starts its own servers and breaks them.
test-chaos: venv test-deps
	$(PY) -m pytest -m chaos -s $(PYTEST_ARGS) tests/chaos

test-unit: venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# One tier against throwaway NATS + Postgres.
test-integration: venv
	$(PY) scripts/devstack.py test -- $(PY) -m pytest -m integration $(PARALLEL) $(PYTEST_ARGS)

test-e2e: venv
	$(PY) scripts/devstack.py test -- $(PY) -m pytest -m e2e $(PARALLEL) $(PYTEST_ARGS)

# Persistent dev servers (data in .tether/). `make down PURGE=1` also deletes the data.
up: venv
	$(PY) scripts/devstack.py up

down:
	$(PYTHON) scripts/devstack.py down $(if $(PURGE),--purge)

env:
	@$(PYTHON) scripts/devstack.py env

# The JSON Schemas and the AsyncAPI document under schemas/, and its page under docs/;
# the gateway's A2A cards and MCP tool list of the example agents the compose stack serves.
GATEWAY_DOC_AGENTS = examples.agents:Researcher,examples.agents:Importer,examples.agents:Summarizer
schemas: venv
	$(PY) -m tether.generate.schemas --write
	$(PY) -m tether.generate.asyncapi --write
	$(PY) -m tether.generate.gateway --agents $(GATEWAY_DOC_AGENTS) --write

# The Kubernetes dev overlay's secrets (deploy/k8s/overlays/dev/secrets/, not in git): a
# CA, NATS's and Postgres's certificates, every NATS user's NKey. Kept once made; compose
# makes its own (its `secrets` service).
dev-secrets: venv
	$(PY) -m tether.dev_secrets --out deploy/k8s/overlays/dev/secrets \
		--application demo:Assistant:on_import_done

# Ruff, and mypy over libs/tether ([tool.mypy] in pyproject.toml: strict on the domain
# and the contract).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build dist *.egg-info libs/*.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Throwaway NATS + Postgres, the services as three processes (the projector and the
# reconciler in one, as the shipped Compose file and manifests run them), and
# examples/demo.py (which ends with examples/model_parent.py's conversation);
# everything stops when the demo ends (on a terminal: after Enter) or on Ctrl-C.
DEMO_AGENTS := examples.agents:Researcher,examples.agents:Importer,examples.model_parent:Planner
DEMO_AGENTS := $(DEMO_AGENTS),examples.integrations.pydantic_ai_research:PydanticResearcher
DEMO_AGENTS := $(DEMO_AGENTS),examples.integrations.openai_agents_research:AgentsSdkResearcher
DEMO_AGENTS := $(DEMO_AGENTS),examples.integrations.langgraph_research:LangGraphResearcher
demo: venv
	$(PY) scripts/devstack.py run --hold --agents $(DEMO_AGENTS) \
		--service projector,reconciler --service parent --service child-runner \
		-- $(PY) examples/demo.py

# The benchmark (bench/README.md). `make bench RUNS=300` for a quick look;
# BENCH_ARGS passes more flags, e.g. BENCH_ARGS=--profile. Extras: `bench` (matplotlib,
# py-spy) and, for bench-peers, `peers` (dbos, celery[redis], psycopg, restate-sdk,
# hypercorn, aiohttp; the Celery peer starts a throwaway redis-server unless
# TETHER_BENCH_REDIS_URL names a Redis; the Restate peer runs its server, from npm, in a
# network namespace of its own); pip only warns while an extra is missing.
RUNS ?= 5000
BENCH_ARGS ?=

.PHONY: bench bench-peers

$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[dev,bench,peers]'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m bench.run --runs $(RUNS) $(BENCH_ARGS)

# The Restate peer's server: npm's @restatedev/restate-server-linux-x64 at the version
# bench/peers/restate_w1.py pins, under .venv/restate.
$(VENV)/.restate-installed: $(VENV)/.installed bench/peers/restate_w1.py
	$(PY) -m bench.peers.restate_w1 install
	touch $@

bench-peers: $(VENV)/.bench-installed $(VENV)/.restate-installed
	$(PY) -m bench.run --runs $(RUNS) --peers $(BENCH_ARGS)
