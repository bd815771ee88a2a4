# Podman gives GPUs by CDI name (nvidia.com/gpu=INDEX): a CDI spec on the node must name each allocated one, or
# the container does not start ("unresolvable CDI devices"). nvidia-ctk lists the names the specs in the usual
# folders give (/etc/cdi, /var/run/cdi); a containers.conf that names other folders is not second-guessed.
CONFS=("${CONTAINERS_CONF:-}" /etc/containers/containers.conf /usr/share/containers/containers.conf "$HOME/.config/containers/containers.conf")
OWN_DIRS=$(grep -s -l '^[[:space:]]*cdi_spec_dirs' "${CONFS[@]}" || true)
if ! command -v nvidia-ctk >/dev/null 2>&1; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: not checked (no nvidia-ctk here to list the CDI specs)"
elif [ -n "$OWN_DIRS" ]; then
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: not checked ($(xargs <<<"$OWN_DIRS") names its own CDI spec folders)"
else
  CDI=$(nvidia-ctk cdi list 2>/dev/null || true)
  MISSING=(); for g in ${GPUS//,/ }; do grep -xF "nvidia.com/gpu=$g" <<<"$CDI" >/dev/null || MISSING+=("nvidia.com/gpu=$g"); done
  if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite missing: no CDI spec here names ${MISSING[*]} (nvidia-ctk cdi list: $(grep -c '^nvidia\.com/' <<<"$CDI" || true) device(s)): the admins make one with \`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml\` (again after each driver update)" >&2
    exit 5
  fi
  echo "fleetbox: node $SLURM_NODEID on $(hostname): GPU prerequisite: a CDI spec names nvidia.com/gpu=${GPUS//,/, nvidia.com/gpu=} (nvidia-ctk cdi list)"
fi
