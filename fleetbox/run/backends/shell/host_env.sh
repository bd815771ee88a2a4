# No container: the env (FLEETBOX_VENV) must be one `invoke venv` made, its interpreter on this node; then the
# site's environment modules ("$@") are loaded with Lmod or Environment Modules, whichever the node has. Their
# init scripts and `module` itself read unset variables and return non-zero inside: -e and -u are off meanwhile.
if [ ! -f "$FLEETBOX_VENV/@RECORD@" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV is not an env made by invoke venv on $(hostname) (no @RECORD@)"; exit 3
fi
if [ ! -x "$FLEETBOX_VENV/bin/python" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV: its interpreter $(readlink "$FLEETBOX_VENV/bin/python") is not on $(hostname) (a venv needs it at the same path on every node)"; exit 3
fi
if [ "$#" -gt 0 ]; then
  set +eu
  if ! type module >/dev/null 2>&1; then
    for init in ${MODULESHOME:+"$MODULESHOME/init/bash"} /usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash \
        /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
      # shellcheck source=/dev/null
      if [ -r "$init" ]; then . "$init"; break; fi
    done
  fi
  if ! type module >/dev/null 2>&1; then
    echo "fleetbox: node $SLURM_NODEID on $(hostname): no \`module\` command (neither Lmod nor Environment Modules is set up here) to load: $*"; exit 4
  fi
  said=$(mktemp)
  for m in "$@"; do   # in this shell (a module changes its environment); what it says is kept for the summary
    module load "$m" 2>"$said"; rc=$?
    cat "$said" >&2
    if [ "$rc" -ne 0 ]; then
      echo "fleetbox: node $SLURM_NODEID on $(hostname): \`module load $m\` failed: $(grep -m 1 . "$said")"; rm -f "$said"; exit 4
    fi
  done
  rm -f "$said"
  set -eu
  echo "fleetbox: node $SLURM_NODEID on $(hostname): modules loaded: $*"
fi
set --
