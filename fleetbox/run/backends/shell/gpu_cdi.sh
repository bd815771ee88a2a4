# Podman gives GPUs by CDI name (nvidia.com/gpu=INDEX): a CDI spec on the node must name each allocated one, or
# the container does not start ("unresolvable CDI devices"). nvidia-ctk lists the names its specs give.
if command -v nvidia-ctk >/dev/null 2>&1; then
  CDI=$(nvidia-ctk cdi list 2>/dev/null || true)
  MISSING=(); for g in ${GPUS//,/ }; do grep -qxF "nvidia.com/gpu=$g" <<<"$CDI" || MISSING+=("nvidia.com/gpu=$g"); done
  if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: no CDI spec here names ${MISSING[*]} (nvidia-ctk cdi list: $(grep -c '^nvidia\.com/' <<<"$CDI" || true) device(s)): the admins make one with \`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml\` (again after each driver update)" >&2
    exit 5
  fi
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: a CDI spec names nvidia.com/gpu=${GPUS//,/, nvidia.com/gpu=} (nvidia-ctk cdi list)"
else
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: not checked (no nvidia-ctk here to list the CDI specs)"
fi
