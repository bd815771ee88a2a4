#!/bin/bash
# fleetbox train-20261127-225842-88dc: one node's part (runtime none); run by srun on every node
set -euo pipefail
export USER="${USER:-$(id -un)}"
FLEETBOX_ATTEMPT="${FLEETBOX_ATTEMPT:-0}"   # job.sbatch counts allocations and restarts
route_to() {
  local out dev src
  out=$(ip -o route get "$1")
  dev=$(sed -n 's/.* dev \([^ ]*\).*/\1/p' <<<"$out")
  src=$(sed -n 's/.* src \([^ ]*\).*/\1/p' <<<"$out")
  if [ "$dev" = lo ] && [ "${1#127.}" = "$1" ]; then
    dev=$(ip -o -4 addr show | awk -v ip="$1" 'index($4, ip "/") == 1 {print $2; exit}')
    src=$1
  fi
  echo "$dev $src"
}
read -r IFACE NODE_IP <<<"$(route_to "$MASTER_IP")"
PORT_RANGE="$((MASTER_PORT + 1 + SLURM_NODEID * 4)):$((MASTER_PORT + 4 + SLURM_NODEID * 4))"
[ -n "$IFACE" ] || { echo "fleetbox: no interface on $(hostname) routes to $MASTER_IP" >&2; exit 2; }
echo "fleetbox: node $SLURM_NODEID on $(hostname): $IFACE $NODE_IP -> master $MASTER_IP:$MASTER_PORT"
for p in /work/wt-s0/train @JOB_DIR@/helpers @JOB_DIR@/node"$SLURM_NODEID" @JOB_DIR@/checkpoints /work/wt-s0/train/smoke.py /tmp/fleetbox-recorded/env; do [ -e "$p" ] || { echo "fleetbox: node $SLURM_NODEID on $(hostname): $p is not on this node: it must be on a file system every node mounts" >&2; exit 3; }; done
export FLEETBOX_VENV=/tmp/fleetbox-recorded/env
# No container: the env (FLEETBOX_VENV) must be one `invoke venv` made, its interpreter on this node; then the
# site's environment modules ("$@") are loaded with Lmod or Environment Modules, whichever the node has. Their
# init scripts and `module` itself read unset variables and return non-zero inside: -e and -u are off meanwhile.
if [ ! -f "$FLEETBOX_VENV/fleetbox-env.json" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV is not an env made by invoke venv on $(hostname) (no fleetbox-env.json)"; exit 3
fi
if [ ! -x "$FLEETBOX_VENV/bin/python" ]; then
  echo "fleetbox: image missing $FLEETBOX_VENV: its interpreter $(readlink "$FLEETBOX_VENV/bin/python") is not on $(hostname) (a venv needs it at the same path on every node)"; exit 3
fi
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
    echo "fleetbox: node $SLURM_NODEID on $(hostname): no \`module\` command (neither Lmod nor Environment Modules is set up here) to load: ${MODULES[*]}"; exit 4
  fi
  said=$(mktemp) || { echo "fleetbox: node $SLURM_NODEID on $(hostname): no temporary file for the modules' messages"; exit 4; }
  for m in "${MODULES[@]}"; do   # in this shell (a module changes its environment); its words kept for the summary
    module load "$m" 2>"$said"; rc=$?
    cat "$said" >&2
    why=$(grep -m 1 . "$said")
    # Environment Modules 3.2 returns 0 for a module it cannot find: it must be among the loaded ones too
    case ":${LOADEDMODULES:-}:" in *":$m:"*|*":$m/"*) ;; *) [ "$rc" -ne 0 ] || rc=1 why="${why:-it is not among the loaded modules (${LOADEDMODULES:-none})}";; esac
    if [ "$rc" -ne 0 ]; then
      echo "fleetbox: node $SLURM_NODEID on $(hostname): \`module load $m\` failed: $why"; rm -f "$said"; exit 4
    fi
  done
  rm -f "$said"
  set -eu
  echo "fleetbox: node $SLURM_NODEID on $(hostname): modules loaded: ${MODULES[*]}"
fi
SITE_PYTHONPATH="${PYTHONPATH:-}"   # a module's (or the caller's): kept after the helpers
export VIRTUAL_ENV="$FLEETBOX_VENV" PATH="$FLEETBOX_VENV/bin:$PATH"   # as the images have their venv
# the env's GPU libraries (a variant with them): ahead of a module's, under the names Paddle opens
# shellcheck source=/dev/null
if [ -f "$FLEETBOX_VENV/fleetbox-libraries.sh" ]; then . "$FLEETBOX_VENV/fleetbox-libraries.sh"; fi
cd /work/wt-s0/train
export PYTHONUNBUFFERED=1
export FLEETBOX_JOB=train-20261127-225842-88dc
export FLEETBOX_NODE="$SLURM_NODEID"
export FLEETBOX_VISUALDL_DIR=@JOB_DIR@/node"$SLURM_NODEID"/visualdl
export PORT_RANGE="$PORT_RANGE"
export FLEETBOX_PROGRESS_DIR=@JOB_DIR@/node"$SLURM_NODEID"
export GLOO_SOCKET_IFNAME="$IFACE"
export NCCL_SOCKET_IFNAME="$IFACE"
export NCCL_IB_DISABLE=1
export FLEETBOX_CHECKPOINT_DIR=@JOB_DIR@/checkpoints
export FLEETBOX_RESUME=auto
export FLEETBOX_ATTEMPT="$FLEETBOX_ATTEMPT"
export PYTHONPATH=@JOB_DIR@/helpers
[ -z "$SITE_PYTHONPATH" ] || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE_PYTHONPATH"
"$FLEETBOX_VENV/bin/python" -m paddle.distributed.launch --master "$MASTER_IP":"$MASTER_PORT" --host "$NODE_IP" --nnodes "$SLURM_NNODES" --rank "$SLURM_NODEID" --nproc_per_node 1 --log_dir @JOB_DIR@/node"$SLURM_NODEID" --log_overwrite true /work/wt-s0/train/smoke.py &
LAUNCHER=$!
trap 'STOPPING=1' TERM INT
rc=0; wait "$LAUNCHER" || rc=$?
while kill -0 "$LAUNCHER" 2>/dev/null; do rc=0; wait "$LAUNCHER" || rc=$?; done
LOGS=@JOB_DIR@/node"$SLURM_NODEID"
if [ "$rc" -ne 0 ] && [ -z "${STOPPING:-}" ]; then for f in "$LOGS"/workerlog.*; do if grep -qsE -- 'gloo::TimeoutException|gloo/transport/tcp/[A-Za-z_]+\.cc:[0-9]+\].*(TIMEOUT|Timed out)|gloo/transport/tcp/[A-Za-z_]+\.cc:[0-9]+\].*(Connection (closed|reset) by peer|ex_ == nullptr)' <(tail -c 65536 -- "$f" 2>/dev/null); then echo "fleetbox: node $SLURM_NODEID: ${f##*/} ended waiting in a collective; holding the node for its peers' stacks" >&2; : > "$LOGS"/COLLECTIVE-TIMEOUT || true; sleep 60; break; fi; done; fi
exit "$rc"
