"""Load an air-gap kit (made by `invoke kit`) on a machine with no network: Python's standard library only,
so the same file runs before fleetbox is installed (the kit carries it as `kit-load.py`):

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
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

MANIFEST = "MANIFEST.sha256"
KIT_JSON = "kit.json"
CHUNK = 1 << 20


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


def members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """The kit's files by name: regular files only (no links, devices or folders with modes of their own)."""
    out = {}
    for m in tar.getmembers():
        if m.isdir():
            continue
        if not m.isfile():
            raise Refused(f"the kit holds {m.name!r}, which is not a regular file")
        if safe_name(m.name) in out:
            raise Refused(f"the kit holds {m.name!r} twice")
        out[m.name] = m
    return out


def verify(kit: Path, staging: Path, expect: str | None, log=print) -> dict:
    """Check the kit whole and file by file, extracting it into `staging`; returns kit.json. Nothing outside
    `staging` is touched."""
    if expect is not None:
        expect = expect.strip().lower()
        if len(expect) != 64 or any(c not in "0123456789abcdef" for c in expect):
            raise Refused(f"--expect {expect!r} is not a sha256 (64 hex digits)")
        got = sha256_file(kit)
        if got != expect:
            raise Refused(f"kit {kit} has sha256 {got}, not the expected {expect}: it was changed or damaged")
        log(f"kit sha256 {got} as expected")
    try:
        with tarfile.open(kit, "r:") as tar:
            files = members(tar)
            if MANIFEST not in files:
                raise Refused(f"kit {kit} has no {MANIFEST}")
            listed = parse_manifest(tar.extractfile(files[MANIFEST]).read().decode("utf-8", "replace"))
            extra = sorted(set(files) - set(listed) - {MANIFEST})
            missing = sorted(set(listed) - set(files))
            if extra:
                raise Refused(f"kit {kit} holds {extra[0]}, which its manifest does not list"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
            if missing:
                raise Refused(f"kit {kit} lacks {missing[0]}, which its manifest lists"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            for i, name in enumerate(sorted(listed), 1):
                out = staging / name
                out.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                with tar.extractfile(files[name]) as src, open(out, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        dst.write(chunk)
                if h.hexdigest() != listed[name]:
                    raise Refused(f"kit part {name} does not match the kit's manifest (sha256 {h.hexdigest()[:16]}..., "
                                  f"listed {listed[name][:16]}...): it was changed or damaged")
                if i % 50 == 0:
                    log(f"verified {i}/{len(listed)} files")
    except (tarfile.TarError, EOFError) as e:
        raise Refused(f"kit {kit} is not a complete archive ({e}): it was cut short or damaged") from None
    info = json.loads((staging / KIT_JSON).read_text())
    log(f"kit verified: {len(listed)} files match the manifest (variant {info['variant']}, fleetbox "
        f"{info['revision'][:12]})")
    return info


def check_host(info: dict) -> None:
    want, have = info["python"], f"{sys.version_info[0]}.{sys.version_info[1]}"
    if want != have:
        raise Refused(f"the kit's wheels for fleetbox are for Python {want}; this is Python {have} "
                      f"(run it with python{want})")
    if info["machine"] != platform.machine():
        raise Refused(f"the kit is for {info['machine']}; this machine is {platform.machine()}")


def run(argv: list[str], log=print, **kw) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise Refused(f"{' '.join(argv[:4])} ... failed (exit {proc.returncode}): {why[-1] if why else '?'}")


def docker_images() -> set[str]:
    out = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise Refused(f"the Docker Engine is not reachable: {out.stderr.strip().splitlines()[-1:]}")
    return set(out.stdout.split())


def load(kit: Path, dest: Path, expect: str | None = None, log=print) -> dict:
    """Verify, then load; returns what was placed. Raises Refused with one line."""
    kit, dest = Path(kit).resolve(), Path(dest).resolve()
    if not kit.is_file():
        raise Refused(f"no kit at {kit}")
    if dest.exists() and any(dest.iterdir()):
        raise Refused(f"{dest} is not empty: load a kit into a new folder (--dest)")
    made_dest = not dest.exists()
    staging = dest.parent / f".{dest.name}.kit-load"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    loaded: list[str] = []
    try:
        info = verify(kit, staging, expect, log)
        check_host(info)
        before = docker_images()
        dest.mkdir(parents=True, exist_ok=True)
        # the images first: an engine that cannot take them stops the load before any folder is placed
        for part in ("base", "image"):
            if part in info["parts"]:
                log(f"loading the {part} into the Docker Engine ({info['parts'][part]['bytes'] / 2**20:.0f} MiB)")
                run(["docker", "load", "-i", str(staging / info["parts"][part]["files"][0])])
                loaded += [t for t in info["parts"][part]["tags"] if t not in before]
        src = dest / "fleetbox"
        src.mkdir()
        with tarfile.open(staging / "source" / "fleetbox-src.tar") as tar:
            for m in tar.getmembers():   # our own archive, checked above; still no links out of the folder
                if m.issym() or m.islnk() or not (m.isfile() or m.isdir()):
                    raise Refused(f"the kit's source holds {m.name!r}, which is not a file or folder")
                safe_name(m.name)
            tar.extractall(src)
        variant = info["variant"]
        lock_rel = info["parts"]["lock"]["place"]
        (src / lock_rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / "lock" / Path(lock_rel).name), src / lock_rel)
        wheelhouse = src / "wheelhouse" / variant
        shutil.move(str(staging / "wheelhouse"), wheelhouse)
        log(f"placed the source ({info['revision'][:12]}), the lock and the wheelhouse in {src}")
        venv = dest / "venv"
        log(f"installing fleetbox into {venv} from the kit's {len(info['parts']['host-wheels']['files'])} wheels")
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
             str(staging / "host-wheels"), "-e", str(src)], cwd=str(dest))
        if "datasets" in info["parts"]:
            log("restoring the dataset cache")
            run([str(venv / "bin" / "python"), "-m", "invoke", "cache", "--from",
                 str(staging / "datasets" / "datasets.tar"), "--manifest", str(staging / "datasets" / "datasets.toml"),
                 "--dest", str(src / "offline_cache" / "dataset")], cwd=str(src))
        (dest / KIT_JSON).write_text(json.dumps({**info, "kit": str(kit)}, indent=1))
    except BaseException:   # Ctrl-C included: undo what this load placed; the engine's other images stay
        if loaded:
            subprocess.run(["docker", "rmi", *loaded], capture_output=True)
        if made_dest:
            shutil.rmtree(dest, ignore_errors=True)
        else:
            for p in dest.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    py = venv / "bin" / "python"
    if os.environ.get("FLEETBOX_WHEELHOUSE"):
        log(f"note: FLEETBOX_WHEELHOUSE is set; unset it so that build uses the kit's wheelhouse ({wheelhouse})")
    log(f"kit loaded into {dest}. Next, with no network needed:")
    log(f"  cd {src}")
    if "image" not in info["parts"]:
        log(f"  {py} -m invoke build --variant {variant}")
    log(f"  {py} -m invoke verify --variant {variant}")
    log(f"  {py} -m invoke train --nodes 2 --variant {variant}")
    return {"dest": str(dest), "source": str(src), "venv": str(venv), "images": loaded, "info": info}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kit-load.py", description="verify and load a fleetbox air-gap kit")
    ap.add_argument("kit")
    ap.add_argument("--expect", help="the kit's sha256, sent apart from it")
    ap.add_argument("--dest", default=None, help="folder to load into (default: ./fleetbox-<kit name>)")
    a = ap.parse_args(argv)
    dest = Path(a.dest or f"fleetbox-{Path(a.kit).name.rsplit('.', 1)[0]}")
    try:
        load(Path(a.kit), dest, a.expect, log=lambda m: print(m, flush=True))
    except Refused as e:
        print(f"kit-load: refused: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kit-load: interrupted; nothing was left loaded", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
