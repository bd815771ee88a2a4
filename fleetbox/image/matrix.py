"""The build matrix (images/matrix.toml): variants, their bases, and what each turns into (pure)."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fleetbox import ROOT, settings
from fleetbox.errors import UserError

MATRIX_PATH = ROOT / "images" / "matrix.toml"
LOCK_DIR = ROOT / "images" / "locks"


@dataclass(frozen=True)
class Base:
    name: str
    description: str
    os_image: str
    distro: str
    python: str
    packages: tuple[str, ...] = ()
    suite: str = ""
    mirror: str = ""

    @property
    def bootstrappable(self) -> bool:
        return self.distro in ("debian", "ubuntu") and bool(self.suite)

    def identity(self) -> dict:
        """What the base's content depends on (not where the packages were fetched from)."""
        return {"distro": self.distro, "suite": self.suite, "os_image": self.os_image,
                "packages": sorted(self.packages), "python": self.python}

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        return f"{self.name}-{digest[:12]}"


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    device: str                     # cpu | cuda | rocm
    base: Base
    python_version: str             # "3.11"
    platform: str                   # newest manylinux tag the base's glibc accepts
    paddle: str                     # "paddlepaddle==3.3.1"
    extras: tuple[str, ...]
    tools: tuple[str, ...]
    libraries: tuple[str, ...] = ()    # the GPU libraries Paddle opens at run time: one layer below Paddle's
    constraints: tuple[str, ...] = ()  # versions the lock must choose, installed only where something needs them
    no_deps: tuple[str, ...] = ()      # installed without their dependencies (locked apart): a part of a package
                                       # that needs only what the image has (VisualDL's LogWriter, not its server)
    paddle_index: str = ""          # Paddle's own index, for GPU/DCU wheels
    pypi: str = "https://pypi.org/simple"
    image: str = "fleetbox/paddle"
    base_repo: str = "fleetbox/base"
    accel: dict = field(default_factory=dict)    # cuda/cudnn/dtk versions, for docs and labels
    runtime: dict = field(default_factory=dict)  # devices, groups, mounts a container needs
    min_driver: str = ""            # CUDA variants: the oldest host driver that runs it (minor-version compatibility)
    toolkit_driver: str = ""        # ... and the driver of its own CUDA release (PTX JIT needs it); invoke doctor
    # CUDA variants: the architectures Paddle publishes its wheel as built for ("8.0"), and where it says so; what
    # a variant runs on is measured from its wheel by `invoke wheels` (image/kernels.py), these stand in until then
    published_capabilities: tuple[str, ...] = ()
    published_source: str = ""

    @property
    def paddle_name(self) -> str:
        return self.paddle.split("==")[0]

    @property
    def paddle_version(self) -> str:
        return self.paddle.split("==")[1]

    @property
    def py_tag(self) -> str:
        return "py" + self.python_version.replace(".", "")

    @property
    def requirements(self) -> list[str]:
        return [*self.libraries, self.paddle, *self.extras, *self.tools]

    @property
    def lock_path(self) -> Path:
        return LOCK_DIR / f"{self.name}.lock"

    @property
    def base_ref(self) -> str:
        return f"{self.base_repo}:{self.base.tag}"

    @property
    def aliases(self) -> list[str]:
        return [f"{self.image}:{self.name}", f"{self.image}:{self.paddle_version}-{self.name}-{self.py_tag}"]

    def index_for(self, package: str) -> str:
        """Paddle's own wheel comes from Paddle's index when it has one; everything else from PyPI."""
        if self.paddle_index and _norm(package) == _norm(self.paddle_name):
            return self.paddle_index
        return self.pypi


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@dataclass(frozen=True)
class Matrix:
    variants: dict[str, Variant]
    default: str

    def get(self, name: str | None) -> Variant:
        name = name or self.default
        if name not in self.variants:
            raise UserError(f"unknown variant {name!r}; valid variants: {', '.join(self.variants)}")
        return self.variants[name]


_REQUIRED = ("device", "base", "python_version", "platform", "paddle")


def parse(data: dict) -> Matrix:
    bases = {}
    for name, b in data.get("bases", {}).items():
        bases[name] = Base(name=name, description=b.get("description", ""), os_image=b.get("os_image", ""),
                           distro=b.get("distro", ""), python=b["python"], packages=tuple(b.get("packages", [])),
                           suite=b.get("suite", ""), mirror=b.get("mirror", ""))
    variants = {}
    for name, v in data.get("variants", {}).items():
        missing = [k for k in _REQUIRED if k not in v]
        if missing:
            raise UserError(f"matrix: variant {name!r} lacks {', '.join(missing)}")
        if name == settings.board_wheels().name:   # a variant's wheelhouse would be the board's
            raise UserError(f"matrix: a variant may not be named {name!r}: its wheelhouse folder is the board's")
        if v["base"] not in bases:
            raise UserError(f"matrix: variant {name!r} names unknown base {v['base']!r}")
        if "==" not in v["paddle"]:
            raise UserError(f"matrix: variant {name!r} must pin paddle exactly (name==version)")
        accel = {k: v[k] for k in ("cuda", "cudnn", "dtk") if k in v}
        variants[name] = Variant(
            name=name, description=v.get("description", ""), device=v["device"], base=bases[v["base"]],
            python_version=v["python_version"], platform=v["platform"], paddle=v["paddle"],
            extras=tuple(v.get("extras", [])), tools=tuple(v.get("tools", [])),
            libraries=tuple(v.get("libraries", [])), constraints=tuple(v.get("constraints", [])),
            no_deps=tuple(v.get("no_deps", [])),
            paddle_index=v.get("paddle_index", ""), pypi=data.get("pypi", "https://pypi.org/simple"),
            image=data.get("image", "fleetbox/paddle"), base_repo=data.get("base_image", "fleetbox/base"),
            accel=accel, runtime=v.get("runtime", {}), min_driver=v.get("min_driver", ""),
            toolkit_driver=v.get("toolkit_driver", ""), published_capabilities=_capabilities(name, v),
            published_source=v.get("published_source", ""))
    default = data.get("default_variant", next(iter(variants), ""))
    if default not in variants:
        raise UserError(f"matrix: default_variant {default!r} is not a variant")
    return Matrix(variants=variants, default=default)


def _capabilities(name: str, v: dict) -> tuple[str, ...]:
    if "compute_capabilities" in v:
        raise UserError(f"matrix: variant {name!r}: compute_capabilities are measured from the wheel (`invoke "
                        f"wheels`), never written here; give what Paddle publishes as published_capabilities, with "
                        f"its published_source")
    caps = tuple(v.get("published_capabilities", []))
    bad = [c for c in caps if not re.fullmatch(r"\d+\.\d+", str(c))]
    if bad:
        raise UserError(f"matrix: variant {name!r}: compute capability {bad[0]!r} is not MAJOR.MINOR (e.g. 8.0)")
    if caps and not v.get("published_source"):
        raise UserError(f"matrix: variant {name!r}: published_capabilities need their published_source")
    return caps


def load(path: Path = MATRIX_PATH) -> Matrix:
    try:
        return parse(tomllib.loads(path.read_text()))
    except FileNotFoundError:
        raise UserError(f"matrix not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"matrix {path}: {e}") from None


def gpu_variants(path: Path = MATRIX_PATH) -> list[str]:
    """The names of the variants that run on an accelerator, in the matrix's order."""
    return [name for name, v in load(path).variants.items() if v.device != "cpu"]
