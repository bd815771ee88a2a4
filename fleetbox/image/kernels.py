"""Which GPUs a Paddle wheel runs on, measured from the wheel itself: its libraries' fat binaries (the
`.nv_fatbin` payloads nvcc links in: a header with magic 0xBA55ED50, then one entry per kernel image, each naming
its kind, SASS or PTX, and its architecture, e.g. 80 for sm_80), read as `cuobjdump --list-elf` lists them,
without the CUDA toolkit.

`invoke wheels` measures the variant's Paddle wheel once and keeps the record beside its lock
(images/locks/<variant>.kernels.json, named by the wheel's sha256): `build --dry-run`, the image's labels,
`verify`, doctor and the matrix page read it. A variant whose wheel was never fetched here has the architectures
Paddle publishes for its CUDA (matrix.toml's published_capabilities), said as published, not measured.
"""

from __future__ import annotations

import functools
import mmap
import re
import shutil
import struct
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from fleetbox import files
from fleetbox.data import fetch
from fleetbox.errors import UserError
from fleetbox.image import locks
from fleetbox.image.matrix import LOCK_DIR, Variant

MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "ptx", 2: "sass"}
# Paddle's own kernels: every op a training script runs is in them. Other libraries in the wheel (flash attention,
# warpctc) run only in the ops that call them, each for its own architectures: listed apart, not held to.
CORE = re.compile(r"lib(paddle|phi|common)[^/]*\.so[.0-9]*")

# The compute capabilities GPUs are known by (NVIDIA's CUDA GPUs list), lowest first
GPUS = {"6.0": "P100", "6.1": "P40/GTX 10", "7.0": "V100", "7.5": "T4/RTX 20", "8.0": "A100/A30",
        "8.6": "A10/A40/RTX 30", "8.9": "L4/L40S/RTX 40", "9.0": "H100/H200/GH200", "10.0": "B200/GB200",
        "12.0": "RTX 50/RTX PRO 6000"}


def capability(text: str) -> tuple[int, int] | None:
    """"8.6" -> (8, 6); None for what is not one ("[N/A]")."""
    m = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


IMAGE = re.compile(r"(sass|ptx) (\d+\.\d+)")   # a kernel image as the record keeps it


def fatbins(path: Path) -> Counter:
    """The file's fat binaries, counted by what each holds: frozenset({("sass", "8.0"), ("ptx", "8.0"), ...})."""
    out: Counter = Counter()
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            return out
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pos = m.find(MAGIC)
            while pos != -1 and pos + 16 <= len(m):
                version, header_size, size = struct.unpack_from("<HHQ", m, pos + 4)
                if (version, header_size) != (1, 16):   # four bytes that only look like the magic
                    pos = m.find(MAGIC, pos + 4)
                    continue
                p, end, images = pos + header_size, min(pos + header_size + size, len(m)), set()
                while p + 32 <= end:
                    kind, _, entry_size, payload = struct.unpack_from("<HHIQ", m, p)
                    number = struct.unpack_from("<I", m, p + 28)[0]
                    if kind in KINDS:
                        images.add((KINDS[kind], f"{number // 10}.{number % 10}"))
                    if not entry_size:
                        break
                    p += entry_size + payload
                if images:
                    out[frozenset(images)] += 1
                pos = m.find(MAGIC, max(end, pos + 4))
    return out


def runs(images, gpu: tuple[int, int]) -> str:
    """How a GPU of compute capability `gpu` runs one fat binary's kernel: "native" (a SASS image of its major
    version and a minor no newer: CUDA's binary compatibility, sm_80 runs on 8.6, not on 9.0), "ptx" (compiled
    from PTX of an architecture no newer, by the driver at first use), or "" (not at all)."""
    if any(k == "sass" and (c := capability(a))[0] == gpu[0] and c[1] <= gpu[1] for k, a in images):
        return "native"
    return "ptx" if any(k == "ptx" and capability(a) <= gpu for k, a in images) else ""


@dataclass(frozen=True)
class Kernels:
    """A wheel's fat binaries, by library (its path in the wheel) and content, counted; and where the answer comes
    from: "measured" (the wheel read here) or "published" (what Paddle says it builds, `source`)."""
    libraries: dict      # path -> Counter of frozensets, as fatbins() counts them ({} where published)
    wheel: str = ""
    sha256: str = ""
    source: str = ""     # published: where it is said
    published: tuple = ()   # published: the architectures

    @property
    def measured(self) -> bool:
        return not self.published

    @functools.cached_property
    def core(self) -> Counter:
        """Paddle's own libraries' fat binaries, counted together."""
        return sum((c for p, c in self.libraries.items() if CORE.fullmatch(p.rsplit("/", 1)[-1])), Counter())

    @functools.cached_property
    def build(self) -> frozenset:
        """What Paddle's build compiled its kernels for (nvcc's -gencode list, what Paddle itself says it was
        "compiled for"): the images most of its fat binaries hold (the few others are code its libraries link in
        from projects built with their own lists: libphi.so's 8 of 673, in Paddle 2.6.2); where published, SASS of
        each published architecture."""
        if not self.measured:
            return frozenset(("sass", a) for a in self.published)
        common = self.core.most_common(1)
        return common[0][0] if common else frozenset()

    def how(self, gpu: str) -> str:
        """"native", "ptx" (compiled from PTX by the driver at the first start) or "" for a GPU of compute
        capability `gpu`."""
        return runs(self.build, capability(gpu))

    @property
    def architectures(self) -> tuple[str, ...]:
        """The SASS architectures of Paddle's kernels ("8.0"), lowest first."""
        return tuple(sorted({a for k, a in self.build if k == "sass"}, key=capability))

    def strays(self) -> tuple[int, int]:
        """(how many of Paddle's fat binaries hold other images than its build's, of how many)."""
        total = sum(self.core.values())
        return total - self.core.get(self.build, 0), total

    def gpus(self) -> dict[str, list[str]]:
        """The known GPUs (GPUS), each "cc (names)", by how they run the wheel: native, ptx, none."""
        out: dict[str, list[str]] = {"native": [], "ptx": [], "none": []}
        for cc, names in GPUS.items():
            out[self.how(cc) or "none"].append(f"{cc} ({names})")
        return out

    def others(self) -> dict[str, list[str]]:
        """Each other library (flash attention, ...): the SASS architectures in every one of its fat binaries."""
        out = {}
        for p, c in sorted(self.libraries.items()):
            if not CORE.fullmatch(p.rsplit("/", 1)[-1]) and c:
                common = set.intersection(*({a for k, a in images if k == "sass"} for images in c))
                out[p] = sorted(common, key=capability)
        return out

    def said(self) -> str:
        """One line: what it runs on, and from where that is known."""
        g = self.gpus()
        text = (f"SASS {', '.join(self.architectures) or 'none'}: runs on {', '.join(g['native']) or 'no known GPU'}"
                + (f"; through PTX compiled at first run (a slow first start) on {', '.join(g['ptx'])}"
                   if g["ptx"] else "") + f"; not on {', '.join(g['none']) or 'none'}")
        stray, total = self.strays() if self.measured else (0, 0)
        return text + (f" (measured from {self.wheel}" + (f"; {stray} of its {total} fat binaries are linked-in "
                                                          f"code built for other architectures" if stray else "")
                       + ")" if self.measured else f" (published, not measured: {self.source})")

    def label(self) -> str:
        """The image label's value: the architectures, and how they are known."""
        return ",".join(self.architectures) + (" measured" if self.measured else " published")

    def as_json(self) -> dict:
        return {"wheel": self.wheel, "sha256": self.sha256, "libraries": {
            p: [{"images": sorted(f"{k} {a}" for k, a in images), "count": n}
                for images, n in sorted(c.items(), key=lambda kv: (-kv[1], sorted(kv[0])))]
            for p, c in sorted(self.libraries.items())}}

    @classmethod
    def of_json(cls, data: dict) -> Kernels:
        """The record as as_json() wrote it; ValueError for anything else (an edit, another version's)."""
        libs = {}
        for p, entries in data["libraries"].items():
            libs[p] = Counter()
            for e in entries:
                images = [IMAGE.fullmatch(i) for i in e["images"]]
                if not all(images) or type(e["count"]) is not int or e["count"] < 1:
                    raise ValueError(f"{p}: {e}")
                libs[p][frozenset(m.groups() for m in images)] += e["count"]
        k = cls(libs, str(data["wheel"]), str(data["sha256"]))
        if not k.build:
            raise ValueError("no kernel of Paddle's own in it")
        return k


def measure(wheel: Path, log=print) -> Kernels:
    """Every library's fat binaries in the wheel, each unpacked to a temporary file and read there."""
    began = time.monotonic()
    libraries = {}
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory(prefix="fleetbox-kernels-") as tmp:
        members = [i for i in z.infolist() if re.search(r"\.so[.0-9]*$", i.filename)]
        for i in members:
            part = Path(tmp) / "lib"
            with z.open(i) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
            found = fatbins(part)
            if found:
                libraries[i.filename] = found
    k = Kernels(libraries, wheel.name, fetch.file_digest(wheel))
    log(f"kernels of {wheel.name}: {sum(sum(c.values()) for c in libraries.values())} fat binaries in "
        f"{len(libraries)} of its {len(members)} libraries, read in {time.monotonic() - began:.0f} s")
    return k


def record_path(variant: Variant) -> Path:
    return LOCK_DIR / f"{variant.name}.kernels.json"


def paddle_entry(variant: Variant, entries) -> locks.Locked:
    return next(e for e in entries if canonicalize_name(e.name) == canonicalize_name(variant.paddle_name))


def load(variant: Variant) -> Kernels | None:
    """The variant's kernels: measured where its record names a wheel its lock allows, else published where the
    matrix gives them, else None (a CPU or DCU variant, or a CUDA one nobody has said)."""
    if variant.device != "cuda":
        return None
    data = files.read_json(record_path(variant))
    if data and variant.lock_path.exists():
        try:
            k = Kernels.of_json(data)
            if k.sha256 in paddle_entry(variant, locks.parse(variant.lock_path.read_text())).hashes:
                return k
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration):
            pass   # damaged, or of another lock: measured again by `invoke wheels`
    if variant.published_capabilities:
        return Kernels({}, source=variant.published_source, published=variant.published_capabilities)
    return None


def ensure(variant: Variant, wheelhouse: Path, log=print) -> Kernels | None:
    """The record of the wheelhouse's Paddle wheel, measured where it has none (or one of another wheel)."""
    if variant.device != "cuda":
        return None
    _, entries = locks.read(variant)
    entry = paddle_entry(variant, entries)
    known = load(variant)
    if known is not None and known.measured and known.sha256 in entry.hashes:
        return known
    wheel = next((p for p in sorted(wheelhouse.glob("*.whl")) if canonicalize_name(p.name.split("-")[0]) ==
                  canonicalize_name(entry.name) and fetch.file_digest(p) in entry.hashes), None)
    if wheel is None:
        raise UserError(f"wheelhouse {wheelhouse} has no {entry.name} wheel of the lock to measure")
    k = measure(wheel, log)
    if not k.build:
        raise UserError(f"{wheel.name} holds no GPU kernel of Paddle's own (no fat binary in libpaddle, libphi or "
                        f"libcommon): not a CUDA build of Paddle?")
    files.write_json(record_path(variant), k.as_json())
    log(f"{record_path(variant).name}: {k.said()}")
    return k
