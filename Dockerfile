# Podium images, one Dockerfile, two targets (docs/deploy.md; scripts/build-images.sh builds both):
#   control-plane  orchestrator + leaderboard + the `podium` CLI (no torch):
#                  docker build --target control-plane -t podium-control-plane .
#   pod            a training pod (torch, a C/C++ compiler and tcmalloc for the compiled paths):
#                  docker build --target pod -t podium-pod .
#
# Build arguments:
#   BASE_IMAGE     the Python base of every stage (default python:3.12-slim-bookworm). Any
#                  Debian-like image with python3 and its venv module works: where no registry
#                  is reachable, scripts/build-images.sh makes one from Debian packages.
#   TORCH_VERSION, TORCH_VARIANT
#                  the pod's torch, pinned exactly as torch==VERSION+VARIANT (cpu, or a CUDA
#                  build such as cu128; the wheels carry the CUDA runtime, the NVIDIA container
#                  toolkit adds the driver): a source that offers only another build fails the
#                  build instead of installing it.
#   PIP_OFFLINE    1: install only from ./wheelhouse (pip --no-index): air-gapped machines, or
#                  networks whose proxy the build cannot pass. scripts/build-images.sh fills it.
# Behind a TLS-intercepting proxy, put the proxy's CA certificate at wheelhouse/ca.pem: pip
# trusts it (it stays in the build stages, never in an image); HTTPS_PROXY is a predefined
# build argument. No `# syntax=` line and no RUN --mount: both builders (BuildKit and the classic
# one) build this file without fetching anything from a registry but the base image.
#
# Stage order matters to the classic builder, which builds every stage before the target: the
# control-plane stages come first, so `--target control-plane` never installs torch.
ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---- base: the one place the base image is named ----------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheelhouse \
    PYTHONDONTWRITEBYTECODE=1

# ---- deps: the control plane's venv (pyproject's dependencies, no extras) ---------------------
FROM base AS deps
ARG PIP_OFFLINE=0
WORKDIR /src
COPY wheelhouse/ /wheelhouse/
COPY deploy/images/venv-install.sh /usr/local/bin/
COPY pyproject.toml ./
# Requirements first (a layer that survives source and README changes), then the project.
# No byte code: it is a third of the venv, and costs the services about 2 s once per start
# (docs/benchmarks.md); PYTHONPYCACHEPREFIX below keeps what they compile in /tmp.
RUN NO_COMPILE=1 venv-install.sh requirements
COPY README.md ./
COPY services ./services
RUN NO_COMPILE=1 venv-install.sh project

# ---- runtime: non-root user, no build tools ----------------------------------------------------
FROM base AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PODIUM_HOST=0.0.0.0 \
    PODIUM_DATA_DIR=/data \
    MPLCONFIGDIR=/tmp/matplotlib \
    HOME=/tmp
# /data is where the services keep their files: mount a volume there (compose, the chart).
RUN groupadd --system --gid 10001 podium \
    && useradd --system --uid 10001 --gid podium --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin podium \
    && mkdir -p /data \
    && chown podium:podium /data
WORKDIR /app

# ---- control-plane -----------------------------------------------------------------------------
FROM runtime AS control-plane
COPY --from=deps /opt/venv /opt/venv
# Byte code compiled at start goes to /tmp (a tmpfs in compose and the chart; the root is
# read-only); where /tmp cannot be written Python just compiles in memory. (An empty
# PYTHONDONTWRITEBYTECODE is unset for Python.)
ENV PYTHONDONTWRITEBYTECODE="" \
    PYTHONPYCACHEPREFIX=/tmp/pycache
USER 10001:10001
# 8000: orchestrator (default command); the leaderboard runs with the command
# "services.leaderboard" and PODIUM_PORT=8001; the CLI with --entrypoint podium.
EXPOSE 8000 8001
# /livez on PODIUM_PORT, else on either service's default port (a leaderboard run without it).
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u\nfor p in [os.environ['PODIUM_PORT']] if os.environ.get('PODIUM_PORT') else ['8000', '8001']:\n    try:\n        u.urlopen('http://127.0.0.1:' + p + '/livez', timeout=1)\n        raise SystemExit(0)\n    except OSError:\n        pass\nraise SystemExit(1)"]
ENTRYPOINT ["python", "-m"]
CMD ["services.orchestrator"]

# ---- pod-deps: torch (exact build) + the pod extra, in a venv of their own ---------------------
FROM base AS pod-deps
ARG PIP_OFFLINE=0
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
WORKDIR /src
COPY wheelhouse/ /wheelhouse/
# torch alone first: the largest layer, rebuilt only when the torch arguments change.
RUN set -eu; \
    if [ "$PIP_OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; \
    else export PIP_INDEX_URL="https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        PIP_EXTRA_INDEX_URL=https://pypi.org/simple; fi; \
    if [ -f /wheelhouse/ca.pem ]; then export PIP_CERT=/wheelhouse/ca.pem; fi; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install "torch==${TORCH_VERSION}+${TORCH_VARIANT}"
COPY deploy/images/venv-install.sh /usr/local/bin/
COPY pyproject.toml ./
RUN PIN="torch==${TORCH_VERSION}+${TORCH_VARIANT}" venv-install.sh requirements pod
COPY README.md ./
COPY services ./services
# setuptools stays: inductor's C++ builds import it (torch.utils.cpp_extension).
RUN KEEP_SETUPTOOLS=1 venv-install.sh project

# ---- pod (last, so a plain `docker build .` gives the training image) -------------------------
FROM runtime AS pod
# What the compiled training paths need at run time (Debian's packages: both bases are
# bookworm): a C/C++ compiler and Python's headers (inductor's CPU kernels and the host side of
# every backend are C++ that includes Python.h; Triton, in the CUDA builds, compiles its
# launchers with a C compiler against them too: Debian's Python needs python3-dev for them,
# python:*-slim has them), and tcmalloc, which the pod preloads itself (services/malloc.py;
# PODIUM_POD_MALLOC=system turns it off). The compile cache must be on an exec-mountable
# volume (the chart's emptyDir is; Docker's --tmpfs is noexec).
# hadolint ignore=DL3008,SC2086
RUN set -eu; \
    pkgs="g++ libtcmalloc-minimal4"; \
    python3 -c 'import os, sysconfig; os.stat(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
        2>/dev/null || pkgs="$pkgs python3-dev"; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*
COPY --from=pod-deps /opt/venv /opt/venv
USER 10001:10001
# The pod serves Prometheus metrics where PODIUM_METRICS_PORT is set (0: a free port, no fixed
# one to expose); the healthcheck is that the process is alive and, when metrics are served,
# that they answer.
HEALTHCHECK --interval=30s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; p = os.environ.get('PODIUM_METRICS_PORT'); p and p != '0' and urllib.request.urlopen('http://127.0.0.1:' + p + '/metrics', timeout=2)"]
ENTRYPOINT ["python", "-m", "services.pod"]
