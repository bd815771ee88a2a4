"""Hash locks per variant: resolve the matrix pins across PyPI and Paddle's index with uv (plan + act)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import requests

from fleetbox import files
from fleetbox.errors import UserError
from fleetbox.image.matrix import Variant

HEADER = "# fleetbox-lock"


@dataclass(frozen=True)
class Locked:
    name: str
    version: str
    hashes: tuple[str, ...]   # sha256 hex digests, any of which may be installed
    index: str                # the index uv resolved it from


def inputs(variant: Variant) -> dict:
    """Everything the lock's content depends on; a change in any of it makes the lock stale."""
    out = {"requirements": variant.requirements, "python_version": variant.python_version,
           "platform": variant.platform, "pypi": variant.pypi, "paddle_index": variant.paddle_index}
    if variant.constraints:   # only where there are any: the other variants' locks stay current
        out["constraints"] = list(variant.constraints)
    if variant.no_deps:
        out["no_deps"] = list(variant.no_deps)
    return out


def inputs_hash(variant: Variant) -> str:
    return hashlib.sha256(json.dumps(inputs(variant), sort_keys=True).encode()).hexdigest()


def uv_platform(platform_tag: str) -> str:
    """manylinux_2_36_x86_64 -> x86_64-manylinux_2_36 (uv's --python-platform spelling)."""
    m = re.fullmatch(r"(manylinux_\d+_\d+|manylinux2014)_(x86_64|aarch64)", platform_tag)
    if not m:
        raise UserError(f"unsupported platform tag {platform_tag!r} (want manylinux_X_Y_ARCH)")
    return f"{m.group(2)}-{m.group(1)}"


def project_file(variant: Variant, paddle_index: str = "") -> str:
    """A throwaway pyproject whose [tool.uv] tables pin Paddle's wheel to Paddle's own index (`paddle_index`: a
    mirror of it; explicit: nothing else may come from it) and leave everything else to PyPI."""
    deps = ", ".join(json.dumps(r) for r in variant.requirements)
    text = (f'[project]\nname = "fleetbox-lock-{variant.name}"\nversion = "0"\n'
            f'requires-python = "=={variant.python_version}.*"\ndependencies = [{deps}]\n')
    if variant.paddle_index:
        text += (f'\n[tool.uv.sources]\n"{variant.paddle_name}" = {{ index = "paddle" }}\n'
                 f'\n[[tool.uv.index]]\nname = "paddle"\nurl = "{paddle_index or variant.paddle_index}"\n'
                 f'explicit = true\n')
    return text


def compile_argv(variant: Variant, project: Path, out: Path, constraints: Path | None = None,
                 no_deps: bool = False) -> list[str]:
    """`constraints`: a file holding variant.constraints (uv's --constraint), where it has any; `no_deps`:
    `project` is a requirements file whose packages are locked alone (variant.no_deps)."""
    return ["uv", "pip", "compile", str(project), "--output-file", str(out), "--generate-hashes",
            "--emit-index-annotation", "--only-binary", ":all:", "--no-header", "--quiet",
            "--python-version", variant.python_version, "--python-platform", uv_platform(variant.platform),
            "--default-index", variant.pypi, *(["--constraint", str(constraints)] if constraints else []),
            *(["--no-deps"] if no_deps else [])]


def parse(text: str) -> list[Locked]:
    """Read a uv-compiled requirements file: `name==ver \\` lines, `--hash=sha256:` lines, `# from URL`."""
    entries: list[Locked] = []
    name = version = index = None
    hashes: list[str] = []

    def flush():
        if name:
            entries.append(Locked(name, version, tuple(hashes), index or ""))

    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", s)
        if m and not line.startswith((" ", "\t")):
            flush()
            name, version, index, hashes = m.group(1), m.group(2), None, []
        elif s.startswith("--hash=sha256:"):
            hashes.append(s.split(":", 1)[1].rstrip(" \\"))
        elif s.startswith("# from "):
            index = s[len("# from "):].strip()
    flush()
    return entries


def header(variant: Variant) -> str:
    return (f"{HEADER}: variant={variant.name} inputs={inputs_hash(variant)}\n"
            f"# Made by `invoke lock --variant {variant.name}` from images/matrix.toml; do not edit by hand.\n"
            f"# Install with: pip install --no-index --find-links WHEELHOUSE --require-hashes -r THIS_FILE\n")


def read(variant: Variant) -> tuple[str, list[Locked]]:
    """The variant's lock text and entries; a clear error when it is missing or stale."""
    path = variant.lock_path
    how = f"run `invoke lock --variant {variant.name}`"
    if variant.paddle_index:
        how += f" on a machine that reaches {variant.paddle_index} and commit {path.name}"
    if not path.exists():
        raise UserError(f"no lock for variant {variant.name} ({path}); {how}")
    text = path.read_text()
    first = text.splitlines()[0] if text else ""
    if f"inputs={inputs_hash(variant)}" not in first:
        raise UserError(f"lock {path.name} is stale (images/matrix.toml changed since it was made); {how}")
    return text, parse(text)


def lock_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check_reachable(url: str) -> None:
    try:
        requests.head(url, timeout=15, allow_redirects=True)
    except requests.RequestException as e:
        raise UserError(f"cannot reach {url} ({type(e).__name__}); run `invoke lock` where it is reachable "
                        f"and commit the lock") from None


def make(variant: Variant, out: Path | None = None, upgrade: bool = False, paddle_index: str = "") -> Path:
    """Resolve and write the lock atomically to `out` (default images/locks/<variant>.lock).
    The versions the lock already pins are kept where the new inputs allow them (uv reads its output file as
    preferences), so changing one pin does not move others, nor the image layers they are in; `upgrade`
    resolves every package afresh. `paddle_index`: a mirror of the variant's Paddle index (the same pages; a
    site's proxy), resolved from instead; the lock's inputs stay the matrix's, and it names where each wheel came
    from."""
    if paddle_index and not variant.paddle_index:
        raise UserError(f"--paddle-index: variant {variant.name} takes Paddle from {variant.pypi}, not Paddle's index")
    if paddle_index and not re.fullmatch(r"https?://[^\s\"\\]+", paddle_index):
        raise UserError(f"--paddle-index {paddle_index!r} is not an http(s) URL")
    _check_reachable(variant.pypi)
    if variant.paddle_index:
        _check_reachable(paddle_index or variant.paddle_index)
    path = out or variant.lock_path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fleetbox-lock-") as tmp:
        project, compiled = Path(tmp) / "pyproject.toml", Path(tmp) / "out.lock"
        project.write_text(project_file(variant, paddle_index))
        constraints = None
        if variant.constraints:
            constraints = Path(tmp) / "constraints.txt"
            constraints.write_text("".join(c + "\n" for c in variant.constraints))
        if path.exists() and not upgrade:
            compiled.write_text(path.read_text())
        _compile(variant, compile_argv(variant, project, compiled, constraints), tmp)
        body = compiled.read_text().replace(str(project), f"images/matrix.toml [{variant.name}]")
        if variant.no_deps:   # locked apart, so that their dependencies are not resolved into the lock
            alone, alone_lock = Path(tmp) / "no-deps.txt", Path(tmp) / "no-deps.lock"
            alone.write_text("".join(r + "\n" for r in variant.no_deps))
            if path.exists() and not upgrade:   # its pins kept too, where a range allows
                alone_lock.write_text(path.read_text())
            _compile(variant, compile_argv(variant, alone, alone_lock, no_deps=True), tmp)
            both = {e.name.lower() for e in parse(body)} & {e.name.lower() for e in parse(alone_lock.read_text())}
            if both:
                raise UserError(f"matrix: variant {variant.name}: {', '.join(sorted(both))} is in no_deps and also "
                                f"needed by the rest: list it once")
            body = body.rstrip("\n") + "\n" + alone_lock.read_text().replace(f"-r {alone}", f"-r {alone.name}").replace(
                f"-r {alone.name}", f"images/matrix.toml [{variant.name}] no_deps")
        entries = parse(body)
        if not entries or any(not e.hashes for e in entries):
            raise UserError(f"uv produced a lock without hashes for {variant.name}")
        files.write_atomic(path, header(variant) + body)
    return path


def _compile(variant: Variant, argv: list[str], cwd: str) -> None:
    proc = subprocess.run([uv_binary(), *argv[1:]], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "UV_NO_CONFIG": "1"})
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])
        raise UserError(f"uv could not resolve variant {variant.name}: {' '.join(last[-3:])}")


def uv_binary() -> str:
    try:
        from uv import find_uv_bin  # noqa: PLC0415 (optional: the PyPI package ships the binary next to this finder)
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return "uv"
