#!/usr/bin/env bash
# Prepare a Debian/Ubuntu host for fleetbox: Docker Engine (installed and started), debootstrap, and the
# fleetbox Python package with its dev tools. Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '== %s\n' "$*"; }
if [ "$(id -u)" -ne 0 ]; then echo "setup-host.sh: run as root (it installs packages and starts dockerd)" >&2; exit 2; fi

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# HPC runtimes and a scheduler, for `invoke export`/`train --backend slurm` here and for the tests
# (a 2-node Slurm cluster in network namespaces, Podman, Charliecloud, a local registry).
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v ch-run >/dev/null 2>&1 || missing+=(charliecloud)
command -v podman >/dev/null 2>&1 || missing+=(podman)
# the init of Podman's pods (`podman kube play`, the kubernetes backend's tests): not a dependency of podman here
[ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)
command -v skopeo >/dev/null 2>&1 || missing+=(skopeo)
command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)   # the tests check the rendered Slurm scripts
command -v mksquashfs >/dev/null 2>&1 || missing+=(squashfs-tools)   # squashfs images (Charliecloud, the GPU checks)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)   # a real browser: the tests open `invoke board` in it
# a user's own venv from the system's Python, as on a login node without root (the tests install fleetbox so)
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
# a module system, as HPC sites have (`train --runtime none --modules`): Environment Modules (Lmod conflicts with it)
[ -r /usr/share/modules/init/bash ] || [ -r /usr/share/lmod/lmod/init/bash ] || missing+=(environment-modules)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} from the distribution"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  say "starting the Docker Engine (log: /var/log/fleetbox-dockerd.log)"
  if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
    systemctl start docker
  else
    nohup dockerd >/var/log/fleetbox-dockerd.log 2>&1 &
  fi
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "setup-host.sh: dockerd did not come up; see /var/log/fleetbox-dockerd.log" >&2; exit 1; }
fi
say "Docker Engine $(docker version --format '{{.Server.Version}}') is up"

say "installing the fleetbox package (editable, with dev tools) for $(command -v python3)"
# Debian's own python3 refuses pip installs (PEP 668, "externally managed"); on such a host install next
# to it anyway, since this machine is dedicated to fleetbox (use a venv by hand if it is not).
if ! python3 -m pip install -q --disable-pip-version-check -e ".[dev]" 2>/tmp/fleetbox-pip.err; then
  if grep -q externally-managed /tmp/fleetbox-pip.err; then
    python3 -m pip install -q --disable-pip-version-check --break-system-packages -e ".[dev]"
  else
    cat /tmp/fleetbox-pip.err >&2; exit 1
  fi
fi
say "host ready"
