"""An image's receipts, in the forms a site's security team and its scanners read: a CycloneDX SBOM of what is in
it, and an in-toto statement with SLSA provenance of how it was built.

The SBOM is of the build's inputs, so it is the same bytes wherever the same lock and base are built (its serial
number and time are fixed, named by the content hash): every Python package of the lock with its version, the sha256
of the wheel the wheelhouse holds and the index it came from (the GPU libraries a variant installs beside Paddle
marked as such, Paddle's kernels' GPU architectures on Paddle); every Debian package of the base as its dpkg database
lists it, with the mirror. The statement names the image by its ID (the digest of its config) and gives what
it was made from (the lock's, the base's, the rendered Dockerfile's and the SBOM's digests, every wheel's), with
the engine, fleetbox's version and the layers' digests.

`invoke build` puts the SBOM in the image's last layer and keeps both in receipts/ (the SBOM by the inputs' digest,
the image's label; the statement by the image built); export writes them beside every export, and verify holds
the image to them.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from fleetbox import files, settings
from fleetbox.errors import UserError
from fleetbox.image.matrix import Variant
from fleetbox.processes import signals_held

if TYPE_CHECKING:   # exports read receipts, and run/ reads exports: no lock reading (requests) loaded there
    from fleetbox.image import locks

SBOM_SUFFIX = ".sbom.json"            # beside an export: <export>.sbom.json
PROVENANCE_SUFFIX = ".provenance.json"
SIGNATURE_SUFFIX = ".sig"             # a statement's SSH signature, beside it (ssh-keygen -Y sign's own name)
NAMESPACE = "fleetbox-provenance"     # what an SSH signature of ours is for: it verifies for nothing else
STATEMENT = "https://in-toto.io/Statement/v1"
SLSA = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:fleetbox:image-build:v1"   # what externalParameters and resolvedDependencies mean (docs: receipts)
BUILDER = "urn:fleetbox:invoke-build"
DPKG_STATUS = "/var/lib/dpkg/status"
FIXED_TIME = datetime.datetime(1980, 1, 1, tzinfo=datetime.UTC)   # the layers' fixed file time (layers.EPOCH)
PYPI = "https://pypi.org/simple"
FORMAT = 1   # what an SBOM holds: one more at each change, so an image holding an older one is a new image


@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    arch: str
    source: str = ""


def debian_packages(status: str) -> list[Deb]:
    """The installed packages of a dpkg status database (deb822 stanzas), by name."""
    out = []
    for stanza in status.split("\n\n"):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:   # a continuation line
                continue
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            out.append(Deb(fields["Package"], fields.get("Version", ""), fields.get("Architecture", ""),
                           fields.get("Source", "").split(" ")[0]))
    return sorted(out, key=lambda d: (d.name, d.arch))


def image_file(c, image_id: str, path: str) -> bytes | None:
    """A file of an image, read out of a container that never runs (made and removed with signals held, labelled
    for `invoke clean` should this process be killed between); None where the image has none."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)

    with signals_held():
        box = c.containers.create(image_id, command=["true"], network_disabled=True,
                                  labels={settings.LABEL_ROLE: "receipts"})
    try:
        bits, _ = box.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            member = tar.next()
            return tar.extractfile(member).read() if member is not None and member.isfile() else None
    except docker.errors.NotFound:
        return None
    finally:
        with signals_held():
            box.remove(force=True)


def base_packages(c, base_id: str) -> list[Deb]:
    """The base image's Debian packages, from its dpkg database; none where the base has none (a vendor base
    that is not Debian's)."""
    status = image_file(c, base_id, DPKG_STATUS)
    return debian_packages(status.decode("utf-8", "replace")) if status else []


def _wheel_of(wheels: dict[str, str], e: locks.Locked) -> tuple[str, str] | None:
    """The wheel the wheelhouse holds for a locked entry (its file name and sha256)."""
    for name, sha in sorted(wheels.items()):
        try:
            n, v, _, _ = parse_wheel_filename(name)
        except InvalidWheelFilename:
            continue
        if canonicalize_name(n) == canonicalize_name(e.name) and str(v) == e.version and sha in e.hashes:
            return name, sha
    return None


def sbom(variant: Variant, inputs: str, entries: list[locks.Locked], wheels: dict[str, str],
         debs: list[Deb], mirror: str = "", suite: str = "", gpus: str = "") -> str:
    """The image's CycloneDX 1.6 SBOM (JSON), the same text for the same inputs (`inputs`: their digest, the
    image's content hash), whatever the image is called: it is in the image's last layer. `wheels`: the
    wheelhouse's {file name: sha256}; `gpus`: Paddle's kernels' architectures (the image's label)."""
    from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, Property, XsUri  # noqa: PLC0415,I001 (heavy: only builds and verify)
    from cyclonedx.model.bom import Bom  # noqa: PLC0415
    from cyclonedx.model.component import Component, ComponentType  # noqa: PLC0415
    from cyclonedx.model.tool import Tool  # noqa: PLC0415
    from cyclonedx.output.json import JsonV1Dot6  # noqa: PLC0415
    from packageurl import PackageURL  # noqa: PLC0415

    bom = Bom(serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"fleetbox:{variant.name}:{inputs}"))
    bom.metadata.timestamp = FIXED_TIME
    bom.metadata.tools.tools.add(Tool(vendor="fleetbox", name="fleetbox"))   # no version: the image's inputs only
    image = Component(name=f"fleetbox-paddle-{variant.name}", version=inputs[:12], type=ComponentType.CONTAINER,
                      bom_ref="image", properties=[Property(name="fleetbox:variant", value=variant.name),
                                                   Property(name="fleetbox:device", value=variant.device),
                                                   Property(name="fleetbox:inputs-sha256", value=inputs)])
    bom.metadata.component = image
    gpu_libraries = {canonicalize_name(n.split("==")[0]) for n in variant.libraries}
    parts = []
    for e in sorted(entries, key=lambda e: canonicalize_name(e.name)):
        name = canonicalize_name(e.name)
        wheel = _wheel_of(wheels, e)
        if wheel is None:
            raise UserError(f"the wheelhouse has no wheel of {e.name}=={e.version} that the lock allows; "
                            f"run `invoke wheels --variant {variant.name}`")
        qualifiers = {} if e.index.rstrip("/") == PYPI else {"repository_url": e.index}
        props = [Property(name="fleetbox:wheel", value=wheel[0])]
        if name in gpu_libraries:
            props.append(Property(name="fleetbox:gpu-library", value="true"))
        if name == canonicalize_name(variant.paddle_name) and gpus:
            props.append(Property(name="fleetbox:gpu-architectures", value=gpus))
        parts.append(Component(
            name=name, version=e.version, type=ComponentType.LIBRARY, bom_ref=f"pypi:{name}",
            purl=PackageURL("pypi", None, name, e.version, qualifiers or None),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=wheel[1])], properties=props,
            external_references=[ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(e.index))]))
    vendor = variant.base.distro or "debian"   # the purl's namespace: the vulnerability feed a scanner reads
    distro = f"{vendor}-{suite}" if suite else None
    for d in debs:
        qualifiers = {k: v for k, v in (("arch", d.arch), ("distro", distro)) if v}
        refs = [ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(mirror))] if mirror else []
        parts.append(Component(
            name=d.name, version=d.version, type=ComponentType.LIBRARY, bom_ref=f"deb:{d.name}:{d.arch}",
            purl=PackageURL("deb", vendor, d.name, d.version, qualifiers or None), external_references=refs,
            properties=[Property(name="fleetbox:source-package", value=d.source)] if d.source else []))
    bom.components.update(parts)
    bom.register_dependency(image, parts)
    return JsonV1Dot6(bom).output_as_string(indent=1) + "\n"


def check_sbom(text: str) -> dict:
    """The SBOM held to CycloneDX 1.6's own schema (offline: the library carries it); its JSON."""
    from cyclonedx.schema import SchemaVersion  # noqa: PLC0415
    from cyclonedx.validation.json import JsonStrictValidator  # noqa: PLC0415

    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if error is not None:
        raise UserError(f"the SBOM is not valid CycloneDX 1.6: {str(error)[:300]}")
    return json.loads(text)


def expected(sbom_json: dict) -> dict:
    """What an image with this SBOM holds: {"python": {name: version}, "deb": {name: version}}."""
    from packageurl import PackageURL  # noqa: PLC0415

    out: dict = {"python": {}, "deb": {}}
    for comp in sbom_json.get("components", []):
        kind = {"pypi": "python", "deb": "deb"}.get(PackageURL.from_string(comp["purl"]).type) if "purl" in comp \
            else None
        if kind:
            out[kind][comp["name"]] = comp["version"]
    return out


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def fleetbox_version() -> str:
    try:
        return metadata.version("fleetbox")
    except metadata.PackageNotFoundError:
        return "unknown"


def provenance(*, image: str, image_id: str, layers: list[str], variant: Variant, lock_sha256: str,
               lock_path: str, base_ref: str, base_id: str, dockerfile: str, sbom_text: str,
               wheels: dict[str, str], engine: str, started: datetime.datetime, finished: datetime.datetime,
               invocation: str, force: bool) -> dict:
    """The build as an in-toto statement with SLSA provenance v1: the image (its ID) as its subject."""
    def digest(value: str) -> dict:
        return {"sha256": value.removeprefix("sha256:")}
    return {
        "_type": STATEMENT,
        "subject": [{"name": image, "digest": digest(image_id)}],
        "predicateType": SLSA,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"variant": variant.name, "force": force},
                "internalParameters": {"device": variant.device, "python": variant.python_version},
                "resolvedDependencies": [
                    {"name": "lock", "uri": lock_path, "digest": digest(lock_sha256)},
                    {"name": "base", "uri": base_ref, "digest": digest(base_id)},
                    {"name": "dockerfile", "uri": f"images/{variant.name}.Dockerfile",
                     "digest": digest(sha256(dockerfile))},
                    {"name": "sbom", "digest": digest(sha256(sbom_text))},
                    *({"name": name, "uri": f"wheelhouse/{variant.name}/{name}", "digest": digest(sha)}
                      for name, sha in sorted(wheels.items())),
                ],
            },
            "runDetails": {
                "builder": {"id": BUILDER, "version": {"fleetbox": fleetbox_version(), "engine": engine}},
                "metadata": {"invocationId": invocation, "startedOn": _when(started), "finishedOn": _when(finished)},
                "byproducts": [{"name": f"layer{i}", "digest": digest(d)} for i, d in enumerate(layers)],
            },
        },
    }


def _when(t: datetime.datetime) -> str:
    return t.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_statement(statement: dict) -> dict:
    """The statement held to in-toto's own Statement v1 rules (its library's), and SLSA v1's required fields."""
    from google.protobuf import json_format  # noqa: PLC0415
    from in_toto_attestation.v1 import statement_pb2  # noqa: PLC0415
    from in_toto_attestation.v1.statement import Statement  # noqa: PLC0415

    try:
        Statement.copy_from_pb(json_format.ParseDict(statement, statement_pb2.Statement())).validate()
        p = statement["predicate"]
        if statement["predicateType"] != SLSA or not p["buildDefinition"]["buildType"] or \
                not p["runDetails"]["builder"]["id"]:
            raise ValueError("not SLSA provenance v1")
    except (ValueError, KeyError, TypeError, json_format.ParseError) as e:
        raise UserError(f"the provenance statement is not a valid in-toto statement: {e}") from None
    return statement


def subject_digests(statement: dict) -> set[str]:
    return {f"sha256:{s['digest']['sha256']}" for s in statement.get("subject", []) if "sha256" in s.get("digest", {})}


def statement_of(image_id: str) -> dict:
    """The statement kept for this image: {} where there is none (an image built elsewhere); UserError where it
    is not a valid statement, or not of this image."""
    statement = files.read_json(provenance_path(image_id))
    if statement and image_id not in subject_digests(check_statement(statement)):
        raise UserError(f"{provenance_path(image_id).name}: its subject is not this image ({image_id[:19]})")
    return statement


# -- where they are kept --

def folder() -> Path:
    return settings.path_of("receipts")[0]


def sbom_path(inputs: str) -> Path:
    """The SBOM of the images made from these inputs (their label settings.LABEL_INPUTS), wherever they are tagged."""
    return folder() / f"inputs-{inputs}{SBOM_SUFFIX}"


def provenance_path(image_id: str) -> Path:
    """The statement of the image with this ID (its whole digest: no other image's file is taken for it)."""
    return folder() / f"image-{image_id.removeprefix('sha256:')}{PROVENANCE_SUFFIX}"


def keep(inputs: str, sbom_text: str, statement: dict, image_id: str) -> None:
    try:
        folder().mkdir(parents=True, exist_ok=True)
        files.write_atomic(sbom_path(inputs), sbom_text)
        files.write_json(provenance_path(image_id), statement, indent=1)
    except OSError as e:
        raise UserError(f"cannot keep the image's receipts in {folder()}: {e.strerror} (FLEETBOX_RECEIPTS)") from None


def beside(out: Path, inputs: str, image_id: str, export_sha256: str | None) -> list[Path]:
    """The image's receipts written beside an export (`out`): its SBOM, and its statement with the export file
    as a second subject (where it is one file). None where the image has no receipts here."""
    for old in (SBOM_SUFFIX, PROVENANCE_SUFFIX, f"{PROVENANCE_SUFFIX}{SIGNATURE_SUFFIX}"):   # an earlier export's
        Path(f"{out}{old}").unlink(missing_ok=True)
    src = sbom_path(inputs)
    if not inputs or not src.exists():
        return []
    written = [files.write_atomic(Path(f"{out}{SBOM_SUFFIX}"), src.read_text())]
    statement = files.read_json(provenance_path(image_id))
    if statement:
        if export_sha256:
            statement["subject"].append({"name": out.name, "digest": {"sha256": export_sha256}})
        written.append(files.write_json(Path(f"{out}{PROVENANCE_SUFFIX}"), statement, indent=1))
    return written


# -- signatures: OpenSSH's own (ssh-keygen -Y), offline, with the keys a site already has --

def sign(statement: Path, key: Path) -> Path:
    """The statement signed with the SSH key `key` (a private key file; a public one whose private key is in
    ssh-agent), the signature beside it (<statement>.sig); ssh-keygen asks for a passphrase on the terminal."""
    check_key(key)
    if not statement.is_file():
        raise UserError(f"no provenance statement to sign ({statement.name} is not in {statement.parent})")
    with tempfile.TemporaryDirectory(prefix="fleetbox-sign-") as d:
        tmp = Path(d) / statement.name   # signed in a folder of its own: ssh-keygen asks before writing over a .sig
        shutil.copyfile(statement, tmp)
        proc = _ssh_keygen(["-Y", "sign", "-q", "-f", str(key), "-n", NAMESPACE, str(tmp)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise UserError(f"signing {statement.name} with {key} failed: {said[:300]}")
        return files.write_atomic(Path(f"{statement}{SIGNATURE_SUFFIX}"), Path(f"{tmp}{SIGNATURE_SUFFIX}").read_bytes())


def check_key(key: Path) -> None:
    """--sign-key names a key file: said before any build or export, not after it."""
    if not key.is_file():
        raise UserError(f"--sign-key {key}: no such key file")


def _ssh_keygen(args: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["ssh-keygen", *args], **kw)
    except FileNotFoundError:
        raise UserError("ssh-keygen is not installed here (Debian's openssh-client): signatures are "
                        "OpenSSH's") from None


KEY_TYPES = ("ssh-", "ecdsa-", "sk-")   # how a public key's line starts (ssh-ed25519, ecdsa-sha2-nistp256, ...)


def signer(statement: Path, trusted: Path) -> str:
    """Who signed the statement, among the keys of `trusted`: an allowed_signers file (ssh-keygen(1)), or public
    keys a line each (a .pub file, authorized_keys' form). UserError, in one line, where none of them did."""
    sig = Path(f"{statement}{SIGNATURE_SUFFIX}")
    if not sig.is_file():
        raise UserError(f"{statement.name} is not signed (no {sig.name})")
    try:
        lines = [ln.strip() for ln in trusted.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise UserError(f"--trusted-keys {trusted}: {e.strerror}") from None
    with tempfile.TemporaryDirectory(prefix="fleetbox-verify-") as d:
        allowed = trusted
        if lines and all(ln.startswith(KEY_TYPES) for ln in lines):   # public keys: each trusted as "fleetbox"
            allowed = Path(d) / "allowed_signers"
            allowed.write_text("".join(f'fleetbox namespaces="{NAMESPACE}" {" ".join(ln.split()[:2])}\n'
                                       for ln in lines))
        found = _ssh_keygen(["-Y", "find-principals", "-s", str(sig), "-f", str(allowed)], capture_output=True,
                            text=True)
        who = found.stdout.split()
        if found.returncode != 0 or not who:
            raise UserError(f"{sig.name} is not by a key of {trusted}")
        with open(statement, "rb") as data:
            ok = _ssh_keygen(["-Y", "verify", "-f", str(allowed), "-I", who[0], "-n", NAMESPACE, "-s", str(sig)],
                             stdin=data, capture_output=True, text=True)
        if ok.returncode != 0:
            raise UserError(f"{sig.name} does not verify: the statement changed after it was signed, or the "
                            f"signature is not for {NAMESPACE}")
        return f"{who[0]} ({ok.stdout.strip().rsplit(' key ', 1)[-1]})"
