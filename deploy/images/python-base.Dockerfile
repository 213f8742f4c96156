# A Python base for the Podium Dockerfile made from Debian packages only, for machines that
# reach Debian's archive but no container registry: FROM a Debian image (on such a machine,
# debootstrap's minbase imported by scripts/build-images.sh), Debian's python3 and its venv module.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# Debian stable's packages: the release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*
