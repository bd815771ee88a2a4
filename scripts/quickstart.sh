#!/usr/bin/env bash
# One command from a clean checkout: set up this host, then run the main job on the default (cpu) variant:
# system base -> offline wheelhouse -> hermetic build -> verify -> a 2-node training run (smoke job).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-host.sh
python3 -m invoke up --variant "${1:-cpu}"
