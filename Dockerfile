# syntax=docker/dockerfile:1
# Podium images, one Dockerfile, two targets:
#   control-plane  orchestrator + leaderboard (no torch):
#                  docker build --target control-plane -t podium-control-plane .
#   pod            a training pod (torch): docker build --target pod -t podium-pod .
#                  TORCH_VARIANT picks the torch wheel: cpu (default) or a CUDA build such as
#                  cu128 (the wheels carry the CUDA runtime; the NVIDIA container toolkit adds
#                  the driver), e.g. --build-arg TORCH_VARIANT=cu128.
# The pod image also holds the control plane, so docker-compose's orchestrator can run pods as
# local processes in its own container.

# ---- deps: control-plane requirements (pyproject's dependencies minus torch) ----------------
FROM python:3.12-slim-bookworm AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
# tomllib is stdlib: the requirement list stays pyproject's, with torch left out.
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(r for r in d['project']['dependencies'] if not r.startswith('torch')))" > /src/requirements.txt \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -r /src/requirements.txt
COPY services ./services
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps .

# ---- pod-deps: the same plus torch ------------------------------------------------------------
FROM deps AS pod-deps
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
RUN /opt/venv/bin/pip install --no-cache-dir \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}"

# ---- runtime base: non-root user, no build tools --------------------------------------------
# Same base as deps: the venv is copied over and must find the same Python.
FROM python:3.12-slim-bookworm AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PODIUM_HOST=0.0.0.0 \
    PODIUM_DATA_DIR=/data \
    MPLCONFIGDIR=/tmp/matplotlib \
    HOME=/tmp
RUN groupadd --system --gid 10001 podium \
    && useradd --system --uid 10001 --gid podium --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin podium \
    && mkdir -p /data \
    && chown podium:podium /data
WORKDIR /app
VOLUME ["/data"]

# ---- control-plane ----------------------------------------------------------------------------
FROM runtime AS control-plane
COPY --from=deps /opt/venv /opt/venv
USER 10001:10001
# 8000: orchestrator (default command); the leaderboard runs with the command
# "services.leaderboard" and PODIUM_PORT=8001.
EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PODIUM_PORT', '8000') + '/livez', timeout=2)"]
ENTRYPOINT ["python", "-m"]
CMD ["services.orchestrator"]

# ---- pod (last, so a plain `docker build .` gives the training image) -------------------------
FROM runtime AS pod
COPY --from=pod-deps /opt/venv /opt/venv
USER 10001:10001
# The pod's Prometheus endpoint (PODIUM_METRICS_PORT); the healthcheck is that the process is
# alive and, when metrics are served, that they answer.
EXPOSE 9100
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; p = os.environ.get('PODIUM_METRICS_PORT'); p and p != '0' and urllib.request.urlopen('http://127.0.0.1:' + p + '/metrics', timeout=2)"]
ENTRYPOINT ["python", "-m", "services.pod"]
