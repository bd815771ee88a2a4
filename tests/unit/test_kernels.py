"""Which GPUs a wheel runs on, from its fat binaries (image/kernels.py): the reader on fat binaries laid out as nvcc
lays them out, the rules (CUDA's binary compatibility, PTX compiled at first use), the record beside the lock."""
import struct
import zipfile
from collections import Counter

import pytest

from fleetbox.data import fetch
from fleetbox.image import kernels, locks, matrix
from fleetbox.image.kernels import Kernels


def fatbin(*images: tuple[str, int]) -> bytes:
    """One fat binary as nvcc links it: the header (magic, version, header size, payload size), then each image's
    entry (kind 1 PTX, 2 SASS; its header's size; its payload's size; the architecture at byte 28), then its
    payload."""
    body = b""
    for kind, number in images:
        payload = b"\x7fELF" + bytes(60)
        head = struct.pack("<HHIQ", {"ptx": 1, "sass": 2}[kind], 0x0101, 64, len(payload))
        head += bytes(28 - len(head)) + struct.pack("<I", number)
        body += head + bytes(64 - len(head)) + payload
    return kernels.MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body


COMMON = [("sass", 61), ("sass", 70), ("sass", 75), ("sass", 80), ("sass", 86)]


def library(*fats: bytes) -> bytes:
    """A shared library's bytes: code around the fat binaries, as the linker places them."""
    return b"\x7fELF" + bytes(100) + b"".join(f + bytes(24) for f in fats) + b"\0" * 50


def test_each_fat_binary_is_read_with_its_images(tmp_path):
    lib = tmp_path / "libpaddle.so"
    lib.write_bytes(library(fatbin(*COMMON), fatbin(*COMMON), fatbin(("sass", 80), ("ptx", 80))))
    got = kernels.fatbins(lib)
    assert got == Counter({frozenset((k, f"{n // 10}.{n % 10}") for k, n in COMMON): 2,
                           frozenset({("sass", "8.0"), ("ptx", "8.0")}): 1})
    (tmp_path / "empty.so").write_bytes(b"")
    assert kernels.fatbins(tmp_path / "empty.so") == Counter()


def measured(core: list[bytes], other: list[bytes] = ()) -> Kernels:
    libs = {"paddle/base/libpaddle.so": Counter(), "paddle/libs/libflashattn.so": Counter()}
    for name, fats in (("paddle/base/libpaddle.so", core), ("paddle/libs/libflashattn.so", other)):
        for f in fats:
            images = frozenset((k, f"{n // 10}.{n % 10}") for k, n in
                               ((("ptx", "sass")[f[i] - 1], struct.unpack_from("<I", f, i + 28)[0])
                                for i in range(16, len(f), 128)))
            libs[name][images] += 1
    return Kernels(libs, "w.whl", "0" * 64)


def test_a_gpu_runs_sass_of_its_major_version_and_no_newer_minor_and_ptx_of_any_older_architecture():
    """cu118-pypi's shape: Paddle's build's kernels SASS 6.1 to 8.6, a few linked-in ones built otherwise (6.0 to
    9.0 with PTX 8.0, as libphi's), flash attention for 8.0 only (another library, not held to)."""
    k = measured([fatbin(*COMMON)] * 3 + [fatbin(("sass", 60), ("sass", 70), ("sass", 80), ("sass", 90),
                                                 ("ptx", 80))], [fatbin(("sass", 80))])
    assert k.architectures == ("6.1", "7.0", "7.5", "8.0", "8.6") and k.strays() == (1, 4)
    assert [k.how(c) for c in ("6.0", "6.1", "7.2", "8.6", "8.9", "9.0", "10.0", "12.0")] == \
        ["", "native", "native", "native", "native", "", "", ""]
    assert k.others() == {"paddle/libs/libflashattn.so": ["8.0"]}
    assert k.said().endswith("; 1 of its 4 fat binaries are linked-in code built for other architectures)")
    # a build with PTX of its newest architecture: every newer GPU runs it, compiled at first use
    k = measured([fatbin(*COMMON, ("ptx", 86))] * 2 + [fatbin(("sass", 90))])
    assert [k.how(c) for c in ("8.6", "8.9", "9.0", "10.0", "6.0")] == ["native", "native", "ptx", "ptx", ""]
    g = k.gpus()
    assert g["ptx"] == ["9.0 (H100/H200/GH200)", "10.0 (B200/GB200)", "12.0 (RTX 50/RTX PRO 6000)"]
    assert g["none"] == ["6.0 (P100)"]
    assert "; through PTX compiled at first run (a slow first start) on 9.0 (H100/H200/GH200), " in k.said()
    assert measured([]).how("8.0") == "" and measured([]).architectures == ()   # nothing read: nothing claimed


def test_the_record_reads_back_as_measured(tmp_path):
    k = measured([fatbin(*COMMON)] * 2, [fatbin(("sass", 80), ("sass", 90))])
    again = Kernels.of_json(k.as_json())
    assert again == k and again.measured and again.label() == "6.1,7.0,7.5,8.0,8.6 measured"


def test_a_wheel_is_measured_from_its_libraries(tmp_path):
    wheel = tmp_path / "paddlepaddle_gpu-9.9-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("paddle/base/libpaddle.so", library(*[fatbin(*COMMON)] * 40))
        z.writestr("paddle/libs/libphi.so.3", library(fatbin(*COMMON), fatbin(("sass", 90))))
        z.writestr("paddle/libs/libflashattn.so", library(fatbin(("sass", 80), ("sass", 90))))
        z.writestr("paddle/libs/libmklml_intel.so", b"\x7fELF no kernels")
        z.writestr("paddle/__init__.py", "")
    said = []
    k = kernels.measure(wheel, said.append)
    assert k.sha256 == fetch.file_digest(wheel) and k.wheel == wheel.name
    assert sorted(k.libraries) == ["paddle/base/libpaddle.so", "paddle/libs/libflashattn.so", "paddle/libs/libphi.so.3"]
    assert sum(k.libraries["paddle/base/libpaddle.so"].values()) == 40
    assert k.architectures == ("6.1", "7.0", "7.5", "8.0", "8.6") and k.strays() == (1, 42)
    assert k.others() == {"paddle/libs/libflashattn.so": ["8.0", "9.0"]}
    assert said[0].startswith(f"kernels of {wheel.name}: 43 fat binaries in 3 of its 4 libraries, read in ")


@pytest.fixture
def locked(tmp_path, monkeypatch):
    """A variant's lock and record in a folder of the test's own."""
    monkeypatch.setattr(matrix, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(kernels, "LOCK_DIR", tmp_path)
    v = matrix.load().get("cu126")
    (tmp_path / "cu126.lock").write_text(f"{locks.header(v)}paddlepaddle-gpu==3.3.1 \\\n    --hash=sha256:{'a' * 64}\n")
    return v


def test_the_record_counts_only_for_the_wheel_the_lock_allows_else_the_published_architectures(locked, tmp_path):
    k = measured([fatbin(*COMMON, ("sass", 90))])
    kernels.files.write_json(tmp_path / "cu126.kernels.json", {**k.as_json(), "sha256": "a" * 64})
    assert kernels.load(locked) == Kernels.of_json({**k.as_json(), "sha256": "a" * 64})
    kernels.files.write_json(tmp_path / "cu126.kernels.json", k.as_json())   # another wheel's: the lock moved on
    got = kernels.load(locked)
    assert not got.measured and got.architectures == locked.published_capabilities
    assert got.said().endswith(f"(published, not measured: {locked.published_source})")
    (tmp_path / "cu126.kernels.json").write_text("{damaged")
    assert not kernels.load(locked).measured
    assert kernels.load(matrix.load().get("cpu")) is None


def test_four_bytes_that_only_look_like_the_magic_are_passed_over(tmp_path):
    """A stray 0xBA55ED50 (not version 1, a 16-byte header) claiming a terabyte is not a fat binary."""
    lib = tmp_path / "libphi.so"
    stray = kernels.MAGIC + struct.pack("<HHQ", 7, 99, 1 << 40)
    lib.write_bytes(library(stray, fatbin(*COMMON), fatbin(*COMMON)))
    assert sum(kernels.fatbins(lib).values()) == 2


@pytest.mark.parametrize("damage", [{"images": ["sass 8.0 x"], "count": 1}, {"images": ["sass8.0"], "count": 1},
                                    {"images": ["sass 8"], "count": 1}, {"images": ["sass 8.0"], "count": 0},
                                    {"images": ["sass 8.0"], "count": "3"}])
def test_a_record_edited_or_of_no_paddle_kernel_is_not_read_and_doctor_holds_nothing_to_it(locked, tmp_path, damage):
    k = measured([fatbin(*COMMON)])
    data = {**k.as_json(), "sha256": "a" * 64}
    data["libraries"]["paddle/base/libpaddle.so"].append(damage)
    kernels.files.write_json(tmp_path / "cu126.kernels.json", data)
    assert not kernels.load(locked).measured   # the published list instead: never a traceback in build or doctor
    flash_only = {"wheel": "w.whl", "sha256": "a" * 64, "libraries": {"paddle/libs/libflashattn.so": [
        {"images": ["sass 8.0"], "count": 3}]}}
    kernels.files.write_json(tmp_path / "cu126.kernels.json", flash_only)
    assert not kernels.load(locked).measured

