# Redis from Debian's package, for docker-compose.offline.yml (no registry to pull redis from).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# Debian stable's packages: the release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
# The package's own system user (no fixed uid in Debian).
# hadolint ignore=DL3066
USER redis:redis
EXPOSE 6379
# As the upstream image runs it: no config file, so not loopback-only ("protected mode").
CMD ["redis-server", "--protected-mode", "no"]
