"""Container runtimes on HPC nodes, one class each: how a node's container (a plan.NodeRun template) is
started, what srun needs, what a node script does first and on the way out, what values the runtime can
carry unchanged, and how a cluster user pulls an image for it.

Words are typed (see shell.py): `str` words are user values or literal text and are always quoted, and may
hold placeholders that the node script fills from shell variables; `Raw` words are ours.
"""

from __future__ import annotations

import copy
import getpass
import json
import os
import re
import shlex
from dataclasses import replace
from importlib import resources
from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.run import node_log, placeholders
from fleetbox.run.plan import ALL_RENDER_NODES, HIP_VISIBLE, STACK_BYTES, NodeRun
from fleetbox.run.shell import Raw, line
from fleetbox.settings import WORKDIR
from fleetbox.ship import exports, shipped
from fleetbox.ship.shipped import REGISTRY


def template(name: str, **fields: str) -> Raw:
    """Our own shell, kept as a .sh file beside this module (shellcheck reads the rendered scripts in the tests),
    with @FIELD@ filled from `fields` (our own values, never a user's); inlined where it runs, so --dry-run shows
    every line. @SAYS@: the node log protocol's line start, as Slurm's node.sh says it (run/node_log.py)."""
    text = resources.files(__package__).joinpath("shell", name).read_text().removesuffix("\n")
    for key, value in {"SAYS": node_log.says("$SLURM_NODEID"), **fields}.items():
        text = text.replace(f"@{key}@", value)
    if re.search(r"@[A-Z_]+@", text):
        raise ValueError(f"{name}: a field is left unfilled")
    return Raw(text)


class Runtime:
    name = ""
    runs_as_user = False          # Apptainer, Pyxis and Charliecloud run the job as the calling user
    container_home = "{home}"     # that user's home as the container sees it
    kills_client_only = False     # Docker, Podman: killing the client leaves the container running
    bind_separators = ":"         # characters that split a bind mount option for this runtime
    unverified_env = ""           # characters we cannot show this runtime keeps in an --env value
    sets_shm = False              # --shm-size reaches the container (else it has the node's own /dev/shm)
    node_script_inside = False    # srun starts the container, and node.sh runs in it (Pyxis), not on the node
    modules: tuple[str, ...] = ()   # environment modules each node loads first (--modules), e.g. the runtime's own

    # -- what the runtime can carry --

    def check(self, n: NodeRun, image: str) -> None:
        """Refuse, with one line, a value this runtime would split or change (never pass it on mangled)."""
        for m in n.mounts:
            for what, path in (("source", m.src), ("destination", m.dst)):
                bad = sorted({c for c in path if c in self.bind_separators + "\n"})
                if bad:
                    raise UserError(f"mount {what} {path!r} holds {' '.join(map(repr, bad))}, which {self.name} "
                                    f"reads as a separator; use a path without it")
        for key, value in n.env.items():
            bad = sorted({c for c in value if c in self.unverified_env})
            if bad:
                raise UserError(f"--env {key}: {' '.join(map(repr, bad))} cannot be passed through {self.name} "
                                f"unchanged (not verified on a real {self.name}); set it in the script instead")
        if "\n" in image or not image:
            raise UserError(f"image {image!r} is not a valid image reference for {self.name}")

    def paths(self, n: NodeRun) -> list[tuple[str, str]]:
        """(container path, real path) for each of our mounts, longest first."""
        return sorted(((m.dst, m.src) for m in n.mounts), key=lambda p: -len(p[0]))

    def on_host(self, n: NodeRun, path: str) -> str | None:
        """The node's own path of a path the ranks see, through the mounts (None: not a mounted path)."""
        return mounted(path, self.paths(n))

    def as_user(self, n: NodeRun) -> NodeRun:
        """`n` with the dataset cache mounted where Paddle looks for it: a runtime that runs as the user has
        Paddle look under that user's home (~/.cache/paddle/dataset), never under /root."""
        if not self.runs_as_user:
            return n
        home_cache = f"{self.container_home}/{settings.HOME_CACHE}"
        return replace(n, mounts=tuple(replace(m, dst=home_cache) if m.dst == settings.CONTAINER_CACHE else m
                                       for m in n.mounts))

    def home_cache_dir(self, n: NodeRun) -> str | None:
        """The folder in the user's home on the node that must exist before the cache is mounted over it."""
        cache = {settings.CONTAINER_CACHE, f"{self.container_home}/{settings.HOME_CACHE}"}
        if self.runs_as_user and any(m.dst in cache for m in n.mounts):
            return "{home}/" + settings.HOME_CACHE
        return None

    has_image = True              # the job runs in an image (else: in an env on the nodes, runtime none)

    def refuse(self, spec, runtime_args: tuple[str, ...]) -> None:
        """Refuse, with one line, an option this runtime cannot give a meaning."""

    def setup(self, n: NodeRun) -> list:
        """Node-script lines before the image is identified: word lists (user values, placeholders filled on
        the node) or our own Raw shell. The site's modules first."""
        return [["set", "--", *self.modules], template("modules.sh")] if self.modules else []

    # -- the devices Slurm allocated --

    VISIBLE = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")   # what Slurm sets per task
    confined = True   # the container runs inside the task's cgroup: Slurm's device binding holds for it

    def allocation(self, device: str, procs: int) -> tuple[list[Raw], list]:
        """Node-script lines that read the task's allocation ($GPUS, $GPU_COUNT, checked against the plan's
        process count) and hand it to the runtime, and the words `launch` gets before the image. This default:
        the container runs in the task's cgroup and sees the visibility variables Slurm set."""
        return [template("allocated.sh", PROCS=str(procs))], []

    gpu_check = ""   # the shell template (shell/gpu_*.sh) that checks this runtime's NVIDIA prerequisite; "": none
                     # (the node script runs in the container, or there is none)
    no_driver_fix = ""   # what gives its container the node's NVIDIA driver: doctor's fix where one has none

    def gpu_prerequisite(self, accelerator: str, image: str) -> list:
        """Node-script lines (ours), after the allocation ($GPUS), that check what this runtime needs on the node
        to give a container its NVIDIA GPUs ($GPU_IMAGE: the image): a line `GPU prerequisite: ...` where it is
        there, else one line naming the node and what to do, and exit 5 (invoke doctor makes a row of either)."""
        if accelerator != "cuda" or not self.gpu_check:
            return []
        check = template(self.gpu_check, RUNTIME=self.name)
        return [Raw(f"GPU_IMAGE={shlex.quote(image)}")] * ("$GPU_IMAGE" in check) + [check]   # where it reads it

    def for_allocation(self, n: NodeRun) -> NodeRun:
        """The node without the ids fleetbox would choose ({gpus}): the allocation's are given instead."""
        return replace(n, gpus="", env={k: v for k, v in n.env.items() if (k, v) != (HIP_VISIBLE, "{gpus}")})

    # -- starting the container --

    def launch(self, n: NodeRun, image: str, extra: list[str] = ()) -> list:
        """The words that start node n's container (pyxis: the command run inside it). `extra`: site-specific
        runtime options (--runtime-args), placed before the image."""
        raise NotImplementedError

    def srun_options(self, n: NodeRun, image: str) -> list:
        return []

    def prelude(self) -> list[Raw]:
        """Lines the node script runs first (our own shell)."""
        return []

    def exports(self, n: NodeRun) -> dict[str, str]:
        """Environment the node script exports for the runtime to pass on (values are user values)."""
        return {}

    def prelude_for(self, n: NodeRun) -> list[Raw]:
        """Node-script lines for this node's own values that must stay out of the script (--pass-env): ours, with
        names checked as identifiers. Docker and Podman take `-e NAME` from their environment, Pyxis runs the
        node script in the container, which has the task's environment."""
        return []

    def identify(self, image: str) -> Raw:
        """Node script lines that say which image this node has, as `fleetbox: image KIND VALUE [CONTENT-TAG]`
        (invoke doctor compares them across nodes), and end the script when the node has none. $IMAGE_REF is
        set, quoted, before them. An image file (SIF, squashfs) counts by its sha256; a folder (Charliecloud)
        by the sha256 of its file list with sizes; a registry reference cannot be checked before it is pulled."""
        return template("identify_file.sh")

    # -- getting the image --

    kinds: tuple[str, ...] = ()   # what the runtime runs a variant's image from, preferred first: export kinds
                                  # (ship/exports.py) or a registry push (shipped.REGISTRY)

    def registry_form(self, ref: str) -> str:
        """A pushed HOST[:PORT]/NS/NAME:TAG as this runtime names an image in a registry."""
        return ref

    def given_image(self, image: str) -> str:
        """A user's --image as this runtime is handed it, or one line saying which form it needs."""
        return image

    def pull_commands(self, ref: str, out_name: str, insecure: bool = False) -> list[list[str]]:
        raise NotImplementedError


class Engine(Runtime):
    """A client of a container engine on the node (Docker, Podman): --shm-size reaches the container, killing
    the client leaves the container running, and the engine says which image it has. The engine, not the task,
    starts the container: it runs outside the task's cgroup and gets exactly the allocated devices by name."""
    sets_shm = True
    kills_client_only = True
    confined = False
    inspect_labels = ""   # where `image inspect` keeps an image's labels
    cuda_devices = ""     # node-script shell that fills the array ACCEL from $GPUS for NVIDIA GPUs

    def allocation(self, device, procs):
        lines, _ = super().allocation(device, procs)
        if device == "rocm":
            lines += [template("render_nodes.sh"), Raw("RENDER=$(render_nodes)"),
                      Raw('ACCEL=(); for d in $RENDER; do ACCEL+=(--device "$d"); done')]
        else:
            lines.append(Raw(self.cuda_devices))
        lines.append(Raw(f'echo "fleetbox: {self.unconfined_note()} ($GPUS)"'))
        return lines, [Raw('"${ACCEL[@]}"')]

    def unconfined_note(self) -> str:
        return (f"{self.name} starts the container outside the Slurm task's cgroup: it is given the allocated "
                f"devices, but Slurm neither confines it to them nor accounts for them")

    def for_allocation(self, n):   # and every render node: the allocated ones come in $ACCEL
        return replace(super().for_allocation(n), devices=tuple(d for d in n.devices if d != ALL_RENDER_NODES))

    def identify(self, image):
        return template("identify_engine.sh", ENGINE=self.name, LABELS=self.inspect_labels,
                        LABEL_INPUTS=settings.LABEL_INPUTS, IN_REGISTRY="true" if registry_host(image) else "false")

    def remove_now(self, container: str) -> list[str]:
        """What removes the node's container when Slurm stops the task (a killed client leaves it running)."""
        return [self.name, "rm", "-f", container]

    kinds = (REGISTRY,)

    def given_image(self, image):
        if "://" in image:
            raise UserError(f"--image {image!r}: {self.name} takes an image reference (HOST[:PORT]/NAME:TAG for a "
                            f"registry, or an image every node's {self.name} holds), not a URI")
        return image

    @staticmethod
    def pull(image: str) -> list[str]:
        """A name that names no registry is the node's own image, never one pulled from Docker Hub by accident."""
        return [] if registry_host(image) else ["--pull=never"]


def cli_flags(n: NodeRun) -> list[str]:
    """A node's labels, volumes and environment in the `docker run` spelling (Podman takes the same)."""
    a = []
    for k, v in n.labels.items():
        a += ["--label", f"{k}={v}"]
    for m in n.mounts:
        a += ["-v", f"{m.src}:{m.dst}" + (":ro" if m.ro else "")]
    for k, v in n.env.items():
        a += ["-e", f"{k}={v}"]
    for k in n.pass_env:   # by name: the client takes the value from its own environment
        a += ["-e", k]
    return a


def run_flags(n: NodeRun) -> list[str]:
    """A node's `docker run` options, image and command excluded (the Docker backend's and Slurm's docker runtime)."""
    a = ["--name", n.name, "--network", "host", "--shm-size", n.shm_size,
         "--ulimit", f"memlock={n.memlock}:{n.memlock}", "--ulimit", f"stack={STACK_BYTES}",
         "-w", WORKDIR, *cli_flags(n)]
    for d in n.devices:
        a += ["--device", d]
    for g in n.group_add:
        a += ["--group-add", g]
    for s in n.security_opt:
        a += ["--security-opt", s]
    if n.gpus:   # the CLI reads the value as CSV: a list of ids must be one quoted field
        a += ["--gpus", f'"{n.gpus}"' if "," in n.gpus else n.gpus]
    return a


class Docker(Engine):
    name = "docker"
    inspect_labels = ".Config.Labels"
    # --gpus reads its value as CSV: a list of ids is one quoted field
    cuda_devices = 'ACCEL=(--gpus "\\"device=$GPUS\\"")'
    gpu_check = "gpu_toolkit.sh"
    no_driver_fix = "install the NVIDIA Container Toolkit on the node (`nvidia-ctk runtime configure --runtime=docker`)"

    def launch(self, n, image, extra=()):
        return ["docker", "run", "--rm", *self.pull(image), *run_flags(n), *extra, image, *n.command]

    def pull_commands(self, ref, out_name, insecure=False):
        return [["docker", "pull", ref]]


class Podman(Engine):
    name = "podman"
    inspect_labels = ".Labels"
    cuda_devices = 'ACCEL=(); for g in ${GPUS//,/ }; do ACCEL+=(--device "nvidia.com/gpu=$g"); done'   # CDI, by index
    gpu_check = "gpu_cdi.sh"
    no_driver_fix = "generate the node's CDI spec (`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`)"

    def remove_now(self, container: str) -> list[str]:   # at once: Slurm's SIGKILL may come before the 10 s default
        return [self.name, "rm", "-f", "--time", "0", container]

    def prelude(self):
        return [Raw('hard_limit() { local v; v=$(ulimit -H"$1"); [ "$v" = unlimited ] && v=-1; echo "$v:$v"; }')]

    def launch(self, n, image, extra=()):
        a = ["podman", "run", "--rm", *self.pull(image), "--name", n.name, "--network", "host",
             "--shm-size", n.shm_size,
             "--ulimit", Raw('"memlock=$(hard_limit l)"'),     # the node's own limit, as Slurm set it (NCCL/IB)
             "--add-host", Raw('"$(hostname):$NODE_IP"'),       # Gloo resolves the node's hostname
             "-w", WORKDIR, *cli_flags(n)]
        for d in n.devices:
            a += ["--device", d]
        if n.group_add:
            a += ["--group-add", "keep-groups"]
        return a + [*extra, image, *n.command]

    def pull_commands(self, ref, out_name, insecure=False):
        return [["podman", "pull", *(["--tls-verify=false"] if insecure else []), ref]]


class Apptainer(Runtime):
    name = "apptainer"
    command = "apptainer"
    env_prefix = "APPTAINERENV_"   # what it passes into the container, the prefix taken off
    runs_as_user = True
    bind_separators = ":,"        # --bind SRC:DST[:OPTS][,...]
    # Environment goes in as APPTAINERENV_<NAME> (--env splits on commas); whether Apptainer then expands
    # `$` or drops quotes we could not run here to see, so such values are refused rather than guessed.
    unverified_env = "$`\\\"'\n"
    gpu_check = "gpu_driver_libraries.sh"
    no_driver_fix = "check the node's driver install: apptainer --nv binds the libraries the node's loader knows"

    def launch(self, n, image, extra=()):
        a = [self.command, "exec", "--cleanenv", "--pwd", WORKDIR]
        a += {"cuda": ["--nv"], "rocm": ["--rocm"]}.get(n.accelerator, [])
        for m in n.mounts:
            a += ["--bind", f"{m.src}:{m.dst}:{'ro' if m.ro else 'rw'}"]
        return a + [*extra, image, *n.command]

    def exports(self, n):
        return {f"{self.env_prefix}{k}": v for k, v in n.env.items()}

    def prelude_for(self, n):   # a variable passed by name: its value from the task's environment, never written
        return [Raw(f'export {self.env_prefix}{k}="${{{k}}}"') for k in n.pass_env]

    def allocation(self, device, procs):   # --cleanenv drops them: pass them on by name
        lines, words = super().allocation(device, procs)
        return lines + [Raw(f'for v in {" ".join(self.VISIBLE)}; do [ -z "${{!v+x}}" ] || '
                            f'export "{self.env_prefix}$v=${{!v}}"; done')], words

    kinds = ("sif", REGISTRY)
    URI = re.compile(r"(docker|oras|library|shub|https?)://(.+)|(docker-archive|docker-daemon|oci|oci-archive):(.+)")

    def registry_form(self, ref):
        return f"docker://{ref}"

    def given_image(self, image):
        if os.path.exists(image):   # a SIF file or a sandbox folder
            return os.path.abspath(image)
        m = self.URI.fullmatch(image)
        if not m:
            hint = f" (docker://{image} for a registry image)" if registry_host(image) else ""
            raise UserError(f"--image {image!r}: {self.name} runs an existing SIF file or sandbox folder, or a URI "
                            f"with its transport{hint}; no such file here")
        if m.group(1) in ("docker", "oras") and not registry_host(m.group(2)):
            raise UserError(f"--image {image!r} names no registry, so {self.name} would pull it from Docker Hub: "
                            f"write {m.group(1)}://HOST[:PORT]/{m.group(2)} (docker.io for Docker Hub itself)")
        return image

    def pull_commands(self, ref, out_name, insecure=False):
        return [[*(["env", f"{self.command.upper()}_NOHTTPS=1"] if insecure else []), self.command, "pull",
                 f"{out_name}.sif", self.registry_form(ref)]]


class Singularity(Apptainer):
    """SingularityCE (Sylabs), the project Apptainer was forked from and what many sites still run: the same
    command line (exec --cleanenv --pwd --nv --rocm --bind, pull, SIF files) as `singularity`, environment passed
    as SINGULARITYENV_<NAME>. SingularityCE 3.5 or newer (--rocm; SIF)."""
    name = "singularity"
    command = "singularity"
    env_prefix = "SINGULARITYENV_"
    no_driver_fix = "check the node's driver install: singularity --nv binds the libraries the node's loader knows"


class Charliecloud(Runtime):
    name = "charliecloud"
    runs_as_user = True
    container_home = "/home/{user}"   # ch-run --home mounts the host's $HOME there
    # ch-run --set-env=NAME=VALUE strips one pair of quotes around a value and a newline ends a value
    # (measured with ch-run 0.31); `$` is kept by --env-no-expand.
    unverified_env = "\n"
    gpu_check = "gpu_fromhost.sh"
    no_driver_fix = "run `ch-fromhost --nvidia IMAGE_DIR` on a GPU node to put the driver's libraries in the image"

    def check(self, n, image):
        super().check(n, image)
        for key, value in n.env.items():
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                raise UserError(f"--env {key}: charliecloud strips the quotes around {value!r}; "
                                f"drop them or set it in the script instead")

    def launch(self, n, image, extra=()):
        # --set-env: the image's own environment (PATH to the venv); --home: the user's home, for the cache;
        # --env-no-expand: `$` in a value is literal, as everywhere in fleetbox
        a = ["ch-run", "--env-no-expand", "--set-env", "--home"]
        a += [f"--set-env={k}={v}" for k, v in n.env.items()]
        # --pass-env: nothing here. ch-run passes the task's environment through, and a value on its command line
        # would be readable by every user of the node (/proc/<pid>/cmdline)
        for m in n.mounts:
            a += ["-b", f"{m.src}:{m.dst}"]
        return a + ["-c", WORKDIR, *extra, image, "--", *n.command]

    def allocation(self, device, procs):   # ch-run passes the environment on, but the image's may override it
        lines, words = super().allocation(device, procs)
        return lines + [Raw(f'VISIBLE=(); for v in {" ".join(self.VISIBLE)}; do [ -z "${{!v+x}}" ] || '
                            'VISIBLE+=("--set-env=$v=${!v}"); done')], [Raw('${VISIBLE[@]+"${VISIBLE[@]}"}')]

    kinds = ("charliecloud-squash", "charliecloud")   # no registry: ch-run runs a folder or a squashfs file

    def given_image(self, image):
        if not os.path.exists(image):
            raise UserError(f"--image {image!r}: charliecloud runs an image folder or a squashfs file (`invoke "
                            f"export --format charliecloud [--squash]`); no such file or folder here")
        return os.path.abspath(image)

    def pull_commands(self, ref, out_name, insecure=False):
        return [["ch-image", "pull", *(["--tls-no-verify"] if insecure else []), ref],
                ["ch-convert", ref, f"{out_name}.sqfs"]]


class Pyxis(Runtime):
    name = "pyxis"
    runs_as_user = True
    node_script_inside = True
    bind_separators = ":,"        # --container-mounts=SRC:DST[:FLAGS][,...]
    no_driver_fix = ("enroot's NVIDIA hook must run: /etc/enroot/hooks.d/98-nvidia.sh and libnvidia-container "
                     "(nvidia-container-cli) on the node")

    def check(self, n, image):
        super().check(n, image)
        if "," in image:
            raise UserError(f"image {image!r}: pyxis reads ',' in --container-image as a separator")

    JOB_MOUNT = "/fleetbox/job"

    def as_user(self, n):
        """Also: srun's --container-mounts are one line for every node, so the job folder is mounted whole
        and each node's launcher writes into its own node<rank> folder in it."""
        n = super().as_user(n)
        log = next(m for m in n.mounts if m.dst == settings.LOG_DIR)
        job_dir = log.src.rsplit("/", 1)[0]
        own = f"{self.JOB_MOUNT}/{{node}}"   # the node's folder, where the ranks write logs and progress
        cmd = list(n.command)
        if "--log_dir" in cmd:   # else the ranks' folder is in the environment (a script that spawns its ranks)
            cmd[cmd.index("--log_dir") + 1] = own
        return replace(n, command=tuple(cmd), env={k: own if v == log.dst else v for k, v in n.env.items()},
                       mounts=tuple(replace(m, src=job_dir, dst=self.JOB_MOUNT) if m is log else m for m in n.mounts))

    def identify(self, image):   # node.sh runs inside the container already
        return Raw('echo "fleetbox: image ref $IMAGE_REF"')

    def launch(self, n, image, extra=()):
        return list(n.command)   # srun runs node.sh inside --container-image; node.sh runs the command

    def exports(self, n):
        return dict(n.env)       # node.sh runs inside the container: the launcher's environment

    def srun_options(self, n, image):
        mounts = ",".join(f"{m.src}:{m.dst}" + (":ro" if m.ro else "") for m in n.mounts)
        return [f"--container-image={image}", f"--container-mounts={mounts}", f"--container-workdir={WORKDIR}",
                "--container-mount-home"]

    kinds = ("sqsh", REGISTRY)

    def registry_form(self, ref):   # enroot's [USER@][REGISTRY#]IMAGE: without '#', Docker Hub
        host, _, path = ref.partition("/")
        return f"{host}#{path}"

    def given_image(self, image):
        if os.path.isfile(image):   # pyxis reads a path (absolute) as a squashfs file
            return os.path.abspath(image)
        if "#" in image:
            return image
        if image.startswith(("/", "./", "../")) or image.endswith((".sqsh", ".sqfs", ".squashfs")):
            raise UserError(f"--image {image!r}: no such squashfs file here")
        form = f"{self.registry_form(image)}" if registry_host(image) else f"REGISTRY#{image}"
        raise UserError(f"--image {image!r}: enroot reads an image without 'REGISTRY#' as one on Docker Hub; write "
                        f"{form}, or give a squashfs file (`invoke export --format sqsh`)")

    def pull_commands(self, ref, out_name, insecure=False):
        return [["enroot", "import", "-o", f"{out_name}.sqsh", f"docker://{self.registry_form(ref)}"],
                ["srun", f"--container-image={out_name}.sqsh", "..."]]


ENV_RECORD = settings.ENV_RECORD   # what `invoke venv` writes last into an env (image/venvs.py)


def check_env(path: Path, variant: str, what: str) -> dict:
    """An env made by `invoke venv` for this variant (its record), else one line."""
    record = path / ENV_RECORD
    try:
        made = json.loads(record.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} is not an env made by `invoke venv` (no {ENV_RECORD}): make one with `invoke venv "
                        f"--variant {variant} --dest DIR`") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: cannot read its {ENV_RECORD}: {e}") from None
    if made.get("variant") != variant:
        raise UserError(f"{what} was made for variant {made.get('variant')!r}, not {variant}: give --variant "
                        f"{made.get('variant')} or make one with `invoke venv --variant {variant}`")
    python = path / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise UserError(f"{what}: its interpreter {os.readlink(python) if python.is_symlink() else python} is not "
                        f"here (a venv needs it at the same path on every node)")
    return made


class Host(Runtime):
    """No container (--runtime none): the job runs with the Python of an env that `invoke venv` made on a file
    system every node sees, after the site's environment modules are loaded. What a container sees at fixed
    paths (the script's folder, the logs, the helpers, the checkpoints, a --resume folder) is given at its real
    path; devices are the task's allocation as Slurm set it (its cgroup holds the processes). Nothing is
    isolated: the node's own /dev/shm, limits, home and dataset cache (~/.cache/paddle/dataset) count."""
    name = "none"
    runs_as_user = True
    has_image = False
    no_driver_fix = "no container: the node's own driver is used; check `nvidia-smi` on the node and the modules loaded"
    OURS = ("FLEETBOX_CHECKPOINT_DIR", "FLEETBOX_PROGRESS_DIR", "FLEETBOX_LOG_DIR", "FLEETBOX_VISUALDL_DIR",
            "FLEETBOX_RESUME", "PYTHONPATH")   # path values

    def __init__(self, venv: str = "", modules: tuple[str, ...] = ()):
        # absolute: node.sh runs from the script's folder (a path starting with a placeholder is the node's)
        self.venv = venv if not venv or venv.startswith("{") else os.path.abspath(venv)
        self.modules = tuple(modules)

    def refuse(self, spec, runtime_args: tuple[str, ...]) -> None:
        """The options that mean a container, each refused in one line; the env checked where this machine sees
        it (the shared file system) for every node."""
        what = {"--image": spec.image, "--mount": spec.mounts, "--runtime-args": runtime_args,
                "--data-dir": spec.data_dir if spec.data_dir != str(settings.data_dir()) else ""}   # default: unused
        why = {"--image": "the job runs the env given with --venv",
               "--mount": "the job sees the nodes' own file systems",
               "--runtime-args": "no runtime is started",
               "--data-dir": f"Paddle reads each node's ~/{settings.HOME_CACHE}: seed it with "
                             f"`invoke cache --dest ~/{settings.HOME_CACHE}`"}
        for flag, value in what.items():
            if value:
                raise UserError(f"{flag} means a container; with --runtime none {why[flag]}")
        if not self.venv or "\n" in self.venv:
            raise UserError("--runtime none needs --venv PATH: an env made by `invoke venv` on a file system every "
                            "node sees")
        home = os.path.expanduser("~")
        for k in range(spec.nodes):
            path = placeholders.fill(self.venv, {"rank": str(k), "node": f"node{k}", "nnodes": str(spec.nodes),
                                                 "home": home, "user": getpass.getuser()})
            if placeholders.used(path):   # a value known on the node only
                return
            check_env(Path(path), spec.variant.name, f"--venv {path}")

    def as_user(self, n):   # the dataset cache is the user's own: nothing is mounted over it
        return replace(n, mounts=tuple(m for m in n.mounts if m.dst != settings.CONTAINER_CACHE))

    def on_host(self, n, path):   # no container: the ranks see the node's paths (exports gave them real ones)
        return path

    def real(self, word: str, paths, sep: str = ",") -> str:
        """A word with each `sep`-separated piece that is a container path given as its real path."""
        def one(piece: str) -> str:
            real = mounted(piece, paths)
            return piece if real is None else real
        return sep.join(one(p) for p in word.split(sep)) if isinstance(word, str) else word

    def check(self, n, image):
        pass   # refuse() held the env to its rules; its path may hold placeholders

    def setup(self, n):
        work = next(m.src for m in n.mounts if m.dst == WORKDIR)
        return [*super().setup(n), ["export", f"FLEETBOX_VENV={self.venv}"],
                template("host_env.sh", RECORD=ENV_RECORD, LIBRARIES=settings.ENV_LIBRARIES), ["cd", work]]

    def identify(self, image):
        return template("identify_env.sh", RECORD=ENV_RECORD)

    def exports(self, n):
        paths = self.paths(n)
        return {k: self.real(v, paths, ":") if k in self.OURS else v for k, v in n.env.items()}

    def prelude_for(self, n):   # the site's PYTHONPATH (a module's) after the helpers and the user's --env
        return [Raw('[ -z "$SITE_PYTHONPATH" ] || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE_PYTHONPATH"')]

    def launch(self, n, image, extra=()):
        paths = self.paths(n)
        cmd = [self.real(w, paths) for w in n.command]
        if cmd and cmd[0] == "python":
            cmd[0] = Raw('"$FLEETBOX_VENV/bin/python"')
        return cmd

    def pull_commands(self, ref, out_name, insecure=False):
        raise UserError("runtime none runs no image: make the env on the cluster with `invoke venv` (README: "
                        "sites without containers)")


def mounted(path: str, paths: list[tuple[str, str]]) -> str | None:
    """The real path of a container path, through (container path, real path) pairs, longest first; None where
    no mount holds it."""
    for dst, src in paths:
        if path == dst or path.startswith(dst + "/"):
            return src + path[len(dst):]
    return None


def registry_host(ref: str) -> str | None:
    """The registry an image reference names, by Docker's rule: a first component with '.' or ':', or localhost;
    None for a name that a pull would look up on Docker Hub (fleetbox/paddle:cpu, ubuntu) or an image id."""
    first, sep, _ = ref.partition("/")
    return first if sep and ("." in first or ":" in first or first == "localhost") else None


def default_image(rt: Runtime, variant, built: str | None, records: list[shipped.Shipped]) -> tuple[str, str]:
    """Pure: what runtime `rt` runs when no --image is given, and why: what was shipped (`records`, newest first)
    of the build here (`built`, a content tag) in a kind the runtime runs, preferred kind first. Where no image is
    built here (a login node), the newest shipped build. Else one line naming the commands that make one."""
    usable = [r for r in records if r.kind in rt.kinds]
    current = built or (usable[0].content_tag if usable else None)
    mine = [r for r in usable if r.content_tag == current]
    if mine:
        best = min(mine, key=lambda r: (rt.kinds.index(r.kind), -r.made))
        image = rt.registry_form(best.where) if best.kind == REGISTRY else best.where
        why = f"{best.kind} of {current}" + ("" if built else
                                             f" (no {variant.name} image is built here: the newest build shipped)")
        return image, why
    make = [f"`invoke push --variant {variant.name} --registry HOST[:PORT]/NS`" if k == REGISTRY else
            f"`{exports.export_command(variant, k)}`" for k in rt.kinds]
    older = sorted({r.content_tag for r in usable})
    said = f"; {', '.join(older)}: shipped of another build" if older else ""
    if not built:
        raise UserError(f"{rt.name} has no {variant.name} image: none is built here and none was shipped for it; "
                        f"run `invoke build --variant {variant.name}`, then {' or '.join(make)}; or give --image")
    raise UserError(f"{rt.name} has no image of {built} (the {variant.name} image built here){said}: make one with "
                    f"{' or '.join(make)}, or give --image")


RUNTIMES = {r.name: r for r in (Apptainer(), Singularity(), Pyxis(), Charliecloud(), Podman(), Docker(), Host())}


def get(name: str, venv: str = "", modules: tuple[str, ...] = ()) -> Runtime:
    """The runtime, loading `modules` first on each node."""
    if name not in RUNTIMES:
        raise UserError(f"unknown runtime {name!r}; choose one of: {', '.join(RUNTIMES)}")
    if name == Host.name:
        return Host(venv, modules)
    if modules and RUNTIMES[name].node_script_inside:
        raise UserError(f"--modules: {name} starts the container from srun itself, before anything runs on the "
                        f"node; load what it needs before submitting")
    rt = copy.copy(RUNTIMES[name])
    rt.modules = tuple(modules)
    return rt


def pull_commands(runtime: str, content_ref: str | None, alias_ref: str, out_name: str,
                  insecure: bool = False) -> list[str]:
    """Pure: the commands (quoted) a cluster user runs to get the content tag, then the alias, into `runtime`.
    Without a content tag (the image is not built here) only the alias, said to be mutable."""
    rt = get(runtime)
    out = []
    pairs = [(content_ref, "content tag (immutable)"), (alias_ref, "alias")] if content_ref else \
        [(alias_ref, "alias (mutable: the image is not built here, so its immutable content tag is unknown)")]
    for ref, what in pairs:
        out.append(f"# {what}")
        out += [line(words) for words in rt.pull_commands(ref, out_name, insecure)]
    return out
