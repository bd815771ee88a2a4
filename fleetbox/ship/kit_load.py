"""Load an air-gap kit (made by `invoke kit`) on a machine with no network: Python's standard library only,
so the same file runs before fleetbox is installed (the kit carries it as `kit-load.py`):

    sha256sum -c fleetbox-cpu.kit.sha256       # the digest file sent apart from the kit: check it first
    tar -xf fleetbox-cpu.kit kit-load.py
    python3 kit-load.py fleetbox-cpu.kit --expect SHA256 [--dest DIR]

or, where fleetbox already runs, `invoke kit --load FILE --expect SHA256 [--dest DIR]`.

Every checksum is verified before anything is used: the whole kit against --expect (a digest sent apart from
the kit, since a manifest rewritten to match tampered parts would pass its own check), then every file
against the kit's manifest, with no file missing and none extra. Only then does it load the base (and image)
into the Docker Engine ($DOCKER_HOST), place the fleetbox source, the lock, the wheelhouse and the dataset
cache in DIR/fleetbox, and install fleetbox into a fresh venv DIR/venv from the kit's own wheels. A refused
kit changes nothing; a load that fails part-way is undone (the folder removed, images it loaded removed).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

MANIFEST = "MANIFEST.sha256"
KIT_JSON = "kit.json"
CHUNK = 1 << 20
HEAD_LIMIT = 16 << 20   # a member read before kit.json declares every file's size (loader, manifest, kit.json)
STOPS = (signal.SIGTERM, signal.SIGHUP)   # besides Ctrl-C: a scheduler, a dropped connection (as fleetbox.processes)


class Refused(Exception):
    """A kit that must not be used, or a load that cannot go on: one line for the user."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """sha256sum's format: `<64 hex>  <path>` per line."""
    out = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or name in out:
            raise Refused(f"the kit's {MANIFEST} is not a sha256 list (line {line[:80]!r})")
        out[name] = digest
    return out


def safe_name(name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts or name != str(p):
        raise Refused(f"the kit holds an unsafe path {name!r}")
    return name


class _Hashing(io.RawIOBase):
    """Reads a file once: the tar stream is extracted from it while its sha256 is taken."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.h.update(memoryview(b)[:n])
        return n


def verify(kit: Path, staging: Path, expect: str | None, log=print) -> dict:
    """Check the kit whole and file by file, extracting it into `staging` in one pass over the file (so the
    bytes hashed are the bytes used); returns kit.json, checked. Nothing outside `staging` is touched."""
    if expect is not None:
        expect = expect.strip().lower()
        if len(expect) != 64 or any(c not in "0123456789abcdef" for c in expect):
            raise Refused(f"--expect {expect!r} is not a sha256 (64 hex digits)")
    got: dict[str, str] = {}
    listed: dict[str, str] | None = None   # the manifest, once read (our kits put it second: damage shows early)
    sizes: dict[str, int] | None = None    # kit.json's sizes, once it matched the manifest (our kits: third)
    try:
        with open(kit, "rb") as raw:
            size = os.fstat(raw.fileno()).st_size
            reader = _Hashing(raw)
            with tarfile.open(fileobj=io.BufferedReader(reader, CHUNK), mode="r|") as tar:
                for m in tar:
                    if m.isdir():
                        continue
                    if not m.isfile() or m.issparse():   # a sparse file writes far more than the kit holds
                        raise Refused(f"the kit holds {m.name!r}, which is not a regular file")
                    name = safe_name(m.name)
                    if name in got:
                        raise Refused(f"the kit holds {name!r} twice")
                    if listed is not None and name not in listed:   # before writing a byte of it
                        raise Refused(f"kit {kit} holds {name}, which its manifest does not list")
                    if m.size > size:
                        raise Refused(f"the kit's {name} says it holds {m.size} bytes, more than the kit's {size}")
                    if sizes is not None and sizes.get(name) != m.size:
                        raise Refused(f"the kit's {name} says it holds {m.size} bytes; its {KIT_JSON} declares "
                                      f"{sizes.get(name, 'no such file')}")
                    if sizes is None and m.size > HEAD_LIMIT:
                        raise Refused(f"the kit's {name} ({m.size} bytes) comes before its {KIT_JSON} declares the "
                                      f"sizes of its files; only the loader, the manifest and {KIT_JSON} may")
                    out = staging / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    h = hashlib.sha256()
                    with tar.extractfile(m) as src, open(out, "wb") as dst:
                        while chunk := src.read(CHUNK):
                            h.update(chunk)
                            dst.write(chunk)
                    got[name] = h.hexdigest()
                    if name == MANIFEST:   # what came before it must be listed too (later members: above)
                        listed = parse_manifest(out.read_text(encoding="utf-8", errors="replace"))
                        if early := sorted(set(got) - set(listed) - {MANIFEST}):
                            raise Refused(f"kit {kit} holds {early[0]}, which its manifest does not list")
                    if listed is not None and name in listed and got[name] != listed[name]:
                        _mismatch(name, got[name], listed[name])
                    if name == KIT_JSON and listed is not None:   # matched the manifest: its sizes hold from here
                        sizes = declared_sizes(out)
                    if len(got) % 50 == 0:
                        log(f"read {len(got)} files")
            rest = bytearray(CHUNK)
            while reader.readinto(rest):
                pass   # the padding after the archive's end is part of the file's digest too
    except (tarfile.TarError, EOFError) as e:
        raise Refused(f"kit {kit} is not a complete archive ({e}): it was cut short or damaged") from None
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
        raise Refused(f"the kit holds a file and a folder of the same name ({e.filename})") from None
    whole = reader.h.hexdigest()
    if expect is not None:
        if whole != expect:
            raise Refused(f"kit {kit} has sha256 {whole}, not the expected {expect}: it was changed or damaged")
        log(f"kit sha256 {whole} as expected")
    if listed is None:
        raise Refused(f"kit {kit} has no {MANIFEST}")
    extra = sorted(set(got) - set(listed) - {MANIFEST})
    missing = sorted(set(listed) - set(got))
    if extra:
        raise Refused(f"kit {kit} holds {extra[0]}, which its manifest does not list"
                      + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    if missing:
        raise Refused(f"kit {kit} lacks {missing[0]}, which its manifest lists"
                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name in sorted(listed):
        if got[name] != listed[name]:
            _mismatch(name, got[name], listed[name])
    info = check_info(staging, set(listed))
    log(f"kit verified: {len(listed)} files match the manifest (variant {info['variant']}, fleetbox "
        f"{info['revision'][:12]})")
    return info


def _mismatch(name: str, got: str, listed: str):
    raise Refused(f"kit part {name} does not match the kit's manifest (sha256 {got[:16]}..., listed {listed[:16]}...): "
                  f"it was changed or damaged")


def declared_sizes(kit_json: Path) -> dict[str, int]:
    """kit.json's size of every file; the whole of kit.json is checked later (check_info)."""
    try:
        sizes = json.loads(kit_json.read_text())["sizes"]
        if isinstance(sizes, dict) and all(type(v) is int and v >= 0 for v in sizes.values()):
            return sizes
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise Refused(f"the kit's {KIT_JSON} is not one fleetbox makes (no size for each file)")


IMAGE_PARTS = ("base", "image")   # parts that `docker load` takes, each naming the tags it brings
# an image's receipts (fleetbox/image/receipts.py's names), which an image part may carry for the site's receipts/
RECEIPT = re.compile(r"inputs-[0-9a-f]{64}\.sbom\.json|image-[0-9a-f]{64}\.provenance\.json(\.sig)?")
VARIANT = re.compile(r"[a-z0-9][a-z0-9._-]{0,40}")
IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[0-9]+)?/?[a-z0-9._/-]*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def check_info(staging: Path, names: set[str]) -> dict:
    """kit.json, held to its shape: its values become paths, arguments and tags here."""
    try:
        info = json.loads((staging / KIT_JSON).read_text())
        parts = info["parts"]
        ok = (VARIANT.fullmatch(info["variant"]) and re.fullmatch(r"[0-9a-f]{40}", info["revision"])
              and re.fullmatch(r"3\.[0-9]+", info["python"]) and re.fullmatch(r"2\.[0-9]+", info["glibc"])
              and isinstance(info["machine"], str)
              and isinstance(parts, dict)
              and {"source", "lock", "host-wheels", "board-wheels", "wheelhouse", "base"} <= set(parts))
        for name, part in parts.items():
            ok = ok and all(isinstance(f, str) and f in names for f in part["files"]) and part["files"]
            ok = ok and type(part["bytes"]) is int and part["bytes"] >= 0
            tags = part["tags"] if name in IMAGE_PARTS else part.get("tags", [])   # what an image part loads
            ok = ok and isinstance(tags, list) and (tags or name not in IMAGE_PARTS)
            ok = ok and all(isinstance(t, str) and IMAGE_REF.fullmatch(t) for t in tags)
            held = part.get("receipts", [])
            ok = ok and isinstance(held, list) and all(isinstance(r, str) and RECEIPT.fullmatch(r)
                                                       and f"{name}/{r}" in part["files"] for r in held)
        sizes = info["sizes"]
        ok = ok and isinstance(sizes, dict) and set(sizes) == names - {KIT_JSON}
        ok = ok and all(type(v) is int and v >= 0 for v in sizes.values())
        place = parts["lock"]["place"]
        ok = ok and safe_name(place).startswith("images/locks/") and place.endswith(".lock")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, Refused):
        ok = False
    if not ok:
        raise Refused(f"the kit's {KIT_JSON} is not one fleetbox makes")
    return info


def check_host(info: dict) -> None:
    want, have = info["python"], f"{sys.version_info[0]}.{sys.version_info[1]}"
    if want != have:
        raise Refused(f"the kit's wheels for fleetbox are for Python {want}; this is Python {have} "
                      f"(run it with python{want})")
    if info["machine"] != platform.machine():
        raise Refused(f"the kit is for {info['machine']}; this machine is {platform.machine()}")
    libc, version = platform.libc_ver()
    need = tuple(int(x) for x in info["glibc"].split("."))
    if libc == "glibc" and tuple(int(x) for x in version.split(".")[:2]) < need:
        raise Refused(f"the kit's wheels need glibc {info['glibc']} or newer; this machine has {version}")


def place_receipts(info: dict, staging: Path, src: Path) -> list[str]:
    """The receipts an image part carries (checked by check_info), moved into the placed source's receipts/,
    where fleetbox's verify and export find them."""
    placed = []
    for part in IMAGE_PARTS:
        for name in info["parts"].get(part, {}).get("receipts", []):
            (src / "receipts").mkdir(exist_ok=True)
            shutil.move(str(staging / part / name), src / "receipts" / name)
            placed.append(name)
    return placed


def image_id(tag: str) -> str:
    """The ID of the image a tag names in the engine."""
    try:
        return subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise Refused(f"the kit's image {tag} is not in the engine after loading it") from None


# run by the fleetbox the kit installed: its statement of the loaded image, and who signed it
SIGNED_BY = """import sys
from pathlib import Path
from fleetbox.errors import UserError
from fleetbox.image import receipts
try:
    if not receipts.statement_of(sys.argv[3]):
        raise UserError(f"the kit carries no provenance statement of the image it loaded ({sys.argv[3][:19]})")
    print(receipts.signer(receipts.provenance_path(sys.argv[3]), Path(sys.argv[2])))
except (UserError, OSError, ValueError) as e:
    sys.exit(str(e))
"""


def signed_by(python: Path, src: Path, trusted: Path, image: str) -> str:
    """Who signed the statement of the image the kit loaded (`image`: its ID), among the receipts placed in
    `src`, asked of the fleetbox just installed (`python`: its venv's), whose rules they are (image/receipts.py);
    Refused where the kit carries no statement of that image, or none of `trusted`'s keys signed it."""
    proc = subprocess.run([str(python), "-c", SIGNED_BY, str(src), str(Path(trusted).resolve()), image],
                          capture_output=True, text=True,
                          env={**os.environ, "FLEETBOX_RECEIPTS": str(src / "receipts")})
    if proc.returncode != 0:
        raise Refused(f"--trusted-keys: {(proc.stderr.strip().splitlines() or ['no answer'])[-1]}")
    return proc.stdout.strip()


def run(argv: list[str], **kw) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    except OSError as e:
        raise Refused(f"cannot run {argv[0]}: {e.strerror}") from None
    if proc.returncode != 0:
        why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise Refused(f"{' '.join(argv[:4])} ... failed (exit {proc.returncode}): {why[-1] if why else '?'}")


def docker_images() -> dict[str, str]:
    """The engine's tags and the image each names."""
    try:
        out = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"],
                             capture_output=True, text=True)
    except OSError as e:
        raise Refused(f"cannot run docker: {e.strerror} (a site with no container engine: load with --skip-images, "
                      f"then make the env with `invoke venv`)") from None
    if out.returncode != 0:
        raise Refused(f"the Docker Engine is not reachable: {(out.stderr.strip().splitlines() or ['?'])[-1]} (a site "
                      f"with no container engine: load with --skip-images, then make the env with `invoke venv`)")
    return dict(ln.split() for ln in out.stdout.splitlines() if len(ln.split()) == 2)


class _Undo:
    """What a load changed in the engine, to put back if it fails: tags it added, tags it moved."""

    def __init__(self):
        self.added: list[str] = []
        self.moved: dict[str, str] = {}

    def expect(self, tags: list[str], before: dict[str, str]) -> None:   # before `docker load`, not after
        self.added += [t for t in tags if t not in before]
        self.moved.update({t: before[t] for t in tags if t in before})

    def __call__(self) -> None:
        if self.added:
            subprocess.run(["docker", "rmi", *self.added], capture_output=True)
        for tag, image in self.moved.items():
            subprocess.run(["docker", "tag", image, tag], capture_output=True)


def load(kit: Path, dest: Path, expect: str | None = None, log=print, no_expect: bool = False,
         skip_images: bool = False, trusted_keys: Path | None = None) -> dict:
    """Verify, then load; returns what was placed. Raises Refused with one line. `trusted_keys`: the image's
    provenance statement must be signed by one of these SSH keys, or nothing stays loaded."""
    if expect is None and not no_expect:
        raise Refused("give --expect SHA256 (the kit's digest, sent apart from it); --no-expect skips that check")
    if expect is None:
        log("warning: no --expect: a kit whose manifest was rewritten to match changed parts would pass")
    kit, dest = Path(kit).resolve(), Path(dest).resolve()
    if not kit.is_file():
        raise Refused(f"no kit at {kit}")
    if not dest.parent.is_dir():
        raise Refused(f"{dest.parent} is not a folder: --dest names a new folder in an existing one")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise Refused(f"{dest} is not an empty folder: load a kit into a new folder (--dest)")
    made_dest = not dest.exists()
    staging = dest.parent / f".{dest.name}.kit-load"
    undo = _Undo()
    # a scheduler's SIGTERM and a dropped connection's SIGHUP take Ctrl-C's way out (an ignored one stays ignored)
    previous = {sig: signal.getsignal(sig) for sig in STOPS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _interrupt)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        info = verify(kit, staging, expect, log)
        check_host(info)
        images = [part for part in IMAGE_PARTS if part in info["parts"]]
        if images and skip_images:   # a site with no container engine: the rest serves `invoke venv`
            log(f"not loading the {' and the '.join(images)} (--skip-images): no container engine is asked")
            images = []
        before = docker_images() if images else {}
        dest.mkdir(exist_ok=True)
        # the images first: an engine that cannot take them stops the load before any folder is placed
        for part in images:
            log(f"loading the {part} into the Docker Engine ({info['parts'][part]['bytes'] / 2**20:.0f} MiB)")
            undo.expect(info["parts"][part]["tags"], before)
            run(["docker", "load", "-i", str(staging / next(f for f in info["parts"][part]["files"]
                                                           if f.endswith(".tar")))])
        src = dest / "fleetbox"
        src.mkdir()
        with tarfile.open(staging / "source" / "fleetbox-src.tar") as tar:
            for m in tar.getmembers():   # checked above by the manifest; still only plain files and folders
                if not (m.isfile() or m.isdir()) or m.issparse():   # sparse: writes far more than the kit holds
                    raise Refused(f"the kit's source holds {m.name!r}, which is not a regular file or folder")
                safe_name(m.name.rstrip("/"))
                m.mode &= 0o755   # no setuid, no world-writable
            tar.extractall(src)
        variant = info["variant"]
        lock_rel = info["parts"]["lock"]["place"]
        (src / lock_rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / info["parts"]["lock"]["files"][0]), src / lock_rel)
        wheelhouse = src / "wheelhouse" / variant
        wheelhouse.parent.mkdir(exist_ok=True)
        shutil.move(str(staging / "wheelhouse"), wheelhouse)
        shutil.move(str(staging / "board-wheels"), wheelhouse.parent / "board")   # settings.board_wheels() there
        log(f"placed the source ({info['revision'][:12]}), the lock, the wheelhouse and the board's in {src}")
        if placed := place_receipts(info, staging, src):
            log(f"placed the image's receipts in {src / 'receipts'}: {', '.join(placed)}")
        venv, wheels = dest / "venv", staging / "host-wheels"
        log(f"installing fleetbox into {venv} from the kit's {len(info['parts']['host-wheels']['files'])} wheels")
        pip = next(wheels.glob("pip-*.whl"), None)
        if pip is None:
            raise Refused("the kit has no pip wheel among its host wheels")
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)])   # no ensurepip needed (Debian)
        run([str(venv / "bin" / "python"), str(pip / "pip"), "install", "-q", "--no-index", "--find-links",
             str(wheels), "--disable-pip-version-check", "pip", "-e", str(src)], cwd=str(dest))
        if trusted_keys is not None:
            if "image" not in images:
                raise Refused("--trusted-keys checks the statement of the image the kit loads: the kit carries none "
                              "(make it --with-image), or --skip-images loaded none")
            loaded = image_id(info["parts"]["image"]["tags"][0])
            log(f"the image's provenance statement: signed by "
                f"{signed_by(venv / 'bin' / 'python', src, trusted_keys, loaded)}")
        if "datasets" in info["parts"]:
            log("restoring the dataset cache")
            run([str(venv / "bin" / "python"), "-m", "invoke", "cache", "--from",
                 str(staging / "datasets" / "datasets.tar"), "--manifest", str(staging / "datasets" / "datasets.toml"),
                 "--dest", str(src / "offline_cache" / "dataset")], cwd=str(src))
        (dest / KIT_JSON).write_text(json.dumps({**info, "kit": str(kit)}, indent=1))
    except BaseException as e:   # Ctrl-C included: undo what this load placed, with signals held
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOPS)}
        try:
            undo()
            if made_dest:
                shutil.rmtree(dest, ignore_errors=True)
            elif dest.is_dir():
                for p in dest.iterdir():
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
        if isinstance(e, OSError):
            raise Refused(f"the load failed and was undone: {e.strerror or e}"
                          + (f" ({e.filename})" if e.filename else "")) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    shutil.rmtree(staging, ignore_errors=True)
    q = shlex.quote
    if os.environ.get("FLEETBOX_WHEELHOUSE"):
        log(f"note: FLEETBOX_WHEELHOUSE is set; unset it so that build uses the kit's wheelhouse ({wheelhouse})")
    py = q(str(venv / "bin" / "python"))
    log(f"kit loaded into {dest}. Next, with no network needed:")
    log(f"  cd {q(str(src))}")
    if skip_images:   # no container: the variant's env from the kit's wheelhouse
        log(f"  {py} -m invoke venv --variant {variant} --dest DIR   # DIR: a folder every node sees")
        log(f"  {py} -m invoke train --backend slurm --runtime none --venv DIR/{variant}-... --nodes 2")
    else:
        if "image" not in info["parts"]:
            log(f"  {py} -m invoke build --variant {variant}")
        log(f"  {py} -m invoke verify --variant {variant}")
        log(f"  {py} -m invoke train --nodes 2 --variant {variant}")
    return {"dest": str(dest), "source": str(src), "venv": str(venv), "images": undo.added, "info": info}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kit-load.py", description="verify and load a fleetbox air-gap kit")
    ap.add_argument("kit")
    ap.add_argument("--expect", help="the kit's sha256, sent apart from it")
    ap.add_argument("--no-expect", action="store_true", help="load without checking the kit's own digest")
    ap.add_argument("--dest", default=None, help="a new folder to load into (default: ./fleetbox-<kit name>)")
    ap.add_argument("--skip-images", action="store_true",
                    help="load no image (a site with no container engine: `invoke venv` makes the env)")
    ap.add_argument("--trusted-keys", type=Path, default=None,
                    help="SSH public keys (a .pub file or an allowed_signers file) that must have signed the image's "
                         "provenance statement")
    a = ap.parse_args(argv)
    dest = Path(a.dest or f"fleetbox-{Path(a.kit).name.rsplit('.', 1)[0]}")
    try:
        load(Path(a.kit), dest, a.expect, log=lambda m: print(m, flush=True), no_expect=a.no_expect,
             skip_images=a.skip_images, trusted_keys=a.trusted_keys)
    except Refused as e:
        print(f"kit-load: refused: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kit-load: interrupted; what it had loaded was undone", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
