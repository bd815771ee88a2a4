# Podman gives GPUs by CDI name (nvidia.com/gpu=INDEX): a CDI spec on the node must name each allocated one, or
# the container does not start ("unresolvable CDI devices"). nvidia-ctk (1.14 or later) lists the names the specs
# in the usual folders give (/etc/cdi, /var/run/cdi); a containers.conf that names other folders is not
# second-guessed, nor is a list nvidia-ctk cannot make.
CONF_HOME="${XDG_CONFIG_HOME:-$HOME/.config}/containers"
CONFS=("${CONTAINERS_CONF:-}" /usr/share/containers/containers.conf /usr/share/containers/containers.conf.d/*.conf
       /etc/containers/containers.conf /etc/containers/containers.conf.d/*.conf "$CONF_HOME/containers.conf"
       "$CONF_HOME"/containers.conf.d/*.conf)
OWN_DIRS=$(grep -s -l '^[[:space:]]*cdi_spec_dirs' "${CONFS[@]}" || true)
CDI=""; LISTED=false
if command -v nvidia-ctk >/dev/null 2>&1 && CDI=$(nvidia-ctk cdi list 2>/dev/null); then LISTED=true; fi
if [ -n "$OWN_DIRS" ]; then
  echo "@SAYS@GPU prerequisite: not checked ($(xargs <<<"$OWN_DIRS") names its own CDI spec folders)"
elif ! $LISTED; then
  echo "@SAYS@GPU prerequisite: not checked (no nvidia-ctk here that lists the CDI specs)"
else
  MISSING=(); for g in ${GPUS//,/ }; do grep -xF "nvidia.com/gpu=$g" <<<"$CDI" >/dev/null || MISSING+=("nvidia.com/gpu=$g"); done
  if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "@SAYS@GPU prerequisite missing: no CDI spec here names ${MISSING[*]} (nvidia-ctk cdi list: $(grep -c '^nvidia\.com/' <<<"$CDI" || true) device(s)): the admins make one with \`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml\` (again after each driver update)" >&2
    exit 5
  fi
  echo "@SAYS@GPU prerequisite: a CDI spec names nvidia.com/gpu=${GPUS//,/, nvidia.com/gpu=} (nvidia-ctk cdi list)"
fi
