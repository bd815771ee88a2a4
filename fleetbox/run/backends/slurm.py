"""The Slurm backend: the same job as an sbatch script plus a per-node script, submitted and followed.

One srun task per node (`--kill-on-bad-exit=1 --wait=60`); the master is the first host of the allocation,
resolved to a numeric IP; each node finds its own NIC and address towards the master, and the node's
placeholders become shell variables there ({rank} is $SLURM_NODEID). The container is started by the chosen
runtime (runtimes.py). Both scripts are rendered once, in `plan`: --dry-run prints them and `submit` writes
them, byte for byte.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import KW_ONLY, asdict, dataclass, replace
from pathlib import Path

from fleetbox import files, incontainer, settings
from fleetbox import options as parse
from fleetbox.errors import LeftRunning, UserError
from fleetbox.run import checkpoints, filesystems, hang, hostnet, node_log, placeholders, records
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backend import CANCELLED, Backend, Capabilities, Doctoring, Option, Plan
from fleetbox.run.backends import node_script, restarts, runtimes, slurm_step
from fleetbox.run.backends.runtimes import template
from fleetbox.run.backends.slurm_step import chain_end, goes_on, hang_of
from fleetbox.run.jobfolder import Layout
from fleetbox.run.judge import judge
from fleetbox.run.records import Handle, JobInfo, JobState
from fleetbox.run.result import JobResult, read_lines, smoke_report
from fleetbox.run.shell import Raw, line
from fleetbox.ship import shipped

# The placeholders on a Slurm node: shell variables of the node script (the job id is known in advance).
NODE_VARS = node_script.node_vars("SLURM_NODEID", nnodes=Raw('"$SLURM_NNODES"'), master_port=Raw('"$MASTER_PORT"'),
                                  gpus=Raw('"${GPUS:-}"'))

# The node's NIC and own address towards the master, found on the node (iproute2); on the master itself
# `ip route get` answers "local ... dev lo", so the interface holding the address is looked up instead.
ROUTE_SH = template("route_to.sh")

# The allocation chain (our own shell; JOB_DIR, CHECKPOINTS, MAX_ALLOCATIONS and MAX_RESTARTS are set, quoted,
# before it). An allocation whose script recorded "continue" (fleetbox_checkpoint, after Slurm's USR1 warning)
# and made progress is followed by the next one (a dependent job); a real failure is followed only while
# restarts remain, and so is a requeue by Slurm, which goes on from the newest checkpoint. Each allocation
# appends one JSON line to allocations.jsonl and moves its logs to alloc<N>/ before the next one starts; the
# last one's stay in the job folder.
CHAIN_SH = template("chain.sh")
STRAGGLER_NOTICE = "fleetbox: straggler: "   # run/hang.py's line in the batch output, shown live
SAYS = node_log.says("$SLURM_NODEID")   # node.sh's line of the node log protocol, its start (run/node_log.py)
HANG_PY = "hang.py"   # run/hang.py, copied into the job folder at submit: every allocation of a chain runs the same
# The in-container helpers, copied into the job folder at submit: a fleetbox installed where only the login node
# sees it (a venv on its local disk) still gives every node the same helpers
HELPERS = "helpers"

# What Slurm accepts in the #SBATCH lines we write (they cannot be quoted): a newline would start a command.
SBATCH_VALUES = {
    "partition": re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"),
    "account": re.compile(r"[A-Za-z0-9_.-]+"),
    "time": re.compile(r"(\d+-)?\d+(:\d+){0,2}|(?i:unlimited|infinite)"),
    "qos": re.compile(r"[A-Za-z0-9_.-]+"),
    "reservation": re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"),
    "constraint": re.compile(r"[A-Za-z0-9_.&|,\[\]()*:-]+"),   # features: a&b, a|b, [a|b], a*2
    "mem": re.compile(r"\d+[KMGT]?", re.I),   # per node; 0: all of each node's memory
}
SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+-]+")   # no '%': Slurm expands it in --output

# Slurm may send the warning up to a minute before the grace it was asked for (its event loop's resolution):
TIME_FORMS = "a duration like 90m or 48h, or Slurm's MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 4:00:00, 2-12"
# an allocation whose --time leaves less than this after the grace and that minute cannot start a job and save.
EARLY_WARNING = 60
MIN_WORK, SHORT_WORK = 60, 300   # seconds of work an allocation keeps at worst: refused below, warned below

# The CPUs each rank gets by default (its data loader workers share them): SkyPilot's Slurm defaults, 2 CPUs and 4
# with a GPU, given per rank, since one Slurm task per node holds all of that node's ranks. Without a request, a
# site that confines tasks (task/cgroup, task/affinity) runs every rank of a node on one CPU.
CPUS_PER_RANK = {False: 2, True: 4}   # key: the variant has an accelerator
WHOLE_NODE = "all"   # --cpus-per-node all: the nodes to the job alone (--exclusive), every CPU to its task

# What --sbatch-args may pass on: sbatch long options that leave the job's shape, files and outcome to fleetbox,
# by their whole names (sbatch reads an unambiguous start as the whole, and aliases such as --tasks-per-node
# exist: an allowlist, not a denylist), those that take a value always with one (a bare --comment would take the
# next #SBATCH word as its value), with values that cannot start another line or word.
SBATCH_PASSED = {   # name: takes a value
    "acctg-freq": True, "begin": True, "bb": True, "bbf": True, "comment": True, "contiguous": False,
    "core-spec": True, "cpu-freq": True, "deadline": True, "delay-boot": True, "dependency": True, "exclude": True,
    "gpu-freq": True, "gres-flags": True, "hint": True, "licenses": True, "mail-type": True, "mail-user": True,
    "mcs-label": True, "mem-bind": True, "network": True, "nice": True, "nodelist": True, "power": True,
    "prefer": True, "priority": True, "profile": True, "spread-job": False, "switches": True, "thread-spec": True,
    "time-min": True, "tmp": True, "use-min-nodes": False, "wckey": True,
}
SBATCH_ARG = re.compile(r"--([a-z][a-z0-9-]*)(?:=([A-Za-z0-9_.,:@+/=\[\]&|()*-]+))?")
OWN_SBATCH = {   # what fleetbox writes itself, and the option of ours that asks for it
    "partition": "--partition", "time": "--time", "account": "--account", "qos": "--qos",
    "constraint": "--constraint", "reservation": "--reservation", "mem": "--mem", "cpus-per-task": "--cpus-per-node",
    "exclusive": "--cpus-per-node all", "gpus-per-node": "--gpus-per-node", "gpus": "--gpus-per-node",
    "nodes": "--nodes", "job-name": "--job-id", "requeue": "--max-restarts", "no-requeue": "--max-restarts",
}


# sbatch's input variables (sbatch(1), INPUT ENVIRONMENT VARIABLES; Slurm 22.05's sbatch reads each): the option
# each sets. Slurm takes them over the script's #SBATCH lines, so a site's module or a user's shell would steer the
# job fleetbox planned (SBATCH_OPEN_MODE=truncate loses a requeued run's output, SBATCH_PARTITION another queue).
SBATCH_ENV = {f"SBATCH_{k}": v for k, v in {
    "ACCOUNT": "account", "ACCTG_FREQ": "acctg-freq", "ARRAY_INX": "array", "BATCH": "batch", "BURST_BUFFER": "bb",
    "CLUSTERS": "clusters", "CLUSTER_CONSTRAINT": "cluster-constraint", "CONSTRAINT": "constraint",
    "CONTAINER": "container", "CORE_SPEC": "core-spec", "CPUS_PER_GPU": "cpus-per-gpu", "CPU_FREQ_REQ": "cpu-freq",
    "DEBUG": "verbose", "DELAY_BOOT": "delay-boot", "DISTRIBUTION": "distribution", "ERROR": "error",
    "EXCLUSIVE": "exclusive", "EXPORT": "export", "GET_USER_ENV": "get-user-env", "GPUS": "gpus",
    "GPUS_PER_NODE": "gpus-per-node", "GPUS_PER_SOCKET": "gpus-per-socket", "GPUS_PER_TASK": "gpus-per-task",
    "GPU_BIND": "gpu-bind", "GPU_FREQ": "gpu-freq", "GRES": "gres", "GRES_FLAGS": "gres-flags", "HINT": "hint",
    "IGNORE_PBS": "ignore-pbs", "INPUT": "input", "JOB_NAME": "job-name", "MEM_BIND": "mem-bind",
    "MEM_PER_CPU": "mem-per-cpu", "MEM_PER_GPU": "mem-per-gpu", "MEM_PER_NODE": "mem", "NETWORK": "network",
    "NO_KILL": "no-kill", "NO_REQUEUE": "no-requeue", "OPEN_MODE": "open-mode", "OUTPUT": "output",
    "OVERCOMMIT": "overcommit", "PARTITION": "partition", "POWER": "power", "PROFILE": "profile", "QOS": "qos",
    "REQUEUE": "requeue", "REQ_SWITCH": "switches", "RESERVATION": "reservation", "SIGNAL": "signal",
    "SPREAD_JOB": "spread-job", "THREADS_PER_CORE": "threads-per-core", "THREAD_SPEC": "thread-spec",
    "TIMELIMIT": "time", "USE_MIN_NODES": "use-min-nodes", "WAIT": "wait", "WAIT4SWITCH": "switches",
    "WAIT_ALL_NODES": "wait-all-nodes", "WCKEY": "wckey"}.items()}
# a site's defaults that fleetbox may take where the job's script does not set the option itself: the queue, the
# account, the limit, and what --sbatch-args may pass (they leave the job's shape, files and outcome to fleetbox)
SBATCH_DEFAULTS = {"partition", "account", "qos", "reservation", "constraint", "time", *SBATCH_PASSED}
# srun's input variables (srun(1), INPUT ENVIRONMENT VARIABLES, Slurm 22.05): exported into the job (--export=ALL),
# they would reach the srun in its batch script; only where the configuration is stays
SRUN_ENV = frozenset(f"SLURM_{k}" for k in (
    "ACCOUNT ACCTG_FREQ BCAST BCAST_EXCLUDE BURST_BUFFER CLUSTERS COMPRESS CONSTRAINT CORE_SPEC CPUS_PER_GPU "
    "CPU_BIND CPU_FREQ_REQ DEBUG DEBUG_FLAGS DELAY_BOOT DEPENDENCY DISABLE_STATUS DISTRIBUTION DIST_PLANESIZE EPILOG "
    "EXACT EXCLUSIVE EXIT_ERROR EXIT_IMMEDIATE EXPORT_ENV GPUS GPUS_PER_NODE GPUS_PER_TASK GPU_BIND GPU_FREQ GRES "
    "GRES_FLAGS HINT IMMEDIATE JOB_ID JOB_NAME JOB_NUM_NODES KILL_BAD_EXIT LABELIO MEM_BIND MEM_PER_CPU MEM_PER_GPU "
    "MEM_PER_NODE MPI_TYPE NETWORK NNODES NO_KILL NPROCS NTASKS NTASKS_PER_CORE NTASKS_PER_GPU NTASKS_PER_NODE "
    "NTASKS_PER_SOCKET OPEN_MODE OVERCOMMIT OVERLAP PARTITION PMI_KVS_NO_DUP_KEYS POWER PROFILE PROLOG QOS "
    "REMOTE_CWD REQ_SWITCH RESERVATION RESV_PORTS SEND_LIBS SIGNAL SPREAD_JOB SRUN_REDUCE_TASK_EXIT_MSG STDERRMODE "
    "STDINMODE STDOUTMODE STEP_GRES STEP_KILLED_MSG_NODE_ID TASK_EPILOG TASK_PROLOG TEST_EXEC THREADS "
    "THREADS_PER_CORE THREAD_SPEC TIMELIMIT UMASK UNBUFFEREDIO USE_MIN_NODES WAIT WAIT4SWITCH WCKEY "
    "WORKING_DIR").split())


def submit_environment(environ, script: str) -> tuple[tuple[str, str, str], ...]:
    """What of the submitting shell's environment would steer the job (sbatch's SBATCH_* and srun's SLURM_* input
    variables), each (name, value, why it is left out; "": taken, a site's default the script does not set), by
    name. Pure: `script` is the job's batch script, whose #SBATCH lines are what fleetbox planned."""
    planned = set(re.findall(r"^#SBATCH --([a-z0-9-]+)", script, re.M))
    out = []
    for name in sorted(environ):
        if name.startswith("SBATCH_MEM_BIND_"):   # libslurm's parts of --mem-bind
            option = "mem-bind"
        elif name in SBATCH_ENV:
            option = SBATCH_ENV[name]
        elif name in SRUN_ENV:
            out.append((name, environ[name], "the job's srun would read it"))
            continue
        else:
            continue
        why = (f"fleetbox passes --{option}" if option in planned else "" if option in SBATCH_DEFAULTS
               else f"--{option} would change the job fleetbox planned")
        out.append((name, environ[name], why))
    return tuple(out)


def environment_line(env: tuple[tuple[str, str, str], ...]) -> str:
    """The one line that says what of the environment was taken and what left out ("" where nothing counts)."""
    def shown(name, value):   # one line whatever the value holds (a newline, a tab)
        return f"{name}={' '.join(value.split())[:60]}"
    left = [f"{shown(n, v)} ({why})" for n, v, why in env if why]
    taken = [shown(n, v) for n, v, why in env if not why]
    return "; ".join(([f"ignored from the environment: {', '.join(left)}"] if left else []) +
                     ([f"taken from the environment: {', '.join(taken)}"] if taken else []))


@dataclass(frozen=True)
class SlurmPlan(Plan):
    runtime: str
    image: str
    files: tuple[tuple[str, str], ...]    # (name in the job folder, text): job.sbatch, node.sh
    checkpoints: str = ""                 # the job's checkpoint folder (shared file system)
    image_why: str = ""                   # how the image was chosen (--image, or which export or push)
    environment: tuple[tuple[str, str, str], ...] = ()   # what of the environment steers it (submit_environment)


@dataclass
class SlurmHandle(Handle):
    """A Slurm job: its chain of allocations, named by the first one's Slurm job id."""
    _: KW_ONLY
    scheduler_job: str = ""   # its Slurm job id (the first of a chain of allocations)


@dataclass
class SlurmResult(JobResult):
    """A Slurm job's result: its summary.json also keeps the Slurm job id and final state under their own names
    (scripts and the cluster's tests read them); JobResult's scheduler and end_state say the same, in words."""
    _: KW_ONLY
    scheduler_job: str = ""     # the Slurm job id it ended in (a chain's last allocation)
    scheduler_state: str = ""   # its final JobState


@dataclass(frozen=True)
class SlurmLayout(Layout):
    """A chain's allocations: alloc<N>/ from 1, each node's task output in node<k>.log, and when each
    allocation began in its batch script's output."""

    def starts(self, job_dir: Path, job: dict) -> tuple[float | None, float | None]:
        first, last = super().starts(job_dir, job)
        if first is not None:
            return first, last
        said = [float(t) for out in job_dir.glob("slurm-*.out")
                for t in re.findall(r"^fleetbox: allocation \d+ started at ([\d.]+)$", out.read_text(errors="replace"),
                                    re.M)]
        return min(said, default=None), max(said, default=None)


class SlurmBackend(Backend):
    name = "slurm"
    about = "an sbatch job"
    plan_type = SlurmPlan
    handle_type = SlurmHandle
    layout = SlurmLayout(earlier="alloc<N>", first=1, node="node<k>", output="node<k>.log", entries={
        "node<k>.log": "Slurm: node k's task output",
        "alloc<N>": "Slurm: an earlier allocation's node logs",
        "CANCELLED.<N>": "`invoke cancel` asked (Slurm: the chain's first Slurm job)",
        "job.sbatch": "Slurm: the batch script, as submitted",
        "node.sh": "Slurm: what each node's task runs",
        "hang.py": "Slurm: the hang watcher every allocation runs (a copy, so a chain runs one version)",
        "helpers": "Slurm: fleetbox's in-container helpers (a copy, for the same reason)",
        "slurm-<N>.out": "Slurm: the batch script's output, per allocation",
        "allocations.jsonl": "Slurm: how each allocation ended",
        slurm_step.REPLACED: "Slurm: each node a spare took the place of",
        slurm_step.ALLOCATION_PYZ: "Slurm: what picks a failed step's next nodes (with --spare-nodes or --min-nodes)",
        "started.<N>": "Slurm: when an allocation's job step started"})
    # restarts: in the chain of allocations (job.sbatch); hangs: the batch script runs run/hang.py beside srun
    # spares and fewer nodes: the next step in the same allocation (job.sbatch's loop, slurm_step.py)
    capabilities = Capabilities(own_limit="Slurm: --time", restarts=True, watches_hangs=True,
                                attempts_are="allocations", names_hosts=True, spares=True, fewer_nodes=True)
    doctoring = Doctoring(reports_image=True,
                          unreported_fix="node.sh did not run on this node: see the batch output (slurm-<id>.out)")
    # another backend's own options, given to this one: why they have no place here
    foreign = {"hosts": "Slurm chooses the nodes", "devices": "Slurm chooses the GPUs: give --gpus-per-node"}
    options = (
        Option("runtime", "with --backend slurm: apptainer, singularity (SingularityCE), pyxis, charliecloud, podman, "
                          "docker (default), or none: no container, the env given with --venv", "docker"),
        Option("venv", "with --runtime none: an env made by `invoke venv`, on a file system every node sees "
                       "(placeholders such as {node} allowed)", ""),
        Option("modules", "with --backend slurm: environment modules each node loads first (Lmod or Environment "
                          "Modules), e.g. \"compiler/dtk/24.04.1\", or the runtime's own (\"apptainer/1.3\"; not "
                          "pyxis, which srun starts)", ""),
        Option("partition", "with --backend slurm: the partition (-p)", ""),
        Option("time", f"with --backend slurm: the time limit: {TIME_FORMS}", ""),
        Option("account", "with --backend slurm: the account (-A)", ""),
        Option("runtime_args", "with --backend slurm: extra options for the runtime, e.g. "
                               "\"--ulimit nproc=32768:32768\"", ""),
        Option("cpus_per_node", f"with --backend slurm: CPUs for each node's ranks and their data loaders (default "
                                f"{CPUS_PER_RANK[False]} per rank, {CPUS_PER_RANK[True]} with GPUs), or "
                                f"{WHOLE_NODE}: whole nodes (--exclusive)", ""),
        Option("mem", "with --backend slurm: memory for each node's ranks, e.g. 64G (0: all of each node's; "
                      "default: the partition's)", ""),
        Option("qos", "with --backend slurm: the quality of service (--qos)", ""),
        Option("constraint", "with --backend slurm: node features the nodes must have (--constraint), e.g. a100", ""),
        Option("reservation", "with --backend slurm: the reservation to run in (--reservation)", ""),
        Option("sbatch_args", "with --backend slurm: other sbatch options, each --name=value, e.g. "
                              "\"--mail-type=END --mail-user=me@example.org\"", ""),
        Option("max_allocations", "with --backend slurm: a job that checkpointed and stopped at its --time limit "
                                  "goes on in a new allocation, up to N allocations in all (default 1)",
               1, int, low=1, train_only=True),
        Option("signal_grace", "with --backend slurm: seconds before the --time limit at which the job is told to "
                               "checkpoint and stop (default 120; Slurm may send it up to a minute early)",
               120, int, low=1, high=65535, train_only=True),
    )

    def __init__(self, runtime: str = "docker", partition: str = "", time: str = "", account: str = "",
                 runtime_args: str = "", signal_grace: int = 120, max_allocations: int = 1, venv: str = "",
                 modules: str = "", cpus_per_node: str = "", mem: str = "", qos: str = "", constraint: str = "",
                 reservation: str = "", sbatch_args: str = ""):
        try:
            module_list = tuple(shlex.split(modules or ""))
        except ValueError as e:
            raise UserError(f"--modules cannot be split into words: {e}") from None
        if venv and runtime != runtimes.Host.name:
            raise UserError(f"--venv is for --runtime {runtimes.Host.name} (no container); runtime {runtime} runs "
                            f"an image")
        self.runtime = runtimes.get(runtime, venv or "", module_list)
        rt = self.runtime
        if not 1 <= signal_grace <= 65535:   # Slurm's --signal takes at most 65535 s
            raise UserError(f"--signal-grace must be between 1 and 65535 seconds (got {signal_grace})")
        if max_allocations < 1:
            raise UserError(f"--max-allocations must be at least 1 (got {max_allocations})")
        self.signal_grace, self.max_allocations = signal_grace, max_allocations
        self.sbatch = {"partition": partition or "", "time": slurm_time(time or ""), "account": account or "",
                       "qos": qos or "", "constraint": constraint or "", "reservation": reservation or "",
                       "mem": str(mem or "")}
        for key, value in self.sbatch.items():
            if value and not SBATCH_VALUES[key].fullmatch(value):
                raise UserError(f"--{key} {value!r} is not a value Slurm accepts for --{key}"
                                + (f" ({TIME_FORMS})" if key == "time" else ""))
        self.cpus_per_node = cpus_per_node_option(cpus_per_node)
        if self.cpus_per_node == WHOLE_NODE and not self.sbatch["mem"]:
            self.sbatch["mem"] = "0"   # an exclusive job gets only the memory it asks for: all of it
        self.sbatch_args = sbatch_args_option(sbatch_args)
        self.time_note = ""   # a time limit that leaves little work per allocation, said with each plan
        limit = time_seconds(self.sbatch["time"])
        if limit is not None:
            work = limit - signal_grace - EARLY_WARNING
            said = (f"--time {time} ({limit} s) less --signal-grace {signal_grace} s and the minute "
                    f"Slurm may warn early leaves {max(work, 0)} s of work per allocation")
            if work < MIN_WORK:
                raise UserError(f"{said}, under the {MIN_WORK} s a job needs to start and save: raise --time or "
                                f"lower --signal-grace")
            if work < SHORT_WORK:
                self.time_note = f"warning: {said}: start-up and the checkpoint take part of it"
        try:
            self.runtime_args = tuple(shlex.split(runtime_args or ""))
        except ValueError as e:
            raise UserError(f"--runtime-args cannot be split into words: {e}") from None
        self.doctoring = replace(type(self).doctoring, runtime=rt.name, label=f"slurm/{rt.name}",
                                 runtime_args=self.runtime_args, shm_settable=rt.sets_shm, runs_in_image=rt.has_image,
                                 unconfined="" if rt.confined else rt.unconfined_note(),
                                 no_driver_fix=rt.no_driver_fix)

    # -- plan and describe (pure once the spec is given) --

    def plan(self, spec: spec_mod.JobSpec) -> SlurmPlan:
        job_id = spec.job_id or spec_mod.new_job_id()
        job_dir = settings.runs_root() / job_id
        if not SBATCH_PATH.fullmatch(str(job_dir)):
            raise UserError(f"the runs folder {job_dir} cannot be written in an #SBATCH line (use letters, digits "
                            f"and ._-/ only); set FLEETBOX_RUNS to another folder")
        port = spec.port or hostnet.random_port()
        hostnet.check_room(port, planner.ports_needed(spec.nodes, spec.procs_per_node))
        self.runtime.refuse(spec, self.runtime_args)
        image, image_why = self.image(spec)
        ckpt = checkpoints.folder(spec.checkpoint_dir, job_dir)   # on the shared file system, like job_dir
        checkpoints.check_writable(ckpt)
        t = self.node_run(spec, job_id, job_dir, ckpt, records.owner())
        self.runtime.check(t, image)
        files = (("job.sbatch", self.render_sbatch(spec, job_id, job_dir, port, t, image, ckpt)),
                 ("node.sh", self.render_node_script(spec, job_id, job_dir, t, image)))
        spares = (f"note: --spare-nodes {spec.spare_nodes}: the allocation holds {spec.nodes + spec.spare_nodes} "
                  f"nodes and the job runs on {spec.nodes}; a node that fails, hangs or stops before the training is "
                  f"left out and the next spare takes its place, from the newest checkpoint, in the same allocation",) \
            if spec.spare_nodes else ()
        return SlurmPlan(spec, job_id, job_dir, port, self.runtime.name, image, files, str(ckpt), image_why,
                         submit_environment(os.environ, files[0][1]),
                         notes=(*((self.time_note,) if self.time_note else ()), *spares, *restarts.fewer_note(spec)))

    def node_run(self, spec: spec_mod.JobSpec, job_id: str, job_dir: Path, ckpt: Path,
                 owner: str = "") -> planner.NodeRun:
        """Pure: the runtime's node, its logs in job_dir/node<rank> (where run/hang.py looks), the helpers from the
        job folder's copy, the devices Slurm's allocation."""
        t = self.runtime.as_user(planner.template(spec, job_id, f"{job_dir}/{{node}}", checkpoints=str(ckpt),
                                                  owner=owner))
        t = replace(t, mounts=tuple(spec_mod.Mount(str(job_dir / HELPERS), m.dst, m.ro)
                                    if m.dst == settings.HELPERS_DIR else m for m in t.mounts))
        if t.accelerator:   # the node's devices are Slurm's allocation, read on the node
            t = self.runtime.for_allocation(t)
        return t

    def image(self, spec: spec_mod.JobSpec) -> tuple[str, str]:
        """What the runtime runs on every node, and why: a user's --image in the runtime's form, or what was
        shipped (exported, pushed) of the variant's build (runtimes.default_image)."""
        rt = self.runtime
        if not rt.has_image:
            return rt.venv, "the env given with --venv"
        if spec.image:
            return rt.given_image(spec.image), "--image"
        return runtimes.default_image(rt, spec.variant, shipped.built_here(spec.variant), shipped.load(spec.variant))

    def words(self, words, job_id: str) -> str:
        return line(placeholders.to_shell(w, {**NODE_VARS, "job_id": job_id}) for w in words)

    def node_paths(self, spec, t: planner.NodeRun, image: str) -> list[str]:
        """The paths a node needs from the shared file system, at the same place as here (placeholders kept): every
        mount's source but the devices' own (a DCU node's /opt/hyhal) and the user's --mount (node-local scratch
        is fine there), the script itself (its folder may be there, empty: a mount point), and the image or env
        where it is a path."""
        devices = {m.src for m in planner.device_options(spec, True).get("mounts", ())}
        users = {m.dst for m in spec.mounts}
        return list(dict.fromkeys([m.src for m in t.mounts if m.src not in devices and m.dst not in users] +
                                  [str(spec.script_path)] +
                                  ([image] if image.startswith("/") else [])))

    def paths_here(self, spec, t: planner.NodeRun, image: str, job_id: str) -> str:
        """node.sh's check that the node sees every path the job needs: one that is missing stops the node, named."""
        return (f"for p in {self.words(self.node_paths(spec, t, image), job_id)}; do "
                f'[ -e "$p" ] || {{ echo "{SAYS}$p is not on this node: it must '
                'be on a file system every node mounts" >&2; exit 3; }; done')

    def render_node_script(self, spec, job_id: str, job_dir: Path, t: planner.NodeRun, image: str) -> str:
        """What every srun task runs on its node."""
        rt = self.runtime
        lines = ["#!/bin/bash", f"# fleetbox {job_id}: one node's part (runtime {rt.name}); run by srun on every node",
                 "set -euo pipefail", 'export USER="${USER:-$(id -un)}"',
                 'FLEETBOX_ATTEMPT="${FLEETBOX_ATTEMPT:-0}"   # job.sbatch counts allocations and restarts',
                 *rt.prelude()]
        if rt.node_script_inside:   # Python, but no iproute2 there: the probe the Docker backend uses
            lines.append(f'read -r IFACE NODE_IP <<<"$(python -c {shlex.quote(incontainer.source("fleetbox_netinfo"))} '
                         f'"$MASTER_IP" --plain)"')
        else:
            lines += [ROUTE_SH, 'read -r IFACE NODE_IP <<<"$(route_to "$MASTER_IP")"']
        if spec.iface:
            lines.append(f"IFACE={shlex.quote(spec.iface)}")
        lines.append(Raw(node_script.port_range("SLURM_NODEID", "MASTER_PORT", spec.procs_per_node)))
        lines += ['[ -n "$IFACE" ] || '
                  '{ echo "fleetbox: no interface on $(hostname) routes to $MASTER_IP" >&2; exit 2; }',
                  f'echo "{SAYS}$IFACE $NODE_IP -> master $MASTER_IP:$MASTER_PORT"']
        if not rt.node_script_inside:   # else node.sh runs in the container, which srun made with the mounts
            lines.append(self.paths_here(spec, t, image, job_id))
        lines += [w if isinstance(w, Raw) else self.words(w, job_id) for w in rt.setup(t)]
        if spec.image_identity:
            lines += [f"IMAGE_REF={shlex.quote(image)}"] * rt.has_image + [rt.identify(image)]
        if not rt.node_script_inside and (home_cache := rt.home_cache_dir(t)):   # else mounted before node.sh
            lines.append(self.words(["mkdir", "-p", home_cache], job_id))
        given = []   # the words that hand the runtime the allocated devices
        if t.accelerator:
            shell, given = rt.allocation(t.accelerator, spec.procs_per_node)
            lines += shell + rt.gpu_prerequisite(t.accelerator, image)
            if t.accelerator == "cuda" and not rt.node_script_inside:
                lines.append(runtimes.template("gpu_uuids.sh"))
        lines += [f"export {k}={self.words([v], job_id)}" for k, v in rt.exports(t).items()]
        lines += rt.prelude_for(t)
        run = self.words([*rt.launch(t, image, [*given, *self.runtime_args])], job_id)
        held = self.hold_after_timeout(spec, t, job_id)
        if rt.kills_client_only:
            # A killed client leaves its container running: remove it when Slurm stops this task, at once (Slurm
            # sends SIGKILL after KillWait, which may be shorter than podman's 10 s graceful stop).
            rm = rt.remove_now(t.name)
            lines += [f"cleanup() {{ {self.words(rm, job_id)} >/dev/null 2>&1; exit 143; }}", "trap cleanup TERM INT",
                      f"{run} &", "LAUNCHER=$!", *node_script.WAIT_LAUNCHER, *held, 'exit "$rc"']
        elif held:
            # Slurm signals every process of the step, the launcher too: this shell only waits for it to end (a
            # checkpoint save on SIGTERM included), and then holds no node that is being stopped
            lines += [f"{run} &", "LAUNCHER=$!", "trap 'STOPPING=1' TERM INT", *node_script.WAIT_LAUNCHER, *held,
                      'exit "$rc"']
        else:
            lines.append("exec " + run)
        return "\n".join(lines) + "\n"

    def hold_after_timeout(self, spec, t: planner.NodeRun, job_id: str) -> list[str]:
        """node.sh's lines, after the launcher ended, that hold this node's task when one of its ranks was ended
        by a collective's own timeout (Gloo's 30 s), or by a peer that timeout ended: srun --kill-on-bad-exit
        would stop the other nodes at once, and the stuck rank among them with its stack. The mark tells
        run/hang.py to take every rank's stacks now and stop the step, which ends the hold."""
        log_dir = planner.ranks_log_dir(t)
        if not (spec.hang_timeout or spec.start_timeout) or log_dir is None:
            return []
        rt = self.runtime
        logs = log_dir if rt.node_script_inside else runtimes.mounted(log_dir, rt.paths(t))
        if logs is None:
            return []
        return [f"LOGS={self.words([logs], job_id)}",
                # our own fragment (raw shell): each rank's log end, as run/hang.py's timed_out() reads it
                Raw(node_script.hold_after_timeout('"$LOGS"', SAYS, node_script.HOLD_S))]

    def render_sbatch(self, spec, job_id: str, job_dir: Path, port: int, t: planner.NodeRun, image: str,
                      ckpt: Path) -> str:
        rt = self.runtime
        # B:USR1: the warning goes to this script only, which asks the training processes (whatever runtime
        # holds them) to checkpoint and stop through a file in the checkpoint folder
        head = ["#!/bin/bash", f"#SBATCH --job-name=fleetbox-{job_id}",
                f"#SBATCH --nodes={spec.nodes + spec.spare_nodes}", "#SBATCH --ntasks-per-node=1",
                f"#SBATCH --output={job_dir}/slurm-%j.out",
                "#SBATCH --open-mode=append",   # a requeued run keeps the cut one's output (Slurm truncates)
                f"#SBATCH --signal=B:USR1@{self.signal_grace}"]
        head += [f"#SBATCH --{k}={v}" for k, v in self.sbatch.items() if v]
        cpus_lines, cpus_srun = resources(self.cpus_per_node, spec.procs_per_node, bool(t.accelerator))
        head += cpus_lines + [f"#SBATCH {w}" for w in self.sbatch_args]
        # Slurm requeues a job on a node failure or preemption only where the job allows it: a restart
        head.append("#SBATCH --requeue" if spec.max_restarts else "#SBATCH --no-requeue")
        if spec.device != "cpu":   # one per process; node.sh gives each runtime exactly these
            head.append(f"#SBATCH --gpus-per-node={spec.gpus_each}")
        here = steps_here(spec)
        body = [
            "set -euo pipefail",
            f"JOB_DIR={shlex.quote(str(job_dir))}",
            f"CHECKPOINTS={shlex.quote(str(ckpt))}",
            f"MAX_ALLOCATIONS={self.max_allocations} MAX_RESTARTS={spec.max_restarts} NODES={spec.nodes}",
            CHAIN_SH,
            f"MASTER_PORT={port}",
            "export MASTER_PORT",
            # the master: the step's first node, as a numeric IP (Paddle's master needs one); its address asked of
            # the controller, again while it is busy (the loop ends in a success, else in a sleep: never an error
            # that ends the script), else the host name
            "find_master() {",
            '  MASTER_HOST=${STEP%%,*}',
            "  MASTER_ADDR=$(for wait in " + " ".join(str(w) for w in START_WAITS) + "; do "
            "scontrol show node \"$MASTER_HOST\" -o 2>/dev/null && break; sleep \"$wait\"; done "
            "| sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            "  MASTER_IP=$(getent ahostsv4 \"${MASTER_ADDR:-$MASTER_HOST}\" | awk 'NR == 1 {print $1}') || true",
            '  [ -n "$MASTER_IP" ] || { echo "fleetbox: the master $MASTER_HOST has no IPv4 address here" >&2; '
            'exit 2; }',
            "  export MASTER_IP",
            "}",
            # python3 runs run/hang.py and the choice of a failed step's next nodes (slurm_step.py), where asked
            "PYTHON=$(python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null && echo python3) "
            "|| true",
        ]
        if spec.hang_timeout or spec.start_timeout or here:
            body.append('[ -n "$PYTHON" ] || echo "fleetbox: no python3 3.8 or newer on $(hostname): no hang '
                        'detection, and no next step on a spare or fewer nodes, in this allocation" >&2')
        if here:   # the culprit (the judge's, slurm_step.py) left out: the next step on a spare, or one node fewer
            body += ["another_step() {",
                     # not after a cancel, nor once the time limit is near (Slurm warns once: STOP stays)
                     '  [ -n "$PYTHON" ] && [ ! -e "$JOB_DIR/CANCELLED.$CHAIN" ] && [ ! -e "$CHECKPOINTS/STOP" ] '
                     '&& [ "$(script_state)" != continue ] || return 1',
                     "  local next host nodes spent",
                     "  next=$(" + line(["python3", "-I", "-S", str(job_dir / slurm_step.ALLOCATION_PYZ),
                                        Raw('"$JOB_DIR" "$CHAIN" "$ALLOCATION"'), str(spec.procs_per_node),
                                        str(spec.min_nodes),
                                        Raw('"$RESTARTS" "$MAX_RESTARTS" "$STEP" "${SPARES:--}"')])
                     + ") && read -r host nodes spent <<<\"$next\" && [ -n \"$host\" ] || return 1",
                     '  step_here "$host" "$nodes" "$spent"',
                     "}"]
        else:
            body.append("another_step() { return 1; }")
        body += ["set +e", "while :; do",
                 "hosts; find_master",
                 'echo "fleetbox: job $SLURM_JOB_ID on $STEP, master $MASTER_HOST = $MASTER_IP:$MASTER_PORT"'
                 + (' "(spares: ${SPARES:-none})"' if here else ""),
                 'for k in $(seq 0 $((STEP_NODES - 1))); do mkdir -p "$JOB_DIR/node$k"; done',
                 # what an earlier run of this job id left for hang detection (our own fixed names: raw shell)
                 "rm -f " + " ".join(f'"$JOB_DIR"/node[0-9]*/{name}' for name in hang.LEFT_OVER)]
        if rt.node_script_inside and (home_cache := rt.home_cache_dir(t)):
            body.append(self.words(["mkdir", "-p", home_cache], job_id))   # the mount point, before srun mounts
        # the step's nodes, one task each (the allocation's task count, which the batch script's environment
        # holds, counts the spares too)
        srun = ["srun", "--kill-on-bad-exit=1", "--wait=60",
                Raw('--nodes="$STEP_NODES" --nodelist="$STEP" --ntasks="$STEP_NODES"'), "--ntasks-per-node=1",
                *cpus_srun,
                # each node's own log, fresh: the batch script's append (SLURM_OPEN_MODE) is for its own output
                f"--output={job_dir}/node%n.log", "--open-mode=truncate",
                *rt.srun_options(t, image), "bash", str(job_dir / "node.sh")]
        body += [self.words(srun, job_id) + " &",
                 "SRUN=$!", 'WATCH=""']
        if spec.hang_timeout or spec.start_timeout:   # run/hang.py as a program, standard library only
            # -I: the file's own folder (fleetbox/run) is not put on sys.path
            watch = line(["python3", "-I", str(job_dir / HANG_PY), str(job_dir), Raw('"$STEP_NODES"'),
                          str(spec.procs_per_node), f"{spec.hang_timeout:g}", f"{spec.start_timeout:g}",
                          Raw('"$FLEETBOX_ATTEMPT"'), Raw('"$SRUN"')])
            body.append(f'[ -z "$PYTHON" ] || {{ {watch} & WATCH=$!; }}')
        body += ["# wait returns early when USR1 arrives (the trap runs then); go on waiting for srun itself",
                 'while :; do wait "$SRUN"; rc=$?; '
                 'kill -0 "$SRUN" 2>/dev/null || { wait "$SRUN"; rc=$?; break; }; done',
                 'echo "fleetbox: the job step ended at $(date +%s.%N)"',   # every node's task: what hang tests time
                 '[ -z "$WATCH" ] || { kill "$WATCH" 2>/dev/null; wait "$WATCH" 2>/dev/null; }']
        if rt.kills_client_only:   # whatever a killed task left behind, on every node
            mine = [a for k in (settings.LABEL_JOB, settings.LABEL_OWNER) if k in t.labels
                    for a in ("--filter", f"label={k}={t.labels[k]}")]   # this job's, not another user's
            sweep = line([rt.name, "ps", "-aq", *mine]) + f" | xargs -r {rt.name} rm -f"
            body.append('srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --output=/dev/null bash -c '
                        f"{shlex.quote(sweep)} || true")
        body += ['{ [ "$rc" -ne 0 ] && another_step; } || break', "done"]
        body += ["next_allocation", 'exit "$rc"']
        return "\n".join(head + body) + "\n"

    def describe(self, plan: SlurmPlan) -> str:
        said = environment_line(plan.environment)
        return "\n".join([f"# image: {plan.image} ({plan.image_why})"] + ([f"# {said}"] if said else []) +
                         [f"# {plan.dir / name}\n{text}" for name, text in plan.files])

    # -- acting --

    def submit(self, plan: SlurmPlan, log=print) -> SlurmHandle:
        self.check_partition(plan)
        plan.make_dir()
        checkpoints.prepare(Path(plan.checkpoints), plan.spec.resume, plan.job_id, log)
        (plan.dir / "summary.json").unlink(missing_ok=True)   # an earlier run's of the same job id
        JobInfo(plan.job_id, self.name, plan.spec.variant.name, plan.spec.nodes, plan.spec.procs_per_node,
                plan.image, runtime=plan.runtime, paddle=plan.spec.paddle_pin).save(plan.dir)
        for name, text in plan.files:
            files.write_atomic(plan.dir / name, text)
        files.write_atomic(plan.dir / HANG_PY, Path(hang.__file__).read_text())
        if steps_here(plan.spec):
            slurm_step.pack(plan.dir / slurm_step.ALLOCATION_PYZ)
        (plan.dir / HELPERS).mkdir(exist_ok=True)
        for src in sorted(settings.HELPERS.glob("*.py")):
            files.write_atomic(plan.dir / HELPERS / src.name, src.read_bytes())
        self.warn_unshared(plan, log)
        if said := environment_line(plan.environment):
            log(said)
        left = {name for name, _, why in plan.environment if why}
        # SLURM_RESTART_COUNT=0: a requeue count of the shell's own Slurm job is not this job's (chain.sh)
        out = _slurm("sbatch", "--parsable", "--export=ALL,SLURM_RESTART_COUNT=0", str(plan.dir / "job.sbatch"),
                     env={k: v for k, v in os.environ.items() if k not in left}).stdout.strip()
        handle = SlurmHandle(self.name, plan.job_id, str(plan.dir), plan.spec.nodes, scheduler_job=out.split(";")[0],
                        procs_per_node=plan.spec.procs_per_node, checkpoints=plan.checkpoints,
                        owner=records.owner())
        handle.save()
        log(f"submitted Slurm job {handle.scheduler_job} ({plan.spec.nodes} nodes, runtime {plan.runtime}); "
            f"logs in {plan.dir}")
        return handle

    def check_partition(self, plan: SlurmPlan) -> None:
        """A job that asks more nodes than its partition has would wait in the queue for ever (Slurm keeps it
        pending, reason PartitionConfig): refused in one line, where Slurm says how many it has. Its partition:
        --partition, else the environment's SBATCH_PARTITION where taken, else Slurm's default."""
        spec = plan.spec
        taken = next((v for name, v, why in plan.environment if name == "SBATCH_PARTITION" and not why), "")
        asked, part = spec.nodes + spec.spare_nodes, self.sbatch["partition"] or taken
        has = partition_nodes(part) if "," not in part else None
        if has is not None and asked > has:
            spares = f" and {spec.spare_nodes} spare(s)" if spec.spare_nodes else ""
            raise UserError(f"{asked} nodes ({spec.nodes}{spares}) are more than partition "
                            f"{part or '(the default)'} has: {has}")

    def warn_unshared(self, plan: SlurmPlan, log) -> None:
        """One line when a path the nodes need is where they may not see it (run/filesystems.py has the rule)."""
        spec = plan.spec
        paths = {"the runs folder": str(plan.dir.parent), "the script": str(spec.script_path),
                 "the checkpoint folder": plan.checkpoints}
        if plan.image.startswith("/"):
            paths["the env" if not self.runtime.has_image else "the image"] = plan.image
        if spec.data_dir:
            paths["the dataset cache"] = spec.data_dir
        table = filesystems.parse(filesystems.MOUNTINFO.read_text()) if filesystems.MOUNTINFO.exists() else []
        if said := filesystems.warning({k: filesystems.resolved(v) for k, v in paths.items() if "{" not in v},
                                       table):
            log(f"warning: {said}")

    def current(self, handle: SlurmHandle, recs: list[dict] | None = None) -> str:
        """The Slurm job of the chain's newest allocation: the next one once submitted, else the last one."""
        recs = allocations(Path(handle.dir), handle.scheduler_job) if recs is None else recs
        if not recs:
            return handle.scheduler_job
        return recs[-1]["next"] or recs[-1]["slurm_job"]

    def newest(self, handle: SlurmHandle, ask) -> tuple[list[dict], str, str]:
        """The chain's records, its newest Slurm job and that job's state (`ask(job)`). An allocation records
        its next one just before its batch script exits, which may fall between the read of the records and
        Slurm's answer that the job ended: then the records are read again, and the next one asked."""
        recs = allocations(Path(handle.dir), handle.scheduler_job)
        while True:
            current = self.current(handle, recs)
            state = ask(current)
            if alive(state):
                return recs, current, state
            recs = allocations(Path(handle.dir), handle.scheduler_job)
            if self.current(handle, recs) == current:
                return recs, current, state

    def cancel(self, handle: SlurmHandle, log=print, asked: bool = True) -> None:
        """The marker first (an allocation about to submit the next one reads it, and a next one that was
        already submitted ends at once), then the chain's own Slurm jobs that are still alive, as this user:
        never every job that happens to carry the job's name. The marker is the chain's stop: written whether
        `asked` or not."""
        Path(handle.dir, f"{CANCELLED}.{handle.scheduler_job}").touch()   # per chain: job.sbatch reads it
        asked: list[str] = []
        for _ in range(5):   # an allocation may submit the next one meanwhile: read the chain again
            recs = allocations(Path(handle.dir), handle.scheduler_job)
            ids = dict.fromkeys([handle.scheduler_job, *(j for r in recs for j in (r["slurm_job"], r["next"]) if j)])
            ended = {r["slurm_job"] for r in recs if r["next"]}   # an allocation that submitted its next one
            live = [j for j in ids if j not in asked and j not in ended and alive_or_unanswered(j)]
            if not live:
                break
            argv = ["scancel", f"--user={getpass.getuser()}", *live]
            log(line(argv))
            proc = _slurm(*argv, check=False)
            if proc.returncode and (still := [j for j in live if alive_or_unanswered(j)]):   # else it ended
                msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
                raise UserError(f"scancel could not cancel Slurm job(s) {', '.join(still)} of {handle.job_id}: "
                                f"{msg[-1] if msg else f'exit {proc.returncode}'}")
            asked += live
        if not asked:
            log(f"no Slurm job of {handle.job_id} is alive ({', '.join(ids)})")

    # -- from any shell --

    @classmethod
    def leftovers(cls, job_id: str) -> str:
        return f"a Slurm job: `scancel --user=$USER --name=fleetbox-{job_id}`"   # the job name render_sbatch gives

    def job_state(self, handle: SlurmHandle) -> tuple[JobState, int, str]:
        d = Path(handle.dir)
        recs = allocations(d, handle.scheduler_job)
        chained = bool(recs) and goes_on(recs[-1])   # another run follows
        attempt = len(recs) + 1 if chained or not recs else len(recs)
        cancelled = (d / f"{CANCELLED}.{handle.scheduler_job}").exists()
        summary = files.read_json(d / records.SUMMARY)
        if not summary or chained:
            try:   # `invoke jobs` lists many: it waits less
                recs, current, state = self.newest(handle, lambda j: job_state(j, QUERY_WAITS[:2])[0])
            except UserError as e:
                return JobState.UNKNOWN, attempt, str(e)
            chained = bool(recs) and goes_on(recs[-1])
            attempt = len(recs) + 1 if chained or not recs else len(recs)
            if alive(state):
                return STATES.get(state, (JobState.UNKNOWN,))[0], attempt, "" if state in STATES else state
            if state == FORGOTTEN:   # Slurm has forgotten it (MinJobAge): what the chain recorded, else nothing
                if not recs or recs[-1]["next"]:
                    return JobState.UNKNOWN, attempt, f"Slurm no longer knows job {current}"
                state = "COMPLETED" if recs[-1]["exit"] == 0 else "FAILED"
            # the chain has ended and no one followed it (a detached job): its result, from its files
            summary = asdict(self.result(handle, state, current, recs))
        if cancelled:
            return JobState.CANCELLED, attempt, ""
        if summary.get("ok"):
            return JobState.PASSED, attempt, ""
        if summary.get("hang"):
            return JobState.HUNG, attempt, summary["hang"].get("text", "")
        return JobState.FAILED, attempt, JobResult.from_summary({**summary, "nodes": []}).reason()

    def show_logs(self, handle: SlurmHandle, node: int, follow: bool = False, log=print, poll: float = 0.5) -> None:
        """The node's log file on the shared file system, followed across allocations."""
        tail_file(Path(handle.dir) / f"node{node}.log",
                  lambda: follow and alive(self.newest(handle, lambda j: patient_state(j, log)[0])[2]), log, poll)

    def follow(self, handle: SlurmHandle, log=print, timeout: float | None = None, poll: float = 1.0) -> JobResult:
        """Stream node 0's output until the chain of allocations ends (each one's time limit is Slurm's: --time),
        saying how each allocation of a chain ended."""
        job_dir, chain, shown, noticed = Path(handle.dir), handle.scheduler_job, 0, set()
        current = chain

        def running() -> bool:
            nonlocal shown, current
            recs, current, state = self.newest(handle, lambda j: patient_state(j, log)[0])
            for rec in recs[shown:]:
                if rec["next"] or rec["allocation"] > 1 or rec["ended"] in slurm_step.HERE:
                    log(f"allocation {rec['allocation']} (Slurm job {rec['slurm_job']}) ended: {chain_end(rec)}")
            shown = len(recs)
            for ln in read_lines(job_dir / f"slurm-{current}.out"):   # what the batch script's watcher noticed
                if ln.startswith(STRAGGLER_NOTICE) and (current, ln) not in noticed:
                    noticed.add((current, ln))
                    log(ln.removeprefix("fleetbox: "))
            return alive(state)

        while True:
            tail_file(job_dir / "node0.log", running, lambda ln: log(f"[node0] {ln}"), poll)
            rec = _record_of(job_dir, chain, current)   # written just before its batch script exits
            if not (rec and rec["next"]):
                break
        running()   # the last allocation's line
        records = allocations(job_dir, chain)
        return self.result(handle, patient_state(current, log)[0], current, records)

    def result(self, handle: SlurmHandle, state: str, slurm_job: str = "", records: list | None = None) -> JobResult:
        job_dir, slurm_job, records = Path(handle.dir), slurm_job or handle.scheduler_job, records or []
        if records and records[-1]["ended"] in slurm_step.HERE:   # the step after it has no record of its own
            records = [*records, slurm_step.unrecorded(records[-1], state)]
        last = records[-1] if records else None
        caps = self.capabilities
        nodes = last.get("nodes", handle.nodes) if last else handle.nodes   # the last step's (--min-nodes)
        r = judge(slurm_step.facts(job_dir, slurm_job, nodes, handle.procs_per_node, state, last),
                  handle.job_id, self.name, str(job_dir),
                  SlurmResult, attempts_are=caps.attempts_are, name_host=caps.names_hosts,
                  smoke=smoke_report(job_dir / "node0" / "workerlog.0"),
                  scheduler=f"Slurm job {slurm_job}, {state}" if slurm_job else "", end_state=state,
                  scheduler_job=slurm_job, scheduler_state=state)
        if len(records) > 1 or last and last["ended"] in ("no-progress", "max-allocations", "submit-failed",
                                                          "requeue-refused"):
            r.attempts = [{"attempt": rec["allocation"] - 1, "ok": rec["ended"] in ("finished", "continue"),
                           "ended": attempt_end(job_dir, rec), "slurm_job": rec["slurm_job"],
                           "state": "HUNG" if hang_of(job_dir, rec) else
                           "PASSED" if rec["ended"] in ("finished", "continue") else "FAILED",
                           "steps": [rec["from_step"], rec["to_step"]], "nodes": rec.get("nodes", handle.nodes),
                           "logs": str(kept if (kept := job_dir / f"alloc{rec['allocation']}").is_dir() else job_dir)}
                          for rec in records]
        r.replaced = slurm_step.replaced(job_dir, handle.scheduler_job)
        r.save()
        return r


def steps_here(spec: spec_mod.JobSpec) -> bool:
    """A failed step may be followed by another in the same allocation: on a spare, or on one node fewer."""
    return bool(spec.spare_nodes or spec.may_shrink)


def attempt_end(job_dir: Path, rec: dict) -> str:
    """How an allocation ended, for the list of attempts: a hang in the summary's words."""
    hung = hang_of(job_dir, rec)
    if hung is None:
        return chain_end(rec)
    return hung["text"] + (f"; restarted in Slurm job {rec['next']}" if rec["next"] else
                           f"; {slurm_step.went_on(rec)}" if rec["ended"] in slurm_step.HERE else "")


def tail_file(path: Path, running, log, poll: float) -> None:
    """Print a node's log file as it grows while `running()`. When an allocation ends its file is moved to
    alloc<N>/ and the next one writes a new one: the open file is read to its end first, then the new one."""
    f = None
    try:
        while True:
            going = running()   # asked first: what was written before the job ended is read below
            if f is not None:
                for ln in f.read().splitlines():
                    log(ln)
            try:
                newer = f is None or os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                newer = False
            if newer and path.exists():
                if f is not None:
                    f.close()
                f = open(path, errors="replace")
                continue
            if not going:
                return
            time.sleep(poll)
    finally:
        if f is not None:
            f.close()


def allocations(job_dir: Path, chain: str) -> list[dict]:
    """The allocations of the chain that began with Slurm job `chain`, as job.sbatch recorded them."""
    p = job_dir / "allocations.jsonl"
    out = []
    for ln in (p.read_text().splitlines() if p.exists() else []):
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if rec.get("chain") == chain:
            out.append(rec)
    return out


def _record_of(job_dir: Path, chain: str, slurm_job: str, wait: float = 5.0) -> dict | None:
    """The allocation's line (written just before its batch script exits; none when Slurm killed the script,
    e.g. at its time limit)."""
    end = time.monotonic() + wait
    while True:
        found = [r for r in allocations(job_dir, chain) if r["slurm_job"] == slurm_job]
        if found or time.monotonic() > end:
            return found[-1] if found else None
        time.sleep(0.2)


def cpus_per_node_option(value) -> int | str:
    """--cpus-per-node: a number of CPUs, "all" (whole nodes), or 0 for the default (decided by the job)."""
    value = str(value or "").strip()
    if value.lower() == WHOLE_NODE:
        return WHOLE_NODE
    return parse.integer("--cpus-per-node", value, 1) if value else 0


def sbatch_args_option(value: str) -> tuple[str, ...]:
    """--sbatch-args as #SBATCH lines' words: each an sbatch long option with a value that stays one word on one
    line; the options fleetbox sets itself are refused, naming the option of ours that asks for them."""
    try:
        words = shlex.split(value or "")
    except ValueError as e:
        raise UserError(f"--sbatch-args cannot be split into words: {e}") from None
    for w in words:
        m = SBATCH_ARG.fullmatch(w)
        if not m:
            raise UserError(f"--sbatch-args: {w!r} is not an sbatch long option written --name or --name=value "
                            f"(letters, digits and .,:@+/=[]&|()*_- in the value)")
        name, value = m.group(1), m.group(2)
        ours = [o for o in OWN_SBATCH if o.startswith(name)]   # sbatch would read a start of ours as ours
        if ours:
            raise UserError(f"--sbatch-args: {w} is set by fleetbox: give {OWN_SBATCH[ours[0]]} instead")
        if name not in SBATCH_PASSED:
            raise UserError(f"--sbatch-args: --{name} is not among the sbatch options fleetbox passes on (by their "
                            f"whole names): {', '.join('--' + o for o in SBATCH_PASSED)}")
        if SBATCH_PASSED[name] != (value is not None):
            raise UserError(f"--sbatch-args: --{name} takes a value: write --{name}=VALUE" if SBATCH_PASSED[name]
                            else f"--sbatch-args: --{name} takes no value: write --{name}")
    return tuple(words)


def resources(cpus_per_node: int | str, procs_per_node: int, accelerator: bool) -> tuple[list[str], list]:
    """The CPUs each node's task asks for: the #SBATCH lines, and srun's options, which must ask again (Slurm
    22.05 to 23.02 do not pass --cpus-per-task from sbatch to srun, and a step of an --exclusive job gets one CPU
    unless it asks for the node's)."""
    if cpus_per_node == WHOLE_NODE:
        return ["#SBATCH --exclusive"], [Raw('--cpus-per-task="$SLURM_CPUS_ON_NODE"')]
    cpus = cpus_per_node or procs_per_node * CPUS_PER_RANK[accelerator]
    if cpus < procs_per_node:
        raise UserError(f"--cpus-per-node {cpus} is fewer than the {procs_per_node} ranks on each node: each rank "
                        f"needs a CPU at least")
    return [f"#SBATCH --cpus-per-task={cpus}"], [f"--cpus-per-task={cpus}"]


def slurm_time(value: str) -> str:
    """--time as sbatch takes it: a duration as every other fleetbox option takes one (90s, 20m, 48h) in Slurm's
    [D-]HH:MM:SS, Slurm's own forms (a colon, a day, unlimited) as they are. A bare number is refused: Slurm reads
    it as minutes, fleetbox's other durations as seconds."""
    m = parse.DURATION.fullmatch(value)
    if not m:
        return value
    if not m[2]:
        raise UserError(f"--time {value}: give its unit ({value.strip()}m, or {value.strip()}h) or Slurm's "
                        f"HH:MM:SS: Slurm reads a bare number as minutes, fleetbox's other durations as seconds")
    s = math.ceil(parse.seconds("--time", value))
    days, s = divmod(s, 86400)
    return (f"{days}-" if days else "") + f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def time_seconds(value: str) -> int | None:
    """Slurm's --time in seconds (minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]);
    None for no limit."""
    if not value or value.lower() in ("unlimited", "infinite") or value.strip("0-:") == "":   # 0: no limit
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))   # days-hours[:minutes[:seconds]]
        h, m, sec = parts
    elif len(parts) == 1:
        h, m, sec = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, sec = 0, parts[0], parts[1]
    else:
        h, m, sec = parts
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def _slurm(*argv, check=True, env=None) -> subprocess.CompletedProcess:
    if not shutil.which(argv[0]):
        raise UserError(f"{argv[0]} not found: run on a Slurm login node (or install Slurm's client tools)")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise UserError(f"{argv[0]} failed: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc


# A busy or restarting slurmctld answers no query for a while ("Socket timed out on send/recv operation"): a query
# that gets no answer is asked again after each of these waits (seconds), and is never read as the job's end.
QUERY_WAITS = (1, 2, 4, 8, 15)
START_WAITS = (1, 2, 4, 8)   # the batch script's own question at its start (the master's address), the same way
NOT_KNOWN = "Invalid job id specified"   # scontrol's own answer for a job it does not (or no longer) know
# scontrol's words for a controller that is busy, restarting or out of reach now, as Slurm's libslurm gives them
# (src/common/slurm_errno.c; read from Debian 12's libslurmfull 22.05.8): asked again. Any other failure (an auth
# plugin that cannot start, a wrong SLURM_CONF, an expired credential) stays until someone fixes it: said at once.
BUSY = ("Unable to contact slurm controller", "Socket timed out on send/recv operation",
        "Slurm backup controller in standby mode", "Zero Bytes were transmitted or received",
        "Communication connection failure", "Communication shutdown failure", "Message receive failure",
        "Message send failure", "Resource temporarily unavailable")


class SlurmUnanswered(UserError):
    """Slurm gave no answer about a job (its controller busy or down): nothing is known of the job."""


class SlurmRefused(LeftRunning):
    """Slurm's tools answered with an error that asking again will not change: nothing is known of the job, which
    is left as it is (a command that follows it stops following it)."""


def job_state(job_id: str, waits=QUERY_WAITS) -> tuple[str, str]:
    """(JobState, ExitCode) as Slurm answers: scontrol's while it remembers the job; once it says the id is invalid,
    the accounting's where there is one (sacct), else FORGOTTEN. A query that gets no answer is asked again after
    each of `waits`, then ends in SlurmUnanswered with Slurm's line."""
    for wait in (*waits, None):
        proc = _slurm("scontrol", "show", "job", job_id, "-o", check=False)
        state, code = re.search(r"JobState=(\S+)", proc.stdout), re.search(r"ExitCode=(\S+)", proc.stdout)
        if proc.returncode == 0 and state:
            return state.group(1), code.group(1) if code else ""
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        if any(NOT_KNOWN in ln for ln in said):
            return accounted(job_id)
        if not any(b in ln for ln in said for b in BUSY):
            raise SlurmRefused(f"Slurm cannot be asked about job {job_id}: "
                               f"{said[-1] if said else f'scontrol exit {proc.returncode}'}")
        if wait is None:
            raise SlurmUnanswered(f"Slurm did not answer about job {job_id}: "
                                  f"{said[-1] if said else f'scontrol exit {proc.returncode}'}")
        pause(wait)
    raise AssertionError("unreachable")


def partition_nodes(partition: str) -> int | None:
    """How many nodes the partition has (the default one where none is named), as Slurm answers; None where it
    gives no answer (scontrol missing: sbatch's own check says so)."""
    if not shutil.which("scontrol"):
        return None
    proc = _slurm("scontrol", "show", "partition", "-o", check=False)
    for ln in proc.stdout.splitlines() if proc.returncode == 0 else []:
        f = dict(w.split("=", 1) for w in ln.split() if "=" in w)
        if f.get("PartitionName") == partition if partition else f.get("Default") == "YES":
            return int(f["TotalNodes"]) if f.get("TotalNodes", "").isdigit() else None
    return None


def pause(seconds: float) -> None:
    """The wait between queries (a test records it instead)."""
    time.sleep(seconds)


def accounted(job_id: str) -> tuple[str, str]:
    """(State, ExitCode) of a job scontrol no longer knows, from Slurm's accounting; FORGOTTEN where there is none
    (no sacct, accounting disabled, or it does not hold the job either)."""
    if not shutil.which("sacct"):
        return FORGOTTEN, ""
    proc = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], capture_output=True,
                          text=True)
    rows = [ln.split("|") for ln in proc.stdout.splitlines() if ln.count("|") == 1] if proc.returncode == 0 else []
    state = rows[0][0].split()[0] if rows and rows[0][0].split() else ""   # "CANCELLED by 1000": the first word
    if not state or alive(state):   # scontrol said it is gone: a live state in the accounting is a stale record
        return FORGOTTEN, ""
    return state, rows[0][1]


def alive_or_unanswered(job_id: str) -> bool:
    """Slurm has not ended the job, or gave no answer about it when asked once, or cannot be asked (nothing known:
    not an end)."""
    try:
        return alive(job_state(job_id, waits=())[0])
    except (SlurmUnanswered, SlurmRefused):
        return True


def patient_state(job_id: str, log) -> tuple[str, str]:
    """job_state, asked until Slurm answers, for settings.slurm_patience() seconds at most: while it does not, one
    line says so; then LeftRunning (the job goes on; this command stops following it). Any other failure to ask is
    SlurmRefused at once."""
    told, give_up = False, time.monotonic() + settings.slurm_patience()
    while True:
        try:
            return job_state(job_id)
        except SlurmUnanswered as e:
            if time.monotonic() >= give_up:
                raise LeftRunning(f"{e}, for {settings.slurm_patience():g} s (FLEETBOX_SLURM_PATIENCE): stopped "
                                  f"following Slurm job {job_id}, which may still run; ask again with `invoke jobs` "
                                  f"or `invoke logs --follow`") from None
            if not told:
                log(f"{e}; asking again (a busy or restarting controller is not the job's end)")
                told = True


# Every job state Slurm has (squeue(1), JOB STATE CODES), its meaning, and what `invoke jobs` calls it while it
# lasts; None: Slurm has ended the job. A state not in this table (a newer Slurm's) counts as alive.
STATES = {
    "PENDING": (JobState.PENDING, "awaiting resource allocation"),
    "CONFIGURING": (JobState.STARTING, "allocated, waiting for the nodes to become ready (e.g. booting)"),
    "RUNNING": (JobState.RUNNING, "allocated and running"),
    "COMPLETING": (JobState.RUNNING, "completing: some processes on some nodes may still be active"),
    "REQUEUED": (JobState.PENDING, "a completing job being requeued"),
    "REQUEUE_FED": (JobState.PENDING, "being requeued by a federation"),
    "REQUEUE_HOLD": (JobState.HELD, "a held job being requeued"),
    "SPECIAL_EXIT": (JobState.HELD, "requeued in a special state (set by an epilog), held"),
    "RESV_DEL_HOLD": (JobState.HELD, "held after its reservation was deleted"),
    "RESIZING": (JobState.RUNNING, "about to change size"),
    "SIGNALING": (JobState.RUNNING, "being signaled"),
    "STAGE_OUT": (JobState.RUNNING, "staging out files"),
    "STOPPED": (JobState.SUSPENDED, "stopped with SIGSTOP, its CPUs retained"),
    "SUSPENDED": (JobState.SUSPENDED, "suspended, its CPUs released to other jobs"),
    "BOOT_FAIL": (None, "ended: a launch failure, typically hardware"),
    "CANCELLED": (None, "ended: cancelled by the user or an administrator"),
    "COMPLETED": (None, "ended: every process exited 0"),
    "DEADLINE": (None, "ended: its deadline passed"),
    "FAILED": (None, "ended: a non-zero exit or another failure"),
    "NODE_FAIL": (None, "ended: one of its nodes failed"),
    "OUT_OF_MEMORY": (None, "ended: out of memory"),
    "PREEMPTED": (None, "ended: preempted"),
    "REVOKED": (None, "ended: a federation sibling started elsewhere"),
    "TIMEOUT": (None, "ended: its time limit"),
}
FORGOTTEN = "UNKNOWN"   # job_state's answer when Slurm no longer knows the job
def alive(state: str) -> bool:
    """Slurm has not ended the job: every state but the terminal ones."""
    return state != FORGOTTEN and STATES.get(state, (JobState.UNKNOWN, ""))[0] is not None

