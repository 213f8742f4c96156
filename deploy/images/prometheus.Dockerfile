# Prometheus from Debian's package, for docker-compose.offline.yml (no registry to pull it from).
# Same layout as the upstream image: config in /etc/prometheus, data in /prometheus.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# Debian stable's packages: the release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
# The package's own system user (no fixed uid in Debian).
# hadolint ignore=DL3066
USER prometheus:prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
