"""System bases (`invoke base`): an OS image plus the matrix's system packages, under an honest name.

Two ways to make one: from an OS image that is present or can be pulled (apt in a network-enabled build
step), or, for air-gapped sites and sites that cannot reach a registry, from distribution packages with
debootstrap + `docker import`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from fleetbox import ROOT, engine
from fleetbox.data import fetch
from fleetbox.engine import image_or_none, run_dir
from fleetbox.errors import UserError
from fleetbox.image.matrix import Base, Variant

BASE_DOCKERFILE = ROOT / "images" / "base.Dockerfile"
IMPORT_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["bash"]',
]


# A mirror URL reaches a `sed` in base.Dockerfile and argv of debootstrap: nothing sed or a shell reads specially.
_MIRROR_CHARS = re.compile(r"[A-Za-z0-9._~:/@%+-]+")


def check_mirror(url: str) -> tuple[str, str]:
    """(public, download): the mirror without and with its user info. Only `public` may be recorded (labels,
    build args, the image's apt sources); `download` is for debootstrap's download alone."""
    shown = fetch.shown(url)   # never echo credentials, not even in an error
    bad = f"mirror {shown!r} is not usable: "
    if not _MIRROR_CHARS.fullmatch(url):
        raise UserError(bad + "it may hold only letters, digits and . _ ~ : / @ % + - (percent-encode the rest)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UserError(bad + "want an http:// or https:// URL")
    try:
        parts.port   # raises on a port that is not a number
    except ValueError:
        raise UserError(bad + "its port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise UserError(bad + "it names no host (want http://HOST/PATH)")
    public = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return public, (url if parts.username or parts.password else public)


@dataclass(frozen=True)
class BasePlan:
    ref: str
    method: str          # "os-image" | "debootstrap" | "vendor"
    base: Base
    mirror: str          # without user info: the one that is recorded
    download_mirror: str = field(repr=False)   # may hold credentials: for debootstrap's download only

    def describe(self) -> list[str]:
        b = self.base
        lines = [f"base      {self.ref}  ({b.description})", f"method    {self.method}"]
        if self.method == "debootstrap":
            lines.append("command   " + " ".join(debootstrap_argv(b, Path("ROOTFS"), self.mirror))
                         + f" && tar -C ROOTFS -c . | docker import - {self.ref}")
            if self.download_mirror != self.mirror:
                lines.append("          (the credentials in --mirror are used for the download only)")
        elif self.method == "os-image":
            lines.append(f"from      {b.os_image} + apt-get install {' '.join(b.packages)}")
        else:
            lines.append(f"from      {b.os_image} (vendor image, tagged as is)")
        return lines


def plan(variant: Variant, bootstrap: bool = False, mirror: str | None = None, os_image_available=None) -> BasePlan:
    """Choose how to make the base. `os_image_available` is a callable (ref -> bool); None means unknown."""
    b = variant.base
    public, download = check_mirror(mirror or b.mirror) if (mirror or b.mirror) else ("", "")
    if bootstrap and not b.bootstrappable:
        raise UserError(f"base {b.name} ({b.distro}) cannot be bootstrapped with debootstrap; "
                        f"`docker load` the vendor image {b.os_image}")
    if not b.packages:
        return BasePlan(variant.base_ref, "vendor", b, public, download)
    if bootstrap or (os_image_available is not None and not os_image_available(b.os_image) and b.bootstrappable):
        return BasePlan(variant.base_ref, "debootstrap", b, public, download)
    if download != public:   # a build arg that reaches a RUN is kept in the image's history
        raise UserError("mirror credentials can be used only with --bootstrap (a docker build would keep them "
                        "in the image history)")
    return BasePlan(variant.base_ref, "os-image", b, public, download)


def debootstrap_argv(b: Base, rootfs: Path, mirror: str) -> list[str]:
    return ["debootstrap", "--variant=minbase", f"--include={','.join(b.packages)}", b.suite, str(rootfs), mirror]


def labels(p: BasePlan) -> dict[str, str]:
    return {"io.fleetbox.base": p.base.name, "io.fleetbox.base.method": p.method,
            "io.fleetbox.base.packages": " ".join(p.base.packages), "io.fleetbox.base.suite": p.base.suite,
            "io.fleetbox.base.mirror": p.mirror, "io.fleetbox.base.os-image": p.base.os_image}


def _can_have(c, ref: str, log) -> bool:
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)

    if image_or_none(c, ref):
        return True
    log(f"OS image {ref} is not here; trying to pull it")
    try:
        c.images.pull(ref)
        return True
    except docker.errors.APIError as e:
        log(f"cannot pull {ref}: {str(e).splitlines()[0][:160]}")
        return False


def ensure(c, variant: Variant, bootstrap: bool = False, mirror: str | None = None, rebuild: bool = False,
           log=print) -> str:
    """Make the variant's base unless it exists; returns its image ID."""
    if mirror:
        check_mirror(mirror)   # a bad --mirror is refused whether or not the base has to be made
    ref = variant.base_ref
    have = image_or_none(c, ref)
    if have and not rebuild:
        log(f"base {ref} exists ({have.id[7:19]}); reused")
        return have.id
    b = variant.base
    if not b.packages:   # a vendor image: it must be here or pullable, nothing to install
        if not _can_have(c, b.os_image, log):
            raise UserError(f"base image {b.os_image} is missing and {b.distro} cannot be bootstrapped: "
                            f"`docker load` it from the vendor's archive (or pull it where the registry is reachable)")
        c.images.get(b.os_image).tag(*ref.split(":"))
        return c.images.get(ref).id
    p = plan(variant, bootstrap, mirror, os_image_available=None if bootstrap else lambda r: _can_have(c, r, log))
    if p.method == "os-image" and not image_or_none(c, b.os_image):
        raise UserError(f"OS image {b.os_image} is missing and base {b.name} cannot be bootstrapped")
    for line in p.describe():
        log(line)
    rd = run_dir(f"base-{variant.base.name}")
    if p.method == "debootstrap":
        image_id = _bootstrap(c, p, rd / "base.log", log)
    else:
        image_id = _from_os_image(c, p, rd / "base.log", log)
    log(f"base {ref} ready ({image_id[7:19]}); log: {rd / 'base.log'}")
    return image_id


def build_args(p: BasePlan) -> dict[str, str]:
    """base.Dockerfile's args: the image history keeps them, so the mirror is the one without credentials."""
    return {"OS_IMAGE": p.base.os_image, "PACKAGES": " ".join(p.base.packages), "MIRROR": p.mirror}


def _from_os_image(c, p: BasePlan, log_file: Path, log) -> str:
    args = build_args(p)
    with tempfile.TemporaryDirectory(prefix="fleetbox-base-") as ctx:
        shutil.copy(BASE_DOCKERFILE, Path(ctx) / "Dockerfile")
        return engine.build(c, log_file, echo=log, path=ctx, tag=p.ref, buildargs=args, labels=labels(p))


def _bootstrap(c, p: BasePlan, log_file: Path, log) -> str:
    if os.geteuid() != 0:
        raise UserError("bootstrapping a base needs root (debootstrap makes device nodes and chroots)")
    if not shutil.which("debootstrap"):
        raise UserError("debootstrap not found: `apt-get install -y debootstrap` (or load an OS image)")
    with tempfile.TemporaryDirectory(prefix="fleetbox-rootfs-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = debootstrap_argv(p.base, rootfs, p.download_mirror)
        shown = debootstrap_argv(p.base, rootfs, p.mirror)
        log(f"running {' '.join(shown)} (about a minute; output in {log_file})")
        with open(log_file, "a") as lf:
            proc = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = log_file.read_text().strip().splitlines()[-1:] or [""]
            tail = tail[0].replace(p.download_mirror, p.mirror)
            raise UserError(f"debootstrap failed (exit {proc.returncode}): {tail[:200]} (log: {log_file})")
        _trim(rootfs, p.mirror, p.base.suite)
        log("importing the root filesystem into Docker")
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        changes = IMPORT_CHANGES + [f'LABEL {k}="{v}"' for k, v in labels(p).items()]
        repo, tag = p.ref.split(":")
        try:
            c.api.import_image(src=tar.stdout, repository=repo, tag=tag, changes=changes, stream_src=True)
        finally:
            tar.stdout.close()
            tar.wait()
        if tar.returncode != 0:
            raise UserError(f"tar of {rootfs} failed (exit {tar.returncode})")
    return c.images.get(p.ref).id


def _trim(rootfs: Path, mirror: str, suite: str) -> None:
    """Drop what only the bootstrap needed (downloaded .debs, package lists) and point apt at the mirror
    (`mirror` is the one without credentials: debootstrap wrote the download URL into sources.list, and
    its log, moved to var/log/bootstrap.log, holds the download URLs)."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = rootfs / sub
        for f in d.glob("*"):
            if f.is_file():
                f.unlink()
    (rootfs / "var/log/bootstrap.log").unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list").write_text(f"deb {mirror} {suite} main\n")
