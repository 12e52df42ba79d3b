# syntax=docker/dockerfile:1
# One image for every Tether service; the command picks the service:
#   docker run tether:dev services projector      (the default)
#   docker run tether:dev projections migrate

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies change far less often than the code, so their wheels are built from
# pyproject.toml alone: this layer stays cached across edits to libs/ and services/.
# The runtime's and the extras a deployment serves: the UI, the MCP gateway, the
# OpenAI-compatible model client and OpenTelemetry.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [r for e in ('ui', 'gateway', 'openai', 'otel') for r in p['optional-dependencies'][e]]))" \
        > requirements.txt \
    && pip wheel --wheel-dir /wheels/deps -r requirements.txt \
    && cp requirements.txt /wheels/deps/
COPY libs/ libs/
COPY services/ services/
RUN pip wheel --no-deps --wheel-dir /wheels/app .

FROM ${PYTHON_IMAGE} AS runtime
# No .pyc writes at runtime (the root filesystem is read-only); logs unbuffered, as JSON.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TETHER_LOG_FORMAT=json \
    TETHER_HEALTH_HOST=0.0.0.0 \
    TETHER_HEALTH_PORT=8084
# TETHER_HEALTH_PORT is pinned: each container runs one process (one service, or the
# projector and the reconciler together), so every container listens on the same port here
# and the HEALTHCHECK, compose and Kubernetes probes need no per-service port (outside
# containers the CLI keeps its per-service defaults 8081..8086, and 8080 for several).
RUN groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tether
# The openssl command: `python -m tether.dev_secrets` (compose's `secrets` service) makes
# the development certificates with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssl \
    && rm -rf /var/lib/apt/lists/*
# Bind mounts keep the wheels out of the image layers; the deps layer is reused until
# the dependency list changes.
RUN --mount=type=bind,from=build,source=/wheels/deps,target=/wheels/deps \
    pip install --no-index --find-links /wheels/deps -r /wheels/deps/requirements.txt
RUN --mount=type=bind,from=build,source=/wheels/app,target=/wheels/app \
    pip install --no-index --no-deps /wheels/app/*.whl
# The example children (examples/agents.py), so `TETHER_AGENTS=examples.agents:...` runs
# as it is in compose and the dev overlay; your own image adds your agents the same way.
COPY examples/ /app/examples/
ENV PYTHONPATH=/app

USER 10001:10001
WORKDIR /tmp
EXPOSE 8084
# /healthz only (alive): readiness depends on NATS and Postgres, and a dependency outage
# must not mark every Tether container unhealthy at once.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TETHER_HEALTH_PORT', '8084'), timeout=3)"]
ENTRYPOINT ["tether"]
CMD ["services", "projector"]
