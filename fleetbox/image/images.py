"""Image builds (`invoke build`): plan (pure) and act (hermetic docker build from the wheelhouse).

The content tag hashes everything the image is made of: the layer recipe, lock, base image ID and build args.
Same inputs, same tag: when it exists, nothing is rebuilt (and nothing is sent to the engine).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleetbox import ROOT, engine, files, settings
from fleetbox.data import datasets
from fleetbox.engine import image_or_none, run_dir
from fleetbox.errors import UserError
from fleetbox.image import kernels, layers, locks, receipts, wheelhouse
from fleetbox.image.matrix import Variant
from fleetbox.processes import process_start, signals_held, stops_as_interrupt, this_host

DATA_DOCKERFILE = ROOT / "images" / "data.Dockerfile"

UNKNOWN = "<unknown until the base exists>"
LABEL_GPUS = "io.fleetbox.gpu-architectures"   # the SASS architectures of Paddle's kernels, measured or published
BUILD_PREFIX = "fleetbox-layer-"   # a build's containers and scratch volume: what `clean --images` removes when
                                  # a killed build left them
PROFILE = "fleetbox-layer-profile"   # build.log's line per layer made: where its time went (bench/build.py)


def short_id(image_id: str) -> str:
    """An image ID as `docker images` shows it: 12 hex digits."""
    return image_id[7:19] if image_id.startswith("sha256:") else image_id


@dataclass(frozen=True)
class BuildPlan:
    variant: Variant
    base_ref: str
    base_id: str
    build_args: dict[str, str]
    lock_sha256: str
    content_hash: str
    labels: dict[str, str] = field(default_factory=dict)
    data: tuple = ()   # data sets baked on top, in a thin image of their own
    layers: tuple = ()   # image/layers.py's Layers, in order (keys valid once base_id is known)

    @property
    def aliases(self) -> list[str]:
        return self.variant.aliases

    @property
    def data_tag(self) -> str:
        if not (self.data and self.content_hash):
            return ""
        h = content_hash(self.content_hash, "", "", {}, datasets.identity(list(self.data)))
        return f"{self.variant.image}:{self.variant.name}-{h[:12]}"

    @property
    def data_aliases(self) -> list[str]:
        names = "-".join(d.name for d in self.data)
        return [f"{a}-with-{names}" for a in self.variant.aliases] if self.data else []

    @property
    def tag(self) -> str:
        return f"{self.variant.image}:{self.variant.name}-{self.content_hash[:12]}" if self.content_hash else UNKNOWN

    @property
    def tags(self) -> list[str]:
        return [self.tag, *self.aliases]

    def describe(self) -> list[str]:
        v = self.variant
        return [
            f"variant   {v.name}: {v.description} [{v.device}{''.join(f', {k} {x}' for k, x in v.accel.items())}]",
            f"paddle    {v.paddle} from {v.paddle_index or v.pypi}",
            f"extras    {' '.join([*v.extras, *v.tools])} from {v.pypi}",
            *([f"no deps   {' '.join(v.no_deps)} (without their dependencies)"] if v.no_deps else []),
            f"python    {v.python_version} on {v.platform}",
            *(gpus_lines(kernels.load(v)) if v.device == "cuda" else []),
            f"base      {self.base_ref} (id {short_id(self.base_id)})",
            f"lock      {v.lock_path.relative_to(ROOT)} "
            + (f"sha256 {self.lock_sha256[:16]}…" if self.lock_sha256 else "MISSING: "
               + f"make it with `invoke lock --variant {v.name}` where {v.paddle_index or v.pypi} is reachable"),
            f"tag       {self.tag}",
            f"aliases   {' '.join(self.aliases)}",
            "datasets  " + (f"{', '.join(d.name for d in self.data)} baked at {settings.CONTAINER_CACHE} in "
                             f"{self.data_tag or UNKNOWN} ({' '.join(self.data_aliases)})"
                             if self.data else "none baked"),
            *[f"layer     {x.name}: {', '.join(e.name for e in x.entries)}"
              + ("; then the freeze file, the SBOM and bind-mount targets" if x.last else "") for x in self.layers],
            "settings  the environment, working folder, command and labels, committed onto the last layer (no "
            "layer of their own)",
            "command   per layer: docker run --network none --mount type=bind,dst=/mnt,readonly,src=WHEELHOUSE "
            "<previous layer> sh -c <install> && docker commit (every build writes these commands to "
            "runs/build-<variant>-*/by-hand.sh; invoke build installs the layers after the first beside it and "
            "copies them in: the same bytes)",
        ]


def gpus_lines(k: kernels.Kernels | None) -> list[str]:
    """What `build --dry-run` says of the GPUs a CUDA variant runs on."""
    if k is None:
        return ["gpus      not known: `invoke wheels` measures them from the wheel"]
    others = "; ".join(f"{p.rsplit('/', 1)[-1]} {', '.join(a) or 'none in common'}" for p, a in k.others().items())
    return [f"gpus      {k.said()}", *([f"          other kernel libraries (only the ops that call them): {others}"]
                                      if others else [])]


def pip_wheel(entries: list[locks.Locked]) -> str:
    """pip runs from its own wheel inside the build; pip only ships py3-none-any wheels."""
    pip = next((e for e in entries if e.name.lower() == "pip"), None)
    if pip is None:
        raise UserError("the lock has no pip: add pip to the variant's `tools` in images/matrix.toml")
    return f"pip-{pip.version}-py3-none-any.whl"


def build_args(variant: Variant, entries: list[locks.Locked]) -> dict[str, str]:
    return {"BASE_IMAGE": variant.base_ref, "PYTHON": variant.base.python, "PIP_WHEEL": pip_wheel(entries),
            "VARIANT": variant.name, "DEVICE": variant.device}


def content_hash(dockerfile_text: str, lock_text: str, base_id: str, args: dict[str, str],
                 data: list | None = None) -> str:
    inputs = {"dockerfile": dockerfile_text, "lock": lock_text, "base_id": base_id, "args": args}
    if data:
        inputs["datasets"] = data
    blob = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def freeze(entries: list[locks.Locked]) -> str:
    """The locked packages, space-separated (a `docker commit --change LABEL` cannot hold a newline)."""
    return " ".join(f"{e.name}=={e.version}" for e in sorted(entries, key=lambda e: e.name.lower()))


def labels(variant: Variant, lock_sha: str, base_id: str, chash: str, entries, revision: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": f"fleetbox paddle {variant.name}",
        "org.opencontainers.image.description": variant.description,
        "org.opencontainers.image.version": variant.paddle_version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.source": "fleetbox",
        "org.opencontainers.image.base.name": variant.base_ref,
        "org.opencontainers.image.base.digest": base_id,
        settings.LABEL_VARIANT: variant.name,
        "io.fleetbox.device": variant.device,
        settings.LABEL_LOCK: lock_sha,
        settings.LABEL_INPUTS: chash,
        settings.LABEL_FREEZE: freeze(entries),
        settings.LABEL_SBOM: settings.SBOM,
        **{f"io.fleetbox.{k}": v for k, v in variant.accel.items()},
        **({LABEL_GPUS: k.label()} if (k := kernels.load(variant)) else {}),
    }


def recipe(variant: Variant, split: list, entries: list) -> str:
    """What the image is made from besides the lock and base: the layer split and each layer's script."""
    return json.dumps({"layers": [(x.name, x.script, [e.name for e in x.entries]) for x in split],
                       "settings": layers.changes(variant, [], {}), "freeze": freeze(entries), "mount": layers.MOUNT,
                       # the GPUs label: a wheel measured since the last build is a new image, not a stale label
                       **({"gpus": k.label()} if (k := kernels.load(variant)) else {}),
                       "sbom": receipts.FORMAT})   # what the SBOM in its last layer holds


# The labels that differ by machine or commit: a rendered Dockerfile takes them as build arguments
DOCKERFILE_ARGS = {"org.opencontainers.image.revision": "REVISION", "org.opencontainers.image.base.name": "BASE_IMAGE",
                   "org.opencontainers.image.base.digest": "BASE_DIGEST", settings.LABEL_INPUTS: "CONTENT_HASH"}


def dockerfile_path(variant: Variant) -> Path:
    return ROOT / "images" / f"{variant.name}.Dockerfile"


def render_dockerfile(variant: Variant) -> str:
    """The variant's build as a Dockerfile (image/layers.py): from the matrix and the lock alone, so it is the
    same on every machine; what differs by machine or commit comes in as build arguments."""
    return dockerfile_text(variant, *locks.read(variant))


def dockerfile_text(variant: Variant, lock_text: str, entries: list[locks.Locked]) -> str:
    split = plan(variant, None, (lock_text, entries)).layers   # the layers `invoke build` makes (no base yet)
    lbl = labels(variant, locks.lock_hash(lock_text), "", "", entries, "")
    return layers.dockerfile(variant, list(split), lbl, DOCKERFILE_ARGS, variant.lock_path.name)


def write_dockerfile(variant: Variant, dry_run: bool = False, log=print) -> Path | None:
    """`invoke build --dockerfile`: write images/<variant>.Dockerfile (with --dry-run, print it); no engine."""
    text = render_dockerfile(variant)
    if dry_run:
        log(text.rstrip("\n"))
        return None
    path = files.write_atomic(dockerfile_path(variant), text)
    log(f"wrote {path.relative_to(ROOT)} ({len(variant_layers(text))} layers); build it as its comments say")
    return path


def variant_layers(text: str) -> list[str]:
    """The layers a rendered Dockerfile names, in order."""
    return re.findall(r"^# layer (\S+):", text, re.M)


def plan(variant: Variant, base_id: str | None, lock: tuple[str, list] | None, revision: str = "",
         data: list[datasets.Dataset] = ()) -> BuildPlan:
    """Pure: everything the build will do, from the variant, its base's ID, its lock (None if missing) and
    the data sets to bake."""
    lock_text, entries = lock if lock else ("", [])
    args = build_args(variant, entries) if entries else {
        "BASE_IMAGE": variant.base_ref, "PYTHON": variant.base.python, "PIP_WHEEL": "<from the lock>",
        "VARIANT": variant.name, "DEVICE": variant.device}
    lock_sha = locks.lock_hash(lock_text) if lock_text else ""
    split = layers.plan(variant, lock_text, entries, base_id or "", args["PYTHON"], args["PIP_WHEEL"]) \
        if entries else []
    chash = content_hash(recipe(variant, split, entries), lock_text, base_id, args) if (base_id and lock_text) else ""
    split = layers.keyed_by_inputs(split, chash) if chash else split
    lbl = labels(variant, lock_sha, base_id or "", chash, entries, revision) if chash else {}
    return BuildPlan(variant, variant.base_ref, base_id or UNKNOWN, args, lock_sha, chash, lbl, tuple(data),
                     tuple(split))


def dry_run(variant: Variant, client_or_none, data: list[datasets.Dataset] = ()) -> BuildPlan:
    """The plan for any variant, with whatever is known here (no lock or no base is not an error)."""
    try:
        lock = locks.read(variant)
    except UserError:
        lock = None
    base = image_or_none(client_or_none, variant.base_ref) if client_or_none else None
    return plan(variant, base.id if base else None, lock, data=data)


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy(src, dst)


def build(c, variant: Variant, wheel_dir: Path | None = None, force: bool = False, log=print,
          data: list[datasets.Dataset] = (), data_dir: Path | None = None, sign_key: Path | None = None) -> BuildPlan:
    """Build the variant's image with the network off, unless an image with the same inputs exists."""
    if sign_key is not None:
        receipts.check_key(sign_key)
    lock_text, entries = locks.read(variant)
    base = image_or_none(c, variant.base_ref)
    if base is None:
        raise UserError(f"base {variant.base_ref} is missing; run `invoke base --variant {variant.name}`")
    p = plan(variant, base.id, (lock_text, entries), source_revision(), data=list(data))
    existing = image_or_none(c, p.tag)
    wheel_dir = wheel_dir or wheelhouse.default_dir(variant)
    # the image's SBOM, which its last layer copies in from the wheelhouse (each way of building mounts it there):
    # put there by up to date builds too, for the Dockerfile and by-hand.sh (where it can be: a shared wheelhouse
    # may be read-only to this user)
    with stops_as_interrupt():   # its reads of the base's files, out of a container, are undone on a kill too
        sbom = _sbom(c, p, entries, wheel_dir) if (wheel_dir / wheelhouse.MANIFEST).exists() else None
    if sbom and not _sbom_in(wheel_dir, sbom[0]) and not (existing and not force):
        raise UserError(f"cannot write the image's SBOM into the wheelhouse {wheel_dir}, whence its last layer "
                        f"copies it: make it writable, or give one that is (--wheelhouse)")
    if existing and not force:
        _alias(existing, p.aliases)
        log(f"{p.tag} is up to date (same layers, lock, base and args); nothing to build")
        if sbom and receipts.image_file(c, existing.id, settings.SBOM) != sbom[0].encode():
            raise UserError(f"{p.tag} holds another SBOM than its inputs make (an image built from a wheelhouse "
                            f"without it, or changed since): `invoke build --variant {variant.name} --force` makes "
                            f"it again")
        if sbom and not receipts.provenance_path(existing.id).exists():   # built before, elsewhere, or a kit's
            keep_receipts(c, p, lock_text, entries, existing, None, None, force, log, sbom)
    else:
        _build_main(c, p, lock_text, entries, wheel_dir, existing, force, log, sbom)
    if sign_key is not None:
        signed = receipts.sign(receipts.provenance_path(c.images.get(p.tag).id), sign_key)
        log(f"signed the provenance statement with {sign_key}: {signed}")
    if data:
        _bake(c, p, data_dir or settings.data_dir(), force, log)
    return p


def _build_main(c, p: BuildPlan, lock_text, entries, wheel_dir: Path, existing, force: bool, log,
                sbom: tuple[str, int]) -> None:
    """The environment in layers (image/layers.py): each layer a container of the one before with the
    wheelhouse mounted read-only and the network off, then committed; a layer whose inputs are unchanged is
    reused. The first layer made installs in its own container; the ones after it are installed beside it on a
    scratch volume (_staged) and copied in, in order, once it is committed. The image's settings are then
    committed onto the last layer (_settings: no layer)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 (only builds use it)
    variant, split, wheels = p.variant, p.layers, str(wheel_dir.resolve())
    if not (wheel_dir / wheelhouse.MANIFEST).exists():   # the common mistake, said before anything starts
        wheelhouse.verify(variant, wheel_dir, lock_text, entries)
    # the wheels' hashes are checked while the first containers start; its answer is awaited before a
    # layer's container is read (pip checks them again in there, less clearly)
    checking = ThreadPoolExecutor(max_workers=1).submit(wheelhouse.verify, variant, wheel_dir, lock_text, entries)
    for line in p.describe():
        log(line)
    rd = run_dir(f"build-{variant.name}")
    began = datetime.datetime.now(datetime.UTC)
    base = c.images.get(p.base_id)   # by ID, as every layer after: the keys name IDs, and a tag can move
    change_list = layers.changes(variant, base.attrs["Config"].get("Env") or [], p.labels)
    files.write_atomic(rd / "by-hand.sh", layers.by_hand(variant, split, p.base_id, wheels, p.tag, change_list))
    have = {x.name: None if force else image_or_none(c, layers.layer_tag(x)) for x in split}
    if split and have[split[-1].name] and \
            receipts.image_file(c, have[split[-1].name].id, settings.SBOM) != sbom[0].encode():
        have[split[-1].name] = None   # a last layer made from another SBOM (by hand, from another wheelhouse): again
    made_here, staged, parent = making(split, {k: v.id if v else None for k, v in have.items()}, base.id)
    removals = _Removals(c)
    try:
        with open(rd / "build.log", "a") as out, stops_as_interrupt(), \
                _staged(c, parent, staged, wheels, p.build_args, out, removals) as stage:

            def started() -> None:   # a layer's own container runs: the staging container starts only after the
                if stage:            # first one's (the build's longer path); then the wheelhouse's check is awaited
                    stage.start()
                checking.result()

            for layer in split:
                tag = layers.layer_tag(layer)
                if layer not in made_here:
                    log(f"layer {layer.name:<24} reused ({tag})")
                    parent = have[layer.name].id
                    continue
                t0 = time.monotonic()
                if layer in staged:
                    waited = stage.wait()
                    # the last copy empties the stage (copy_script), so that one mounts it writable
                    made = _run_and_commit(c, parent, layer.name, layers.copy_script(layer.last),
                                           [stage.number(layer)], [stage.mount(read_only=not layer.last),
                                                                   *[_wheels_mount(wheels)] * layer.last], tag,
                                           [layers.CMD], out, removals, {"waited": waited})
                    if layer is staged[-1]:
                        stage.release()
                else:
                    made = _run_and_commit(c, parent, layer.name, layer.script, [layer.requirements],
                                           [_wheels_mount(wheels)], tag, [layers.CMD], out, removals,
                                           started=started)
                size = made.history()[0]["Size"]
                how = f" (installed beside {made_here[0].name})" if layer in staged else ""
                log(f"layer {layer.name:<24} {size / 2**20:8.1f} MiB in {time.monotonic() - t0:5.1f} s{how}")
                parent = made.id
            checking.result()   # also where no layer was made: a tampered wheelhouse stops every build
            # a last layer made here holds the SBOM this build wrote (a reused one was checked when chosen), before
            # the image is tagged
            if split[-1] in made_here and receipts.image_file(c, parent, settings.SBOM) != sbom[0].encode():
                with contextlib.suppress(Exception):
                    c.images.remove(layers.layer_tag(split[-1]), noprune=True)   # nor is the layer reused
                raise UserError(f"the last layer holds another SBOM than this build wrote into the wheelhouse "
                                f"{wheel_dir}: another build changed it meanwhile; build again")
            image = _settings(c, parent, p.tag, change_list, out, removals)
    finally:
        checking.cancel()
        removals.wait()
    _alias(image, p.aliases)
    _tidy(c, existing, image)
    files.write_json(rd / "plan.json", {"tags": p.tags, "build_args": p.build_args, "labels": p.labels,
                                        "layers": [(x.name, x.key) for x in split]})
    keep_receipts(c, p, lock_text, entries, image, began, rd, force, log, sbom)
    log(f"built {p.tag} ({image.attrs['Size'] / 1e6:.0f} MB); aliases {', '.join(p.aliases)}; "
        f"by hand: {rd / 'by-hand.sh'}")


def making(split: list, have: dict[str, str | None], base_id: str) -> tuple[list, list, str]:
    """Pure: (the layers to make, those of them installed beside the first one made and copied in, the image
    the first one made is a container of: with none to make, the last layer's), from the layers whose image
    exists ({name: image ID or None})."""
    made = [x for x in split if have[x.name] is None]
    first = split.index(made[0]) if made else len(split)
    parent = have[split[first - 1].name] if first else base_id
    return made, made[1:], parent


class _Removals:
    """Containers and volumes the build is done with, removed in order on a thread of their own, so the next
    layer does not wait for it (removing Paddle's layer's container, every file it wrote, took 1.0 s); every
    one is gone before the build returns or raises."""
    def __init__(self, c):
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 (only builds use it)
        self.c, self.pool = c, ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetbox-removals")

    def container(self, name: str) -> None:
        self.pool.submit(self._quietly, self.c.api.remove_container, name, force=True)

    def volume(self, name: str) -> None:
        self.pool.submit(self._quietly, self.c.api.remove_volume, name, force=True)

    @staticmethod
    def _quietly(remove, name: str, **kw) -> None:
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)
        import requests  # noqa: PLC0415
        try:
            remove(name, **kw)
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            pass   # never made (NotFound), or the engine is gone: nothing more can be done

    def wait(self) -> None:
        with signals_held():
            self.pool.shutdown(wait=True)


def _wheels_mount(wheels: str):
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    # a bind mount in the host config only: `volumes=` would also declare a VOLUME that commit keeps
    return docker.types.Mount(layers.WHEELS, wheels, type="bind", read_only=True)


@dataclass
class _Stage:
    """The container that installs the staged layers onto a scratch volume of the same name (_staged)."""
    c: object
    image: str   # what it is a container of: the first layer made's parent
    volume: str
    command: list[str]
    wheels: str
    numbers: dict[str, str]   # layer name -> its folder under layers.STAGE
    out: object
    removals: _Removals
    container: object = None
    started: float = 0.0
    done: bool = False

    @property
    def what(self) -> str:
        return f"installing {', '.join(self.numbers)}"

    def number(self, layer) -> str:
        return self.numbers[layer.name]

    def mount(self, read_only: bool):
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)
        return docker.types.Mount(layers.STAGE, self.volume, type="volume", read_only=read_only, no_copy=True)

    def start(self) -> None:
        """Run it (once; called when the first layer's own container runs, which goes first)."""
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)
        if self.started:
            return
        self.started = time.time()
        try:
            self.c.volumes.create(self.volume)
            self.container = self.c.containers.create(
                self.image, self.command, name=self.volume, network_mode="none", cpu_shares=2,
                labels={BUILDER: _builder()}, mounts=[_wheels_mount(self.wheels), self.mount(read_only=False)])
            self.container.start()
        except docker.errors.APIError as e:
            raise UserError(f"{self.what}: the engine refused: {_explain(e)}") from None

    def release(self) -> None:
        """Every staged layer is copied in: the container and the volume can go."""
        self.removals.container(self.volume)
        self.removals.volume(self.volume)

    def wait(self) -> float:
        """Wait until every staged layer is installed (seconds waited); a failure is one line."""
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)
        if self.done:
            return 0.0
        t0 = time.time()
        try:
            code = self.container.wait()["StatusCode"]
            logs = self.container.logs().decode(errors="replace")
        except docker.errors.APIError as e:   # removed behind our back, or the engine is gone
            raise UserError(f"{self.what}: the engine refused: {_explain(e)}") from None
        waited = time.time() - t0
        self.out.write(logs)
        if code != 0:
            raise UserError(f"{self.what} beside the first layer failed (exit {code}): {_last_line(logs)}")
        marks = layers.phase_marks(logs)
        names = {v: k for k, v in self.numbers.items()}
        phases = {}
        for n, t in layers.profile(marks).items():
            number, _, phase = n.partition("-")
            phases[f"{names[number]} {phase}" if phase else n] = t
        start = marks[0][1] - self.started if marks else 0.0
        self.out.write(f"{PROFILE} {json.dumps({'layer': 'staged', 'start': start, **phases})}\n")
        self.done = True
        return waited


BUILDER = "io.fleetbox.builder"   # the staging container's label: "<host> <pid> <its start>" of the build that
                                  # made it, so `clean --images` leaves a live build's stage alone


@contextlib.contextmanager
def _staged(c, image: str, staged: list, wheels: str, args: dict[str, str], out, removals: _Removals):
    """The container of `image` that installs the `staged` layers (layers.stage_script) onto a scratch volume
    while the first layer is made, not yet started; its CPU share the smallest, so it takes what that layer leaves. The
    container and then the volume are removed on every way out (`removals`)."""
    if not staged:
        yield None
        return
    stage = _Stage(c, image, f"{BUILD_PREFIX}stage-{secrets.token_hex(4)}",   # the container's and the volume's name
                   ["sh", "-c", layers.stage_script(args["PYTHON"], args["PIP_WHEEL"]), "sh",
                    *[x.requirements for x in staged]],
                   wheels, {x.name: str(i) for i, x in enumerate(staged, 1)}, out, removals)
    try:
        yield stage
    finally:
        stage.release()


def _builder() -> str:
    return f"{this_host()} {os.getpid()} {process_start(os.getpid())}"


def _building(labels: dict) -> bool:
    """A staging container's build still runs: its process here, with the same start; one on another machine
    cannot be asked, and is taken as running."""
    said = (labels.get(BUILDER) or "").split(" ")
    if len(said) != 3:   # not a staging container (or a label someone else wrote)
        return False
    host, pid, start = said
    if host != this_host():
        return True
    return pid.isdigit() and start.isdigit() and process_start(int(pid)) == int(start) != 0


def _explain(e) -> str:
    return (e.explanation or str(e)).strip()[:300]


def _last_line(logs: str) -> str:
    return ([ln for ln in logs.strip().splitlines() if not ln.startswith(layers.PHASE)] or ["?"])[-1][:300]


@contextlib.contextmanager
def _build_container(kind: str, what: str, removals: _Removals):
    """A name for one of the build's containers (no labels: commit would keep them): an engine refusal inside is
    one line that says `what`, and the container is removed on every way out, by its name, so also when Ctrl-C
    lands inside create (`removals`)."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    name = f"{BUILD_PREFIX}{kind}-{secrets.token_hex(4)}"
    try:
        yield name
    except docker.errors.APIError as e:   # full disk, image gone (a concurrent clean), engine restarted
        raise UserError(f"{what}: the engine refused: {_explain(e)}") from None
    finally:
        removals.container(name)


def _commit(ct, tag: str, change_list: list[str]):
    repo, name = tag.rsplit(":", 1)
    return ct.commit(repository=repo, tag=name, changes=change_list)


def _run_and_commit(c, parent: str, name: str, script: str, args: list[str], mounts: list, tag: str,
                    change_list: list[str], out, removals: _Removals, extra: dict | None = None, started=None):
    """One layer: a container of `parent` runs `script` (sh -c, with `args`), network off, with `mounts`; its
    changes become the layer, tagged only once whole. `started`: called once it runs (the staging container, the
    wheelhouse's check)."""
    with _build_container(name, f"layer {name}", removals) as cname:
        t0 = time.time()
        ct = c.containers.create(parent, ["sh", "-c", script, "sh", *args], name=cname, network_mode="none",
                                 mounts=mounts)
        ct.start()
        if started:
            started()
        code = ct.wait()["StatusCode"]
        t_ran = time.time()
        logs = ct.logs().decode(errors="replace")
        out.write(logs)
        if code != 0:
            raise UserError(f"layer {name} failed (exit {code}): {_last_line(logs)}")
        made = _commit(ct, tag, change_list)
        # where the layer's time went (bench/build.py reads it): the container's start (to its script's first
        # line), each phase of the script, its end, the commit
        marks = layers.phase_marks(logs)
        phases = layers.profile(marks)
        ran = t_ran - t0
        start = marks[0][1] - t0 if marks else 0.0
        rec = {"layer": name, **(extra or {}), "start": start, **phases,
               "end": max(0.0, ran - start - sum(phases.values())), "commit": time.time() - t_ran}
        out.write(f"{PROFILE} {json.dumps(rec)}\n")
        return made


def _settings(c, parent: str, tag: str, change_list: list[str], out, removals: _Removals):
    """The image: the settings (`change_list`) committed onto `parent`, the last layer, from a container of it
    that never runs, so no layer is added (a change of settings or labels alone makes no layer again)."""
    with _build_container("settings", "the image's settings", removals) as cname:
        t0 = time.time()
        made = _commit(c.containers.create(parent, name=cname, network_mode="none"), tag, change_list)
        # "image settings": no layer's name (a layer is named for a package)
        out.write(f"{PROFILE} {json.dumps({'layer': 'image settings', 'commit': time.time() - t0})}\n")
        return made


def _bake(c, p: BuildPlan, data_dir: Path, force: bool, log) -> None:
    """A thin image on top of the variant's: the verified data set files at Paddle's cache path."""
    existing = image_or_none(c, p.data_tag)
    if existing and not force:
        _alias(existing, p.data_aliases)
        log(f"{p.data_tag} is up to date; nothing to bake")
        return
    files = datasets.require(list(p.data), data_dir)
    rd = run_dir(f"build-{p.variant.name}-data")
    with tempfile.TemporaryDirectory(prefix="fleetbox-data-", dir=data_dir.parent) as tmp:
        ctx = Path(tmp)
        shutil.copy(DATA_DOCKERFILE, ctx / "Dockerfile")
        for f, path in zip([f for d in p.data for f in d.files], files):
            _link(path, ctx / "dataset" / f.relpath)
        log(f"baking {', '.join(d.name for d in p.data)} into {p.data_tag} (log: {rd / 'build.log'})")
        lbl = {**p.labels, "io.fleetbox.datasets": json.dumps(datasets.identity(list(p.data)))}
        engine.build(c, rd / "build.log", echo=log, path=str(ctx), tag=p.data_tag, buildargs={"IMAGE": p.tag},
                     labels=lbl, network_mode="none")
    _alias(c.images.get(p.data_tag), p.data_aliases)
    log(f"baked {p.data_tag}; aliases {', '.join(p.data_aliases)}")


def _tidy(c, replaced, image) -> None:
    """Drop an image a forced rebuild left without tags."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    if replaced is not None and replaced.id != image.id:
        try:
            if not c.images.get(replaced.id).tags:
                c.images.remove(replaced.id)
        except docker.errors.APIError:
            pass   # still used by a container: leave it


def prune(c, variants: list[Variant], log=print) -> tuple[int, int, int]:
    """`invoke clean --images`: untag what older builds left, returning (content tags, layer tags, leftover
    layer containers) removed. A content tag (<image>:<variant>-<hash>) goes when no alias of its variant
    points to its image and no other image is built on it (a data image baked on an older build); a layer tag
    (image/layers.py) goes when no image with another tag is built on it. "Built on" is read from the layers
    (RootFS), which every image store keeps. An image a container uses is kept; so is a running build's
    container, while the containers and scratch volumes of builds that were killed go."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)

    def snapshot() -> dict[str, tuple[list[str], list[str]]]:   # image ID -> (tags, layer digests)
        out = {}
        for row in c.api.images():
            try:
                out[row["Id"]] = ([t for t in row.get("RepoTags") or [] if not t.endswith(":<none>")],
                                  c.api.inspect_image(row["Id"])["RootFS"].get("Layers") or [])
            except docker.errors.NotFound:   # removed meanwhile
                pass
        return out

    def on(lower: list[str], upper: list[str], strictly: bool) -> bool:
        return upper[:len(lower)] == lower and (len(upper) > len(lower) or not strictly)

    def untag(tags: list[str]) -> int:
        n = 0
        for t in tags:
            try:
                c.images.remove(t)
                n += 1
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:   # a container uses it
                log(f"kept {t}: {(e.explanation or str(e)).strip()[:200]}")
        return n

    def layer(t: str) -> bool:
        return t.startswith(f"{layers.LAYERS_REPO}:")

    builds = [x for x in c.containers.list(all=True, filters={"name": BUILD_PREFIX}) if x.name.startswith(BUILD_PREFIX)]
    live = {x.name for x in builds if x.status == "running" or _building(x.labels)}
    stopped = [x for x in builds if x.name not in live]
    for x in stopped:
        try:
            x.remove(force=True)
        except docker.errors.APIError:   # being removed already
            pass
    for vol in c.volumes.list(filters={"name": BUILD_PREFIX}):   # a killed build's scratch volume
        if vol.name.startswith(BUILD_PREFIX) and vol.name not in live:
            try:
                vol.remove()   # not forced: a volume in use stays
            except docker.errors.APIError:
                pass
    images = snapshot()
    old: dict[str, str] = {}
    for v in variants:
        mine = re.compile(rf"{re.escape(v.image)}:{re.escape(v.name)}-[0-9a-f]{{12}}")
        current = {i for i, (tags, _) in images.items() if set(tags) & set(v.aliases)}
        old |= {t: i for i, (tags, _) in images.items() if i not in current for t in tags if mine.fullmatch(t)}
    others = [fs for tags, fs in images.values() if any(t not in old and not layer(t) for t in tags)]
    content = untag([t for t, i in old.items() if not any(on(images[i][1], fs, True) for fs in others)])
    images = snapshot()
    users = [fs for tags, fs in images.values() if any(not layer(t) for t in tags)]
    unused = [t for tags, fs in images.values() for t in tags
              if layer(t) and not any(on(fs, u, False) for u in users)]
    return content, untag(unused), len(stopped)


def _sbom(c, p: BuildPlan, entries, wheel_dir: Path) -> tuple[str, int, dict[str, str]]:
    """The image's SBOM (image/receipts.py), from the lock, the wheelhouse's wheels and the base's packages; how
    many Debian packages it names; the wheels ({file name: sha256})."""
    manifest = files.read_json(wheel_dir / wheelhouse.MANIFEST).get("files") or {}
    said = c.images.get(p.base_id).labels or {}
    debs = receipts.base_packages(c, p.base_id)
    return receipts.sbom(p.variant, p.content_hash, entries, manifest, debs, said.get("io.fleetbox.base.mirror", ""),
                         said.get("io.fleetbox.base.suite", ""), p.labels.get(LABEL_GPUS, "")), len(debs), manifest


def _sbom_in(wheel_dir: Path, text: str) -> bool:
    """The SBOM in the wheelhouse, written only where it differs; False where it cannot be written."""
    path = wheel_dir / settings.SBOM_IN_WHEELHOUSE
    try:
        if not path.is_file() or path.read_text() != text:
            files.write_atomic(path, text)
        return True
    except OSError:
        return False


def keep_receipts(c, p: BuildPlan, lock_text: str, entries, image, started, rd: Path | None, force: bool, log,
                  sbom: tuple[str, int, dict[str, str]]) -> None:
    """The image's SBOM and provenance statement (image/receipts.py), kept in receipts/ and the build's run folder.
    An image already built (`started` None: by an earlier build, another checkout, a kit) gets them from its
    inputs, which its content tag proves the same, and its own creation time."""
    v = p.variant
    sbom_text, debs, manifest = sbom
    created = datetime.datetime.fromisoformat(image.attrs["Created"][:19]).replace(tzinfo=datetime.UTC)
    statement = receipts.check_statement(receipts.provenance(
        image=p.tag, image_id=image.id, layers=image.attrs["RootFS"]["Layers"], variant=v, lock_sha256=p.lock_sha256,
        lock_path=str(v.lock_path.relative_to(ROOT)), base_ref=v.base_ref, base_id=p.base_id,
        dockerfile=dockerfile_text(v, lock_text, entries), sbom_text=sbom_text, wheels=manifest,
        engine=f"Docker Engine {c.version().get('Version', '?')}", started=started or created,
        finished=datetime.datetime.now(datetime.UTC) if started else created,
        invocation=rd.name if rd else f"existing-{image.id.removeprefix('sha256:')[:12]}", force=force))
    receipts.keep(p.labels[settings.LABEL_INPUTS], sbom_text, statement, image.id)
    if rd is not None:
        files.write_atomic(rd / "sbom.cdx.json", sbom_text)
        files.write_json(rd / "provenance.json", statement)
    log(f"receipts: SBOM of {len(entries)} Python and {debs} Debian packages, "
        f"provenance of {image.id[:19]}: {receipts.folder()}")


def _alias(image, aliases: list[str]) -> None:
    for alias in aliases:
        repo, tag = alias.rsplit(":", 1)
        image.tag(repo, tag)
