# Docker gives GPUs (--gpus) through the NVIDIA Container Toolkit: its legacy hook on the node's PATH (else "could
# not select device driver"), its CDI hook (Docker 28's nvidia.cdi driver), or a runtime named nvidia. (`docker
# info` is read whole, never piped to `grep -q`: under pipefail a writer cut off early fails the test.)
if command -v nvidia-container-runtime-hook >/dev/null 2>&1 || command -v nvidia-cdi-hook >/dev/null 2>&1 ||
    grep '"nvidia"' <<<"$(docker info --format '{{json .Runtimes}}' 2>/dev/null || true)" >/dev/null; then
  echo "@SAYS@GPU prerequisite: the NVIDIA Container Toolkit (docker --gpus)"
else
  echo "@SAYS@GPU prerequisite missing: Docker here cannot give a container GPUs (no NVIDIA Container Toolkit: no nvidia-container-runtime-hook or nvidia-cdi-hook on PATH, no nvidia runtime): the admins install it and run \`nvidia-ctk runtime configure --runtime=docker\`" >&2
  exit 5
fi
