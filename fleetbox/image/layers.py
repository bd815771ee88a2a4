"""The image's environment in layers, by how often things change and by size (pure).

Paddle and its dependency closure first (with the tools, pip and setuptools, which change as rarely), then
each package installed without its dependencies (VisualDL's writer, which changes as rarely), then each big
extra (scipy, opencv) in a layer of its own, then the small rest. The last layer also writes pip's
freeze of the environment and makes the folders fleetbox binds onto; the image's settings (environment,
labels) are then committed onto it without a layer. Changing one extra's pin changes its layer and the ones
after it; the Paddle layer keeps its digest.

Each layer is made by running the previous one (the base, first) with the wheelhouse bind-mounted read-only
at /mnt and the network off, installing that layer's locked wheels with pip (hashes required, no
dependencies resolved: the lock is complete), and committing the container: the wheels are never copied into
any layer, and nothing is sent to the engine as build context.

`invoke build` makes the layers after the first it builds faster, with the same bytes: while the first runs
and is committed, one container beside it installs those layers' wheels (their files depend on no earlier
layer: the lock is complete and nothing is resolved) each into a folder of its own on a scratch volume, and
each such layer is then a container of the one before that copies its folder in. The engine's commit, which
copies every file of a layer again, no longer waits for pip, and pip no longer waits for it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from packaging.utils import canonicalize_name

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.image import locks
from fleetbox.image.matrix import Variant
from fleetbox.settings import FREEZE, SBOM, SBOM_IN_WHEELHOUSE, VENV  # the images' environment, its freeze and SBOM

WHEELS = "/mnt"   # the wheelhouse's mount point: a folder every base has, so no layer records a new one
MOUNT = f"type=bind,dst={WHEELS},readonly"   # how the wheelhouse reaches a layer's container (no VOLUME)
CMD = 'CMD ["python"]'   # every layer's image's command and the image's, as commit and a Dockerfile take it


@dataclass(frozen=True)
class Layer:
    name: str
    entries: tuple[locks.Locked, ...]
    script: str       # our own shell fragment (raw); the requirements arrive as "$1"
    key: str          # digest of everything the layer is made from, its parent's key included
    last: bool = False   # also writes the freeze file, the SBOM and the bind-mount targets (_finish); the settings
                         # are committed onto it

    @property
    def requirements(self) -> str:
        return requirements(self.entries)


def requirements(entries) -> str:
    """Locked entries as a pip requirements file, every allowed hash named (pip's --require-hashes)."""
    return "".join(f"{e.name}=={e.version} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes) + "\n"
                   for e in entries)


def needs(lock_text: str) -> dict[str, set[str]]:
    """Each locked package's direct dependencies, from the lock's `# via` notes (X via Y: Y needs X)."""
    via: dict[str, set[str]] = {}
    cur, listing = None, False
    for line in lock_text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if m:
            cur, listing = canonicalize_name(m.group(1)), False
            via[cur] = set()
            continue
        s = line.strip()
        if cur and s.startswith("# via"):
            rest = s[len("# via"):].strip()
            listing = not rest
            if rest:
                via[cur].add(canonicalize_name(rest.split()[0]))
        elif cur and listing and s.startswith("#   "):
            via[cur].add(canonicalize_name(s[4:].split()[0]))
        elif not s.startswith("#"):
            listing = False
    return {n: {x for x, ys in via.items() if n in ys} for n in via}


def closure(root: str, deps: dict[str, set[str]]) -> set[str]:
    out, todo = set(), [canonicalize_name(root)]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += deps.get(n, ())
    return out


def requirement_name(spec: str) -> str:
    return canonicalize_name(re.split(r"[=<>!~\[; ]", spec, maxsplit=1)[0])


LIBRARIES = "libraries"   # the layer of the GPU libraries Paddle opens by name (variant.libraries), below Paddle's:
                         # a Paddle bump reuses it


def groups(variant: Variant, lock_text: str) -> list[tuple[str, set[str]]]:
    """(layer name, package names) in order; empty groups left out."""
    deps = needs(lock_text)
    libraries = set().union(*(closure(requirement_name(x), deps) for x in variant.libraries))
    first = closure(variant.paddle_name, deps) - libraries | {requirement_name(t) for t in variant.tools}
    out, taken = [(LIBRARIES, libraries), ("paddle", first)], libraries | first
    for extra in [*variant.no_deps, *variant.extras]:   # no_deps (VisualDL's writer) change least: first
        mine = closure(requirement_name(extra), deps) & set(deps) - taken   # only what the lock holds
        out.append((requirement_name(extra), mine))
        taken |= mine
    out.append(("rest", set(deps) - taken))
    return [(name, names) for name, names in out if names]


EPOCH = 315532800   # 1980-01-01: every file a layer adds or changes gets this time, so a layer made again
                    # from the same inputs is byte-identical (same digest: nothing to push or pull again)


def _settle(paths: tuple[str, ...] = ()) -> str:
    """Ours (raw): give every path this layer added or changed the fixed time, so its tar does not depend on
    when it was made (paths of earlier layers are left alone: touching one would copy it into this layer).
    `paths`: only these (none of them searched below), where the script names every path it writes."""
    where = (f"{' '.join(paths)} -maxdepth 0" if paths else
             f"/ -xdev \\( -path /proc -o -path /sys -o -path /dev -o -path {WHEELS} \\) -prune -o")
    return f"find {where} -newermt \"@$t0\" -exec touch -h -d @{EPOCH} {{}} +"


PHASE = "fleetbox-phase"   # a layer's output line: a phase of its script ended (name, time): the build's profile


def _phase(name: str) -> str:
    """Ours (raw): say that a phase ended, in the layer's output (build.log), not in the layer."""
    return f'echo "{PHASE} {name} $(date +%s.%N)"'


# file times come from a coarser clock than date's: t0 is 50 ms before the start, so nothing the script makes is
# older than t0 (and nothing the image had is that new: its files have the fixed time or older ones)
_START = f"set -e; t0=$(date -d '-0.05 seconds' +%s.%N); {_phase('start')}; "
NEW = "/dev/shm/fleetbox-new"   # the .py files a layer added (outside any layer)


def _pip(pip_wheel: str, root: str = "") -> str:
    """Ours (raw): pip from its own locked wheel installs the requirements on stdin, into `root` if given. Its
    temporary files go to /dev/shm: in /tmp they would put /tmp, with a new time, into the layer. -B (here, in
    compileall and in pip freeze): Python writes no .pyc of what it imports, which a base without its standard
    library's .pyc files would get in a layer installed in place and not in a staged one."""
    into = f"--root {root} " if root else ""
    return (f"TMPDIR=/dev/shm {VENV}/bin/python -B {shlex.quote(f'{WHEELS}/{pip_wheel}/pip')} install {into}"
            f"--no-index --no-cache-dir --find-links {WHEELS} --require-hashes --only-binary :all: --no-deps "
            f"--no-compile --disable-pip-version-check --quiet -r /dev/stdin")


def _compile(names: str = "") -> str:
    """Ours (raw): byte-compile the files listed in NEW on every core, after giving them the fixed time, which a
    .pyc records (PYTHONHASHSEED fixed: before 3.11 a frozenset is written in hash order); `names`: compileall's
    options for the name a .pyc records, when the files are not where they will be. -f: a file this layer
    wrote over one an earlier layer compiled gets its own .pyc (its time is the same fixed one). Four lists per
    core (not one Python per 200 files: each starts in about 50 ms). A file that does not compile (some wheels
    ship Python 2 examples) is skipped, as pip skips it (compileall exits 1); any other failure of compileall
    (255 stops xargs: 124) stops the layer."""
    return (f"xargs -0 -r touch -h -d @{EPOCH} < {NEW}; p=$(nproc); "
            f"n=$(( $(tr -cd '\\0' < {NEW} | wc -c) / (4 * p) + 1 )); "
            f"xargs -0 -r -P \"$p\" -n \"$n\" sh -c 'PYTHONHASHSEED=0 {VENV}/bin/python -B -m compileall -q -f \"$@\" "
            f"|| [ $? -eq 1 ] || exit 255' sh {names}< {NEW} > /dev/null || [ $? -eq 123 ]")




def _finish() -> str:
    """Ours (raw), the last layer's: pip's freeze of the environment, the image's SBOM from the wheelhouse (where
    `invoke build` put it; a wheelhouse without one, as `invoke wheels` makes it, gives an image without), and the
    folders fleetbox binds onto. It writes nothing else (-B), so a staged last layer settles only those paths
    (_finished; the SBOM, which may not be there, at once)."""
    sbom = f"{WHEELS}/{SBOM_IN_WHEELHOUSE}"
    return (f"TMPDIR=/dev/shm {VENV}/bin/python -B -m pip freeze --all --disable-pip-version-check "
            f"> {FREEZE}; if [ -e {sbom} ]; then install -m 0644 {sbom} {SBOM}; touch -h -d @{EPOCH} {SBOM}; fi; "
            f"mkdir -p {' '.join(settings.BIND_TARGETS)}; {_phase('freeze')}; ")


def _finished() -> tuple[str, ...]:
    """What _finish may change: its files and the folders above them (settled by name, not by a search)."""
    return tuple(sorted({str(a) for p in map(PurePosixPath, (FREEZE, *settings.BIND_TARGETS))
                         for a in (p, *p.parents)}))


LIBRARY_NAMES = "/etc/ld.so.conf.d/fleetbox-gpu-libraries.conf"   # the folders of variant.libraries, one a line


def link_library_names(venv: str, listing: str) -> str:
    """Ours (raw), `venv` and `listing` shell words: Paddle opens its GPU libraries by unversioned name
    (libcudnn.so), which NVIDIA's wheels do not ship (libcudnn.so.8). Each library file in the venv's nvidia/*/lib
    folders gets that name beside it (a name already there is kept); the folders are written to `listing`, one a
    line. The image's libraries layer and `invoke venv` both name them so."""
    return (f"for d in {venv}/lib/python3*/site-packages/nvidia/*/lib; do [ -d \"$d\" ] || continue; echo \"$d\"; "
            f"for f in \"$d\"/lib*.so.*; do [ -e \"$f\" ] || continue; n=\"${{f%%.so.*}}.so\"; "
            f"[ -e \"$n\" ] || ln -s \"${{f##*/}}\" \"$n\"; done; done > {listing}; ")


def _name_libraries() -> str:
    """Ours (raw), the libraries layer's: the unversioned names (link_library_names), every folder named to the
    dynamic loader, and its cache made again (it holds the unversioned names too), so a name loads in any
    runtime, whatever environment it passes. The loader's auxiliary cache (inodes and times) is put back as the
    base had it, or the layer would differ from build to build; none is kept where it had none. No library
    folder at all stops the layer."""
    aux = "/var/cache/ldconfig/aux-cache"
    return (f"{link_library_names(VENV, LIBRARY_NAMES)}"
            f"[ -s {LIBRARY_NAMES} ] || {{ echo 'fleetbox: no nvidia/*/lib folder in the libraries layer' >&2; "
            f"exit 1; }}; if [ -e {aux} ]; then cp -p {aux} /dev/shm/fleetbox-aux; ldconfig; "
            f"cp -p /dev/shm/fleetbox-aux {aux}; else ldconfig; rm -f {aux}; fi; {_phase('names')}; ")


def install_script(python: str, pip_wheel: str, first: bool, last: bool = False, libraries: bool = False) -> str:
    """The shell one layer runs (ours, raw): make the venv in the first, then pip from its own wheel; then
    byte-compile the .py files this layer added (then, in the last, _finish); then every path it added or
    changed gets the fixed time.
    pip's files are written to disk while compileall runs (sync -f, in the background): the container's end
    (the engine unmounting it) syncs the whole file system, and waited for all of them (0.45 s of Paddle's
    layer; flushing during the engine's commit instead slowed it)."""
    venv = f"{shlex.quote(python)} -m venv --without-pip {VENV}; " if first else ""
    return (f"{_START}{venv}printf '%s' \"$1\" | {_pip(pip_wheel)}; {_phase('pip')}; sync -f / & "
            f"find {VENV}/lib -newermt \"@$t0\" -name '*.py' -print0 > {NEW}; {_compile()}; "
            f"{_phase('compileall')}; {_name_libraries() if libraries else ''}{_finish() if last else ''}{_settle()}; "
            f"wait; {_phase('fixed-times')}")


STAGE = "/dev/fleetbox-stage"   # the scratch volume's mount point: under /dev, which no layer records


def stage_script(python: str, pip_wheel: str) -> str:
    """Ours (raw): the layers to stage, each given as one argument (its requirements), installed as
    install_script would, each into STAGE/<its number> (1, 2, ...) rather than /: the same files, .pyc files
    naming where they will be, every path with the fixed time. A venv is made where the image has none (the
    files do not depend on it, but pip runs in it). Where a Python puts compiled modules under lib64 (venv's
    lib64 is a link to lib, so in place they land in lib), the staged lib64 is compiled too."""
    d = f"{STAGE}/$i"
    return (f"set -e; {_phase('start')}; [ -x {VENV}/bin/python ] || {shlex.quote(python)} -m venv --without-pip "
            f"{VENV}; i=0; for reqs in \"$@\"; do i=$((i + 1)); "
            f"printf '%s' \"$reqs\" | {_pip(pip_wheel, d)}; {_phase('$i-pip')}; "
            f"find {d} \\( -path \"{d}{VENV}/lib/*\" -o -path \"{d}{VENV}/lib64/*\" \\) -name '*.py' -print0 "
            f"> {NEW}; {_compile(f'-s {d} -p / ')}; "
            f"find {d} -exec touch -h -d @{EPOCH} {{}} +; {_phase('$i-compileall')}; done")


ROOTS = "/dev/shm/fleetbox-roots"


def copy_script(last: bool) -> str:
    """Ours (raw): copy staged layer number "$1" in as installing it there would have: what it adds (a path not
    there yet, or a file), each copied whole with cp -a (its modes, owner and fixed times), into the folders
    the image has, whose mode and owner stay theirs; a folder that gets a new entry gets the fixed time, as the
    settle after installing gives it. The last layer then runs _finish, as installing it would, while the
    stage is emptied (the volume mounted writable for it): removing the volume after the build was 0.3 s. A
    removal that fails fails the layer (wait on each one's status), so a stage mounted read-only is noticed."""
    empty = finish = ""
    if last:
        empty = f"find {STAGE} -mindepth 1 -maxdepth 1 ! -name \"$1\" -exec rm -rf {{}} + & earlier=$!; "
        finish = (f"; cd /; rm -rf \"{STAGE}/$1\" & own=$!; {_finish()}{_settle(_finished())}; wait $earlier; "
                  f"wait $own; {_phase('fixed-times')}")
    return (f"{_START}{empty}cd \"{STAGE}/$1\"; "
            f"find . -mindepth 1 \\( -type d -exec test -d '/{{}}' \\; \\) -o -print0 -prune > {ROOTS}; "
            f"xargs -0 -r -I{{}} cp -a {{}} '/{{}}' < {ROOTS}; "
            f"sed -z 's|/[^/]*$||' {ROOTS} | sort -zu | xargs -0 -r -I{{}} touch -h -d @{EPOCH} '/{{}}'; "
            f"{_phase('copy')}{finish}")


def plan(variant: Variant, lock_text: str, entries: list[locks.Locked], base_id: str, python: str,
         pip_wheel: str) -> list[Layer]:
    """Every layer with its key: a layer is reused when an image with its key exists."""
    by = {canonicalize_name(e.name): e for e in entries}
    chosen = [(name, tuple(by[n] for n in sorted(names) if n in by)) for name, names in groups(variant, lock_text)]
    chosen = [(name, pins) for name, pins in chosen if pins]   # a name the lock lacks: nothing to install
    parent, out = base_id, []
    for i, (name, pins) in enumerate(chosen):
        last = i == len(chosen) - 1
        script = install_script(python, pip_wheel, first=not out, last=last, libraries=name == LIBRARIES)
        key = _digest(parent, name, script, MOUNT, [(e.name, e.version, e.hashes) for e in pins])
        out.append(Layer(name, pins, script, key, last))
        parent = key
    return out


def keyed_by_inputs(split: list[Layer], inputs: str) -> list[Layer]:
    """The layers with the last one keyed by the image's inputs too (its content hash): it copies in the SBOM,
    which they make (image/receipts.py)."""
    if not split:
        return split
    last = split[-1]
    return [*split[:-1], Layer(last.name, last.entries, last.script, _digest(last.key, inputs), last.last)]


def _digest(*values) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=list).encode()).hexdigest()


LAYERS_REPO = "fleetbox/layers"   # local tags of the layers, by content: variants and images that share a layer's
                                  # inputs (base, packages, script) share the layer


def layer_tag(layer: Layer) -> str:
    return f"{LAYERS_REPO}:{layer.name}-{layer.key[:12]}"


def image_env(variant: Variant, path: str) -> dict[str, str]:
    """The image's environment, on the base's PATH."""
    return {"VIRTUAL_ENV": VENV, "PATH": f"{VENV}/bin:{path}", "PYTHONUNBUFFERED": "1", "PIP_NO_INDEX": "1",
            "FLEETBOX_VARIANT": variant.name, "FLEETBOX_DEVICE": variant.device}


def changes(variant: Variant, base_env: list[str], labels: dict[str, str]) -> list[str]:
    """The image's settings, as `docker commit --change` instructions. Commit reads them as a Dockerfile
    would: a value is double-quoted, with `$` escaped (no variable is expanded) and non-ASCII kept as is."""
    path = next((e.split("=", 1)[1] for e in base_env if e.startswith("PATH=")),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return ([f"ENV {k}={_quoted(v)}" for k, v in image_env(variant, path).items()]
            + [f"WORKDIR {settings.WORKDIR}", CMD]
            + [f"LABEL {_quoted(k)}={_quoted(v)}" for k, v in sorted(labels.items())])


def _quoted(value: str) -> str:
    return json.dumps(value, ensure_ascii=False).replace("$", "\\$")


def by_hand(variant: Variant, layers: list[Layer], base_id: str, wheelhouse: str, final_tag: str,
            change_list: list[str]) -> str:
    """The same build as a shell script a user can run (every value quoted). WHEELHOUSE, LAYERS (the layers'
    repository) and IMAGE (the final tag) may be set in the environment, to build beside ours. Each layer runs
    from the image ID the one before gave, as `invoke build` does; the image's settings are committed onto the
    last from a container that never runs (no layer)."""
    if any(ch in wheelhouse for ch in '"\n'):
        raise UserError(f"the wheelhouse path {wheelhouse!r} holds a double quote or a newline, which "
                        "docker's --mount cannot take; move it (FLEETBOX_WHEELHOUSE)")
    q = shlex.quote
    lines = ["#!/bin/sh", f"# {variant.name}: the environment in {len(layers)} layers, as `invoke build` makes it.",
             "set -e", f"WHEELHOUSE=${{WHEELHOUSE:-{q(wheelhouse)}}}", f"LAYERS=${{LAYERS:-{q(LAYERS_REPO)}}}",
             f"IMAGE=${{IMAGE:-{q(final_tag)}}}", f"FROM={q(base_id)}   # the base, {variant.base_ref}",
             "CT=", "trap '[ -z \"$CT\" ] || docker rm -f \"$CT\" >/dev/null 2>&1' EXIT"]
    for layer in layers:
        then = "; then the freeze file, the SBOM and the bind-mount targets" if layer.last else ""
        lines += [f"# layer {layer.name}: {', '.join(e.name for e in layer.entries)}{then}",
                  f"CT={q(f'fleetbox-layer-{layer.name}-')}$$",
                  f"docker run --name \"$CT\" --network none --mount \"{MOUNT},\\\"src=$WHEELHOUSE\\\"\" \"$FROM\" "
                  f"sh -c {q(layer.script)} sh {q(layer.requirements)}",
                  f"FROM=$(docker commit --change {q(CMD)} \"$CT\" \"$LAYERS\":{q(layer_tag(layer).split(':', 1)[1])})",
                  'docker rm "$CT" > /dev/null', "CT="]
    lines += ["# the image's settings, committed onto the last layer from a container that never runs: no layer",
              "CT=fleetbox-layer-settings-$$", 'docker create --name "$CT" --network none "$FROM" > /dev/null',
              "docker commit " + " ".join(f"--change {q(c)}" for c in change_list) + ' "$CT" "$IMAGE" > /dev/null',
              'docker rm "$CT" > /dev/null', "CT="]
    return "\n".join(lines) + "\n"


def dockerfile(variant: Variant, split: list[Layer], labels: dict[str, str], from_args: dict[str, str],
               lock_name: str) -> str:
    """The same build as a Dockerfile any OCI builder takes (BuildKit, buildah/podman): one RUN per layer, each
    running the layer's own script under /bin/sh, as `invoke build` does, with its requirements (pins and
    hashes) inline and the wheelhouse bind-mounted from a build context named `wheelhouse`. `labels` are written
    as they are, but those in `from_args` ({label: build arg}), which differ by machine or commit and come in as
    build arguments, declared after the RUNs (an argument a RUN sees is part of that layer's cache key)."""
    q = shlex.quote
    name = variant.name
    head = [
        f"# fleetbox {name}: {' '.join(variant.description.split())}",
        f"# Rendered from images/matrix.toml and images/locks/{lock_name} by `invoke build --variant {name}",
        "# --dockerfile`: render it again rather than edit it. The same layers as `invoke build` makes: each RUN",
        "# installs one layer's locked wheels with pip from its own locked wheel (no index, hashes required), the",
        f"# wheelhouse bind-mounted read-only at {WHEELS} (never copied into a layer), the network off; then every",
        "# path the layer added gets a fixed time and is byte-compiled, so a layer made again is the same bytes.",
        "# Build it (the base image present; README.md, \"Building without fleetbox\"), the context an empty folder:",
        "#   podman build --format docker --network none --pull=never \\",
        f"#     --build-context wheelhouse=wheelhouse/{name} --build-arg REVISION=$(git rev-parse HEAD) \\",
        f"#     -f images/{name}.Dockerfile -t {variant.aliases[0]} \"$(mktemp -d)\"",
        "#   docker buildx build (BuildKit, Docker 23 or later) takes the same arguments but --format and --pull",
        f"# The last layer copies in the image's SBOM, the wheelhouse's {SBOM_IN_WHEELHOUSE}, which `invoke build`",
        "# writes there (its inputs alone make it: the same file on every machine); a wheelhouse without one gives an",
        "# image without.",
        f"ARG BASE_IMAGE={variant.base_ref}",
        "FROM ${BASE_IMAGE}",
    ]
    body = []
    for layer in split:
        what = f"{len(layer.entries)} locked package(s)" + \
            ("; then pip's freeze of the environment, the image's SBOM, the folders fleetbox binds onto"
             if layer.last else "")
        # one RUN per layer on purpose (DL3059: each is a layer, shared with invoke build's); /bin/sh as invoke
        # build runs it, no SHELL (DL4006): a SHELL would stay in the image's settings for every build FROM it
        body += [f"# layer {layer.name}: {what}", "# hadolint ignore=DL3059,DL4006"]
        reqs = [q(r) for r in layer.requirements.splitlines()]
        body += [f"RUN --mount=type=bind,from=wheelhouse,target={WHEELS} \\",
                 "    set -- \"$(printf '%s\\n' \\",
                 *[f"      {r} \\" for r in reqs],
                 "    )\"; \\",
                 f"    {layer.script}"]
    env = [f"{k}=" + ('"' + v + '"' if k == "PATH" else _quoted(v))   # ${PATH}: the base's, as commit takes it
           for k, v in image_env(variant, "${PATH}").items()]
    lbl = [f"{_quoted(k)}=" + (f'"${{{from_args[k]}}}"' if k in from_args else _quoted(v))
           for k, v in sorted(labels.items())]
    tail = ["# the image's settings; what differs by machine or commit comes in as build arguments",
            "ARG BASE_IMAGE", *[f"ARG {a}=unknown" for a in sorted(set(from_args.values()) - {"BASE_IMAGE"})],
            "ENV " + " \\\n    ".join(env), f"WORKDIR {settings.WORKDIR}", CMD,
            "LABEL " + " \\\n      ".join(lbl)]
    return "\n".join(head + body + tail) + "\n"


def phase_marks(output: str) -> list[tuple[str, float]]:
    """(phase, when it ended) of every phase line in a layer's output, in order (the first: its start)."""
    return [(name, float(t)) for name, t in re.findall(rf"^{PHASE} (\S+) ([\d.]+)$", output, re.M)]


def profile(marks: list[tuple[str, float]]) -> dict[str, float]:
    """{phase: seconds} of one layer's run, from its phase marks."""
    return {name: t - before for (_, before), (name, t) in zip(marks, marks[1:])}
