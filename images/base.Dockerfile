# A system base from an OS image that is present or can be pulled: the one build step that uses the network.
# `invoke base` uses it when OS_IMAGE can be had, and debootstrap + `docker import` when it cannot.
ARG OS_IMAGE=debian:bookworm
FROM ${OS_IMAGE}
ARG PACKAGES="python3 libgomp1 ca-certificates"
# MIRROR is checked by fleetbox.image.bases.check_mirror: http(s), no credentials (build args stay in the
# image history), nothing sed or bash reads specially.
ARG MIRROR=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions come from the suite the OS image tracks; the base's tag hashes the package list.
# hadolint ignore=DL3008
RUN if [ -n "${MIRROR}" ]; then \
      sed -i "s|http://deb.debian.org/debian|${MIRROR}|g" /etc/apt/sources.list.d/debian.sources; \
    fi \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8
