"""Shell fragments (ours, raw shell) that a node's script shares across backends: Slurm's node.sh and the command
of a Kubernetes pod: the placeholders as its variables, its ports, and the launcher run as a child ($LAUNCHER)
where it must act after the launcher ends.
"""

from __future__ import annotations

import shlex

from fleetbox.run import hang, node_log
from fleetbox.run import plan as planner
from fleetbox.run.shell import Raw


def node_vars(index: str, **own) -> dict:
    """The placeholders (run/placeholders.py) as the node script's shell variables, `index` the one holding the
    node's number; `own`: the backend's own (Slurm's nnodes, a pod's user)."""
    return {"rank": Raw(f'"${index}"'), "node": Raw(f'node"${index}"'), "home": Raw('"$HOME"'), "user": Raw('"$USER"'),
            "master_ip": Raw('"$MASTER_IP"'), "node_ip": Raw('"$NODE_IP"'), "iface": Raw('"$IFACE"'),
            "attempt": Raw('"$FLEETBOX_ATTEMPT"'), "port_range": Raw('"$PORT_RANGE"'), **own}


def port_range(index: str, master_port: str, procs_per_node: int) -> str:
    """PORT_RANGE, the node's ranks' ports (planner.trainer_ports, in shell): `index` the variable holding the
    node's number, `master_port` the master's port (a number, or a variable's name)."""
    width = planner.block_width(procs_per_node)
    return (f'PORT_RANGE="$(({master_port} + 1 + {index} * {width})):'
            f'$(({master_port} + {width} + {index} * {width}))"')

# a node held after a collective's timeout, ended by the hang watcher's stop once it has the stacks (its look, the
# stacks' wait, a slow shared file system or API server); the cap, where no watcher runs
HOLD_S = 60
# wait until the launcher has ended (a signal the shell took ends a wait, not the launcher), its exit in $rc
WAIT_LAUNCHER = ['rc=0; wait "$LAUNCHER" || rc=$?',
                 'while kill -0 "$LAUNCHER" 2>/dev/null; do rc=0; wait "$LAUNCHER" || rc=$?; done']


def hold_after_timeout(logs: str, says: str, hold_s: float, bash: bool = True) -> str:
    """After WAIT_LAUNCHER, unless $STOPPING: when one of the node's ranks' logs (in the folder `logs`, a shell
    word) ends with a collective's own timeout or a peer's end after one, mark the node (hang.TIMED_OUT) and hold
    it `hold_s` seconds, still running, so that the hang watcher takes its stuck peers' stacks before anything
    stops them. `says`: the node log protocol's line start, as the node's script says it (node_log.says).

    bash (Slurm's node.sh, whose every process Slurm signals): the log's end read by process substitution, the
    hold a plain sleep. Else (sh, the shell alone signalled, a pod's PID 1): through a pipe (never under pipefail),
    and the hold a sleep waited for, so that a trap runs at once on a signal rather than after the sleep (which
    is then ended)."""
    pattern = shlex.quote(hang.WAITED)
    found = (f'grep -qsE -- {pattern} <(tail -c 65536 -- "$f" 2>/dev/null)' if bash else
             f'tail -c 65536 -- "$f" 2>/dev/null | grep -qsE -- {pattern}')
    hold = f"sleep {hold_s:g}" if bash else f'sleep {hold_s:g} & wait "$!" || {{ kill "$!" 2>/dev/null || true; }}'
    return (f'if [ "$rc" -ne 0 ] && [ -z "${{STOPPING:-}}" ]; then for f in {logs}/workerlog.*; do if {found}; '
            f'then echo "{says}${{f##*/}} {node_log.HELD}" >&2; : > {logs}/{hang.TIMED_OUT} || true; {hold}; break; '
            'fi; done; fi')
