# The site's environment modules ("$@": --modules), loaded before anything else on the node looks for a command
# (a runtime a module provides: apptainer, singularity), with Lmod or Environment Modules, whichever the node has.
# Their init scripts and `module` itself read unset variables and return non-zero inside: -e and -u are off
# meanwhile.
MODULES=("$@"); set --   # an init script may read or shift the positional parameters
if [ "${#MODULES[@]}" -gt 0 ]; then
  set +eu
  if ! type module >/dev/null 2>&1; then
    for init in ${MODULESHOME:+"$MODULESHOME/init/bash"} ${LMOD_PKG:+"$LMOD_PKG/init/bash"} \
        /usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash /etc/profile.d/z00_lmod.sh \
        /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
      # shellcheck source=/dev/null
      if [ -r "$init" ]; then . "$init"; break; fi
    done
  fi
  if ! type module >/dev/null 2>&1; then
    echo "@SAYS@no \`module\` command (neither Lmod nor Environment Modules is set up here) to load: ${MODULES[*]}"; exit 4
  fi
  said=$(mktemp) || { echo "@SAYS@no temporary file for the modules' messages"; exit 4; }
  for m in "${MODULES[@]}"; do   # in this shell (a module changes its environment); its words kept for the summary
    module load "$m" 2>"$said"; rc=$?
    cat "$said" >&2
    why=$(grep -m 1 . "$said")
    # Environment Modules 3.2 returns 0 for a module it cannot find: it must be among the loaded ones too
    case ":${LOADEDMODULES:-}:" in *":$m:"*|*":$m/"*) ;; *) [ "$rc" -ne 0 ] || rc=1 why="${why:-it is not among the loaded modules (${LOADEDMODULES:-none})}";; esac
    if [ "$rc" -ne 0 ]; then
      echo "@SAYS@\`module load $m\` failed: $why"; rm -f "$said"; exit 4
    fi
  done
  rm -f "$said"
  set -eu
  echo "@SAYS@modules loaded: ${MODULES[*]}"
fi
